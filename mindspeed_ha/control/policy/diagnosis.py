"""The text a job ends with: what failed first, what followed, what recovery did, how to resume."""
from __future__ import annotations

import os
from typing import Any

from ...exitcodes import MEANING
from .ledger import Fault


def diagnosis(faults: list[Fault], live: int, note: str, dump: dict[str, Any] | None, log_dir: str,
              code: int = 1) -> str:
    """``faults``: the episode's (or, with none, every) fault record; ``live``: ranks told to exit;
    ``note``: what the chosen strategy did; ``dump``: the dying-gasp checkpoint written, if any."""
    if not faults:
        return "mindspeed-ha: the job ended without a recorded fault."
    # The first fault of an episode is the cause; communication failures that follow it are
    # survivors noticing the loss, so they are summarised, not described.
    root = next((f for f in faults if f["kind"] != "comm-failure"), faults[0])
    nodes = ", ".join(sorted(set(root["nodes"])))
    detail = f" ({root['detail'][:160]})" if root["detail"] else ""
    if root["kind"] == "preempted":
        text = (f"mindspeed-ha diagnosis: the job was preempted{detail} at iteration {root['iteration']}, phase "
                f"{root['phase']}.")
    elif root["kind"] == "not-registered":
        text = f"mindspeed-ha diagnosis: the job could not start whole: {root['detail']}."
    else:
        text = (f"mindspeed-ha diagnosis: rank {', '.join(map(str, root['ranks']))} (node {nodes}) failed: "
                f"{root['kind']}{detail} at iteration {root['iteration']}, phase {root['phase']}; "
                f"the controller knew {root['detect_s']:.2f}s after the fault was observed.")
    rest = [f for f in faults if f is not root]
    follow = sorted({r for f in rest if f["kind"] == "comm-failure" for r in f["ranks"]})
    if follow:
        text += f" Then rank(s) {', '.join(map(str, follow))} reported communication failures (consequences)."
    for f in rest:
        if f["kind"] != "comm-failure":
            text += (f" Also rank {', '.join(map(str, f['ranks']))}: {f['kind']} at iteration "
                     f"{f['iteration']}, phase {f['phase']}.")
    resume = (f"Resume with --load {dump['save']}: it continues from iteration {dump['iteration']}, "
              f"no completed step is lost." if dump else "Resume from the last checkpoint.")
    text += (f" Recovery: {note or 'none'}; so the job ends here: the {live} live rank(s) were told to exit "
             f"(exit code {code}: {MEANING.get(code, 'see docs/clusters.md, exit codes')}). {resume} Events: {os.path.join(log_dir, 'events', 'controller.jsonl')}.")
    return text
