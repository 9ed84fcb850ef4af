"""Does a benchmark's figure move the wrong way? Compare its last-line JSON with the committed baseline.

``benchmarks/baseline.json`` holds, for each benchmark run by name (``chaos-544``, ``migrate``, ...),
the command that measures it and, per figure, the values of the runs the baseline was made from, the
direction that is better and the noise: the spread of those runs (max - min), or a floor where the
runs agreed by chance more closely than this host repeats (said in the figure's ``why``). A figure
is *worse* when it lies beyond its baseline median by more than the noise in the wrong direction.

    python benchmarks/chaos.py --seed 544 | python benchmarks/check_baseline.py chaos-544
    python benchmarks/check_baseline.py chaos-544 --run        # runs the baseline's own command

Prints one line per figure (ok / better / WORSE), then one JSON object; exits 1 when a figure is
worse, 2 on bad input (an unknown name, no JSON line). A figure the run did not print is named, not
failed: a benchmark's options can leave it out. Figures measured on another machine mean nothing
here: the baseline names the host it was made on.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BASELINE = os.path.join(HERE, "baseline.json")


def last_json(text: str) -> dict:
    """The last line of ``text`` that is a JSON object (every benchmark ends with one)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    raise ValueError("no JSON object on any line of the benchmark's output")


def judge(figures: dict, measured: dict) -> list[dict]:
    """One verdict per baseline figure: ``ok``, ``better``, ``worse`` or ``missing``."""
    out = []
    for name, spec in figures.items():
        runs = spec["runs"]
        base = runs[0] if isinstance(runs[0], bool) else statistics.median(runs)
        noise = float(spec["noise"])
        lower = spec.get("better", "lower") == "lower"
        got = measured.get(name)
        if got is None:
            out.append({"figure": name, "verdict": "missing", "baseline": base})
            continue
        if isinstance(base, bool) or isinstance(got, bool):  # (bit_identical: no noise, must hold)
            verdict = "ok" if got == base else "worse"
        else:
            moved = (got - base) if lower else (base - got)  # > 0: the wrong way
            verdict = "worse" if moved > noise else "better" if -moved > noise else "ok"
        out.append({"figure": name, "verdict": verdict, "measured": got, "baseline": base, "noise": noise})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("name", help="the benchmark run's name in benchmarks/baseline.json")
    p.add_argument("--run", action="store_true", help="run the baseline's command instead of reading stdin")
    p.add_argument("--baseline", default=BASELINE)
    a = p.parse_args(argv)
    with open(a.baseline) as f:
        baseline = json.load(f)
    entry = baseline["benchmarks"].get(a.name)
    if entry is None:
        print(f"check_baseline: no benchmark {a.name!r} in {a.baseline}; known: "
              f"{', '.join(sorted(baseline['benchmarks']))}", file=sys.stderr)
        return 2
    if a.run:
        proc = subprocess.run([sys.executable, *shlex.split(entry["command"])[1:]], cwd=ROOT,
                              capture_output=True, text=True)
        text = proc.stdout
    else:
        text = sys.stdin.read()
    try:
        measured = last_json(text)
    except ValueError as e:
        print(f"check_baseline: {e}", file=sys.stderr)
        return 2
    verdicts = judge(entry["figures"], measured)
    for v in verdicts:
        if v["verdict"] == "missing":
            print(f"{v['figure']:28s} missing (not in this run's output)")
        else:
            print(f"{v['figure']:28s} {v['verdict'].upper() if v['verdict'] == 'worse' else v['verdict']:7s} "
                  f"{v['measured']} against {v['baseline']} (noise {v['noise']})")
    worse = [v["figure"] for v in verdicts if v["verdict"] == "worse"]
    print(json.dumps({"benchmark": a.name, "worse": worse, "verdicts": verdicts}))
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
