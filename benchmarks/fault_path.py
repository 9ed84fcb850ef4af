"""Which of the engine's files a fault crosses, measured: a memory error under retry, and a kill under
recover, each in a real job of the tiny GPT (4 ranks, ``mindspeed-ha run``).

    python benchmarks/fault_path.py

Every process of the job (agent, spare template, workers, the controller's rank) runs with a profiler
(a ``sitecustomize`` on ``PYTHONPATH``) that notes, for each file of ``mindspeed_ha/`` and
``patches/``, the 10 ms slots in which one of its functions was called, on any thread. A fault's route
is every file called between the fault (its ``inject`` event) and the end of the first step after the
recovery (the controller's ``recovered`` event), in any process; its own files are those of the route
that no process called in the same length of time before the fault, while the job trained. Prints
both by folder, and as the last line one JSON object: each drill's counts and files.
"""
from __future__ import annotations

import collections
import glob
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import jobs  # noqa: E402  (how every benchmark starts a job)
from job_phases import PRETRAIN, TINY, events  # noqa: E402

DRILLS = {
    "memory error, retry": (["--enable-hbmfault-repair"], "uce:rank=2:step=5:phase=backward"),
    "kill, recover": (["--enable-worker-reboot"], "kill:rank=1:step=5:phase=optimizer"),
}
PROFILER = '''
import json, os, sys, threading, time
_ROOTS = tuple(os.environ["FAULT_PATH_ROOTS"].split(os.pathsep))
_OUT = os.environ["FAULT_PATH_OUT"]
_seen = {}

def _profile(frame, event, arg):
    if event == "call":
        f = frame.f_code.co_filename
        if f.startswith(_ROOTS):
            slots = _seen.get(f)
            if slots is None:
                slots = _seen[f] = set()
            slots.add(int(time.time() * 100))

def _write():
    path = os.path.join(_OUT, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as out:
        json.dump({f: sorted(s) for f, s in list(_seen.items())}, out)
    os.replace(path + ".tmp", path)

def _writer():
    while True:
        time.sleep(0.25)
        try:
            _write()
        except Exception:
            pass

def _start():
    _seen.clear()
    threading.Thread(target=_writer, daemon=True).start()

sys.setprofile(_profile)
threading.setprofile(_profile)
os.register_at_fork(after_in_child=_start)
_start()
'''


def run(name: str, root: str) -> dict:
    extra, inject = DRILLS[name]
    d = tempfile.mkdtemp(dir=root)
    site, out = os.path.join(d, "site"), os.path.join(d, "calls")
    os.makedirs(site)
    os.makedirs(out)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(PROFILER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MINDSPEED_HA_INJECT=inject,
               PYTHONPATH=os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])),
               FAULT_PATH_OUT=out,
               FAULT_PATH_ROOTS=os.pathsep.join(os.path.join(ROOT, p) + os.sep for p in ("mindspeed_ha", "patches")))
    env.pop("MEGATRON_LM_PATH", None)  # (it would send the example to Megatron-LM's loop)
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "4", PRETRAIN,
           *TINY, *extra, "--ha-log-dir", os.path.join(d, "logs")]
    p = jobs.run(cmd, env=env, cwd=d, capture_output=True, text=True, timeout=900, log_dir=d)
    ev = events(os.path.join(d, "logs"))
    fault = min((e["time"] for e in ev if e["event"] == "inject"), default=None)
    done = [e["time"] for e in ev if e["event"] == "recovered"]
    if p.returncode or fault is None or not done:
        raise RuntimeError(f"{name}: the drill did not recover (exit {p.returncode})\n{p.stderr[-3000:]}")
    start, end = int(fault * 100), int(done[0] * 100) + 1
    before = (start - (end - start), start)
    route, steady = set(), set()
    for path in glob.glob(os.path.join(out, "*.json")):
        for f, slots in json.load(open(path)).items():
            rel = os.path.relpath(f, ROOT)
            if any(start <= s <= end for s in slots):
                route.add(rel)
            if any(before[0] <= s < before[1] for s in slots):
                steady.add(rel)
    own = route - steady
    return {"route": sorted(route), "own": sorted(own), "files": len(route), "own_files": len(own),
            "folders": len({os.path.dirname(f) for f in route}), "window_s": round(done[0] - fault, 3)}


def by_folder(files: list[str]) -> str:
    groups = collections.defaultdict(list)
    for f in files:
        groups[os.path.dirname(f)].append(os.path.basename(f))
    return "\n".join(f"    {folder}/: {', '.join(sorted(names))}" for folder, names in sorted(groups.items()))


def main() -> None:
    root = tempfile.mkdtemp(prefix="fault_path_")
    result = {}
    for name in DRILLS:
        r = run(name, root)
        result[name] = r
        print(f"{name}: {r['files']} files in {r['folders']} folders from the fault to the first step after the "
              f"recovery ({r['window_s']:.2f} s); {r['own_files']} of them the fault's own (not called in the same "
              f"time before it)", flush=True)
        print("  route:\n" + by_folder(r["route"]), flush=True)
        print("  own:\n" + by_folder(r["own"]), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
