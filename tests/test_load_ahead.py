"""A joiner loads ahead, before it registers, what its set-up and its first recovery would pay for."""
import json
import subprocess
import sys
import textwrap


def test_a_joiner_leaves_what_it_loaded_out_of_the_collector():
    """After ``load_ahead`` a full collection walks only what the process makes later: in a fresh
    newcomer one walked every import's objects (0.27 s) inside a scale-out's state move, with every
    rank waiting for it."""
    probe = textwrap.dedent("""
        import gc, json, time
        from mindspeed_ha.rank.session import load_ahead
        load_ahead()
        t = time.perf_counter()
        gc.collect()
        print(json.dumps({"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()),
                          "collect_s": time.perf_counter() - t}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["frozen"] > 100_000, seen  # (torch and the control plane's imports)
    assert seen["tracked"] < seen["frozen"] / 10, seen
