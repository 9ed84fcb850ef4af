"""``mindspeed-ha report DIR [DIR ...]``: every fault of a job and what became of it, from its event
logs (nodes with their own log dirs: name them all; the controller's events may be in several, one
per controller that was active).

One row per episode (a fault and what followed: the strategy, then ``recovered``, a dying-gasp
``checkpoint``, a refusal or the exit; a migration is an episode whose fault is ``migrate``; an elastic
scale-in is a recovery, "data-parallel size 4 -> 2", and a scale-out an episode of its own, from the
returned ranks' registration to ``scaled_out``), and a timeline picture, ``DIR/recovery_timeline.png``:
training progress (iteration over time) with each episode shaded from the fault to its end and its
recovery phases drawn as bars. The picture needs matplotlib (``pip install mindspeed-ha[report]``).

A fault drill that never fired (a rank ended without reaching its phase and step) is an error: it is
named on stderr, and the report exits 1.
"""
from __future__ import annotations

import json
import os
import sys

from mindspeed_ha.events import read_events

END_EVENTS = ("recovered", "scaled_out", "diagnosis")
PHASE_COLORS = {"detect": "tab:gray", "stop": "tab:orange", "status": "tab:olive", "rebuild": "tab:red",
                "repair": "tab:purple", "reload": "tab:purple", "rollback": "tab:pink", "resume": "tab:cyan",
                "rebuild+repair": "tab:purple", "rollback+resume": "tab:pink",  # (two rounds as one order)
                "first_step": "tab:blue", "scale-in": "tab:brown", "scale-out": "tab:brown"}


def _events(log_dirs, prefix: str) -> list[dict]:
    """Events of every ``events/<prefix>*.jsonl`` in the dirs, in time order."""
    out = []
    for d in log_dirs:
        ev = os.path.join(d, "events")
        for name in sorted(os.listdir(ev)) if os.path.isdir(ev) else ():
            if name.startswith(prefix):
                out += read_events(os.path.join(ev, name))
    return sorted(out, key=lambda e: e["time"])


def episodes(log_dirs) -> list[dict]:
    log_dirs = [log_dirs] if isinstance(log_dirs, str) else list(log_dirs)
    events = _events(log_dirs, "controller.jsonl")
    if not events:
        raise FileNotFoundError(f"no controller events in {', '.join(log_dirs)} (was the job run with HA on and "
                                "--ha-log-dir there? with node-local dirs, name every node's)")
    out, cur = [], None
    for e in events:
        kind = e["event"]
        if kind == "scale_out_requested":  # no fault: returned ranks; an episode of its own
            e = {**e, "kind": "scale-out", "phase": "boundary"}
        if kind in ("fault", "scale_out_requested"):
            if cur is None:
                cur = {"start": e["time"], "faults": [], "strategy": None, "outcome": "open", "end": None}
                out.append(cur)
            cur["faults"].append(e)
        elif kind in ("migrated", "migrate_abandoned") and out:  # (after the episode's end)
            ep = out[-1]
            ep["outcome"] = (f"migrated: pid {e['old_pid']} -> {e['new_pid']}, training paused {e['pause_s']:.3f}s"
                             if kind == "migrated" else "migration abandoned: the job ended first")
            continue
        elif cur is None:
            continue
        elif kind == "strategy":
            cur["strategy"] = e["reason"].replace("strategy ", "") if e["outcome"] != "no-strategy" else "none"
        elif kind == "scaled_out":
            cur.update(outcome=f"scaled out (data-parallel size {e['old_dp']} -> {e['dp']})", end=e["time"],
                       mttr_s=e["seconds"], lost_steps=0, phases=e["phases"], iteration=e["iteration"])
        elif kind == "recovered":
            cur.update(outcome=f"recovered ({e.get('how', '')})", end=e["time"], mttr_s=e["mttr_s"],
                       lost_steps=e["lost_steps"], phases=e["phases"], iteration=e["iteration"])
        elif kind == "checkpoint" and e.get("kind") == "dying_gasp":
            cur.update(outcome=f"dump of iteration {e['iteration']} in {e['seconds']:.2f}s", dump=e,
                       iteration=e["iteration"], lost_steps=0)
        elif kind == "strategy_failed":  # (the dump follows: its outcome, if any, says what was saved)
            cur["outcome"] = f"{e.get('strategy', 'the strategy')} failed: {e.get('reason', '')}"[:120]
        elif kind == "dump_refused":
            cur["outcome"] = "dump refused"
        elif kind == "diagnosis":
            cur["end"] = e["time"]
            if cur["outcome"] == "open":
                cur["outcome"] = "job ended"
            cur["outcome"] += f", exit {e['exit_code']}"
        if cur is not None and kind in END_EVENTS:
            cur = None
    return out


def unfired(log_dirs) -> list[dict]:
    """The drills no process fired, once each (every process of a rank reports its own)."""
    seen: dict[str, dict] = {}
    for e in _events([log_dirs] if isinstance(log_dirs, str) else list(log_dirs), "rank_"):
        if e["event"] == "drill_unfired":
            seen.setdefault(e["spec"], e)
    return list(seen.values())


CLASS_MEANING = {"setup": "setup (before the job's first step: not recovered)",
                 "software": "software (an error of the job's own code: recovered once at most)",
                 "fault": "fault (recovered up to --ha-max-recurrences times at one iteration)"}


def table(eps: list[dict]) -> str:
    head = f"{'#':>2}  {'fault':34s} {'iter':>5} {'phase':10s} {'strategy':9s} {'MTTR s':>7} {'lost':>4}  outcome"
    rows = [head, "-" * len(head)]
    for n, ep in enumerate(eps, 1):
        f = next((x for x in ep["faults"] if x["kind"] != "comm-failure"), ep["faults"][0])
        what = f"rank {','.join(map(str, f['ranks']))} {f['kind']}"
        mttr = f"{ep['mttr_s']:.3f}" if "mttr_s" in ep else "-"
        lost = str(ep["lost_steps"]) if "lost_steps" in ep else "-"
        rows.append(f"{n:>2}  {what[:34]:34s} {f['iteration']:>5} {f['phase'][:10]:10s} {str(ep['strategy'])[:9]:9s} "
                    f"{mttr:>7} {lost:>4}  {ep['outcome']}")
        if "phases" in ep:
            rows.append("    phases: " + ", ".join(f"{k} {v:.3f}s" for k, v in ep["phases"].items()))
        # (a rank's own error: which class it fell in — setup, software or fault — and where it was raised)
        if f.get("fault_class") and f["kind"] in ("other", "memory-error", "comm-failure"):
            rows.append(f"    class: {CLASS_MEANING.get(f['fault_class'], f['fault_class'])}"
                        + (f"; raised at {f['frame']}" if f.get("frame") else ""))
    if not eps:
        rows.append("    no fault recorded")
    return "\n".join(rows)


def timeline(log_dirs, eps: list[dict], path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    log_dirs = [log_dirs] if isinstance(log_dirs, str) else list(log_dirs)
    steps = [e for e in _events(log_dirs, "rank_") if e["event"] == "step"]
    t0 = min([e["time"] for e in steps] + [ep["start"] for ep in eps] or [0.0])
    fig, ax = plt.subplots(figsize=(10, 4))
    steps.sort(key=lambda e: e["time"])
    ax.plot([e["time"] - t0 for e in steps], [e["iteration"] for e in steps], ".-", lw=1, label="step completed")
    top = max([e["iteration"] for e in steps] or [1])
    colors = {"retry": "tab:green", "dump": "tab:orange", "scale-out": "tab:blue"}
    labelled: set = set()
    for n, ep in enumerate(eps, 1):
        start, end = ep["start"] - t0, (ep["end"] or ep["start"]) - t0
        ax.axvspan(start, max(end, start + 0.01), color=colors.get(ep["strategy"], "tab:red"), alpha=0.25)
        ax.annotate(f"#{n} {ep['faults'][0]['kind']}\n{ep['outcome'][:28]}", (start, top), fontsize=7, va="top")
        x = start
        for name, seconds in (ep.get("phases") or {}).items():  # the recovery's phases, in order
            color = PHASE_COLORS.get(name, "grey")
            ax.barh(-0.5 - 0.6 * (n % 2), seconds, left=x, height=0.5, color=color,
                    label=name if name not in labelled else None)
            labelled.add(name)
            x += seconds
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("iteration")
    ax.set_title(f"mindspeed-ha: {len(eps)} fault episode(s) in {', '.join(map(os.path.abspath, log_dirs))}"[:150],
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(log_dirs, picture: bool = True, as_json: bool = False) -> int:
    log_dirs = [log_dirs] if isinstance(log_dirs, str) else list(log_dirs)
    eps = episodes(log_dirs)
    if as_json:
        print(json.dumps([{k: v for k, v in ep.items() if k != "dump"} for ep in eps], default=str))
    else:
        print(table(eps))
    if picture:
        try:
            path = timeline(log_dirs, eps, os.path.join(log_dirs[0], "recovery_timeline.png"))
            print(f"timeline: {path}")
        except ImportError:
            print("timeline picture skipped: matplotlib is not installed (pip install 'mindspeed-ha[report]')")
    never = unfired(log_dirs)
    for e in never:
        print(f"ERROR: fault drill {e['spec']} never fired (rank {e['rank']} ended at iteration {e.get('iteration')} "
              f"without reaching phase {e['phase']}{'' if e.get('step') is None else ' of iteration ' + str(e['step'])})",
              file=sys.stderr)
    return 1 if never else 0
