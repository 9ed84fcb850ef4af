"""Fault injection (MINDSPEED_HA_INJECT) and fault classification."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from mindspeed_ha.comm import CollectiveStopped
from mindspeed_ha.events import EventLog, read_events
from mindspeed_ha.faults import CommFault, MemoryFault, classify, process_fatal
from mindspeed_ha.inject import ENV, Fault, InjectedError, Injector, InjectSpecError, parse


@pytest.mark.parametrize("value, expected", [
    ("", []),
    ("kill:rank=1:step=3", [Fault("kill", 1, 3, "forward")]),
    (" EXIT:rank=0:step=0:phase=checkpoint ,", [Fault("exit", 0, 0, "checkpoint")]),
    ("hang:step=5:rank=2:phase=grad-sync,uce:rank=3:step=1:phase=optimizer",
     [Fault("hang", 2, 5, "grad-sync"), Fault("uce", 3, 1, "optimizer")]),
    ("comm:rank=0:step=2:phase=param-sync,exception:rank=1:step=4:phase=backward",
     [Fault("comm", 0, 2, "param-sync"), Fault("exception", 1, 4, "backward")]),
    ("kill:rank=3:step=any:phase=resize", [Fault("kill", 3, None, "resize")]),
])
def test_parse_ok(value, expected):
    assert parse(value) == expected


@pytest.mark.parametrize("value, why", [
    ("kill:rank=1", "step is required"),
    ("kill:step=1", "rank is required"),
    ("boom:rank=1:step=2", "unknown kind"),
    ("kill:rank=1:step=2:phase=fwd", "unknown phase"),
    ("kill:rank=x:step=2", "rank must be an integer"),
    ("kill:rank=1:step=-2", "step must be an integer >= 0"),
    ("kill:rank=1:step=all", "step must be an integer, got 'all'"),
    ("kill:rank=1:step=2:node=3", "unknown field"),
    ("kill:rank=1:rank=2:step=2", "given twice"),
    ("kill:rank=1:step", "not key=value"),
    ("kill:rank=1:step=1,exit", "rank is required"),
    ("slow:rank=1:step=1:factor=0.5", "factor must be a number from 1 (back to full speed) to 100"),
    ("exit:rank=1:step=1:factor=2", "factor is for the slow kind only"),
])
def test_parse_errors_name_the_variable_and_show_an_example(value, why):
    with pytest.raises(InjectSpecError) as e:
        parse(value)
    msg = str(e.value)
    assert msg.startswith(ENV) and why in msg and "e.g." in msg
    parse(msg.split(f'e.g. {ENV}="')[1].rstrip('"'))  # the example itself parses


def test_from_env_keeps_this_ranks_faults(tmp_path):
    env = {ENV: "kill:rank=1:step=3,exception:rank=0:step=2:phase=backward"}
    inj = Injector.from_env(0, str(tmp_path), None, env=env)
    assert inj.pending() == [Fault("exception", 0, 2, "backward")]
    with pytest.raises(InjectSpecError):  # a bad spec fails on every rank, not only its target
        Injector.from_env(0, str(tmp_path), None, env={ENV: "kill:rank=1"})


def test_fires_once_per_job_across_restarts(tmp_path):
    env = {ENV: "exception:rank=0:step=2:phase=backward"}
    events = EventLog.for_rank(str(tmp_path), 0)
    first = Injector.from_env(0, str(tmp_path), events, env=env)
    for it in range(2):
        for phase in ("forward", "backward", "optimizer"):
            first.fire_point(phase, it)
    first.fire_point("forward", 2)  # right step, wrong phase
    with pytest.raises(InjectedError, match="iteration 2, phase backward"):
        first.fire_point("backward", 2)
    first.fire_point("backward", 2)  # fired: gone
    restarted = Injector.from_env(0, str(tmp_path), events, env=env)  # a restarted worker
    restarted.fire_point("backward", 2)
    inj = [e for e in read_events(events.path) if e["event"] == "inject"]
    assert len(inj) == 1
    assert (inj[0]["kind"], inj[0]["phase"], inj[0]["iteration"], inj[0]["rank"]) == (
        "exception", "backward", 2, 0)
    assert len(os.listdir(tmp_path / "inject")) == 1


def test_a_drill_run_again_in_the_same_log_dir_fires_again(tmp_path):
    """The once-per-job marker belongs to the job: a new job (another launcher run id) fires the fault
    again; a restarted worker of the same job does not."""
    spec = {ENV: "exception:rank=0:step=2"}
    fired = []
    for run in ("job-a", "job-a", "job-b"):
        inj = Injector.from_env(0, str(tmp_path), None, env={**spec, "MINDSPEED_HA_JOB_ID": run})
        try:
            inj.fire_point("forward", 2)
            fired.append(False)
        except InjectedError:
            fired.append(True)
    assert fired == [True, False, True]


def test_faults_must_name_a_rank_and_a_step_of_the_job():
    from mindspeed_ha.inject import check_reachable
    with pytest.raises(InjectSpecError, match="there is no rank 4 in a job of 4 ranks"):
        check_reachable(parse("kill:rank=4:step=2"), 4, 10)
    with pytest.raises(InjectSpecError, match=r"step 11 is never reached; this job trains steps 1..10"):
        check_reachable(parse("kill:rank=1:step=11"), 4, 10)
    check_reachable(parse("kill:rank=3:step=10"), 4, 10)


def test_a_phase_the_layout_never_runs_is_refused_at_start_naming_the_flag():
    from argparse import Namespace

    from mindspeed_ha.inject import check_layout
    overlap = Namespace(overlap_param_gather=True, pipeline_model_parallel_size=1, save=None)
    with pytest.raises(InjectSpecError, match=r"kill:rank=1:step=3:phase=param-sync: phase param-sync never comes in "
                                              r"this layout, --overlap-param-gather: the parameter all-gather"):
        check_layout(parse("kill:rank=1:step=3:phase=param-sync"), overlap)
    with pytest.raises(InjectSpecError, match=r"--pipeline-model-parallel-size 1"):
        check_layout(parse("uce:rank=0:step=2:phase=pipeline-send"), overlap)
    with pytest.raises(InjectSpecError, match=r"no --save"):
        check_layout(parse("exit:rank=0:step=2:phase=checkpoint"), overlap)
    check_layout(parse("kill:rank=1:step=3:phase=param-sync,uce:rank=0:step=2:phase=pipeline-recv,"
                       "exit:rank=0:step=2:phase=checkpoint"),
                 Namespace(overlap_param_gather=False, pipeline_model_parallel_size=2, save="/ck"))


def test_live_add_fires_at_next_matching_point(tmp_path):
    inj = Injector(1, str(tmp_path), EventLog.for_rank(str(tmp_path), 1))
    inj.add("exception", rank=0)  # another rank's: ignored here
    inj.fire_point("forward", 7)
    t = threading.Thread(target=inj.add, args=("exception", 1, None, "optimizer"))
    t.start()
    t.join()
    inj.fire_point("forward", 8)
    with pytest.raises(InjectedError):
        inj.fire_point("optimizer", 8)
    inj.add("exception", 1, None, "optimizer")  # the same fault again live: fires again
    with pytest.raises(InjectedError):
        inj.fire_point("optimizer", 9)
    inj.add("exception", 1, 11)  # a live fault with a step waits for it
    inj.fire_point("forward", 10)
    with pytest.raises(InjectedError):
        inj.fire_point("forward", 11)
    with pytest.raises(InjectSpecError):
        inj.add("kill", 1, None, "sideways")
    with pytest.raises(ValueError):
        inj.add("exception", 1, 12)
        inj.fire_point("sideways", 12)


def test_uce_corrupts_then_raises_memory_fault(tmp_path):
    shard = torch.ones(4)
    inj = Injector(0, str(tmp_path), None, parse("uce:rank=0:step=1:phase=optimizer"))
    inj.set_uce_corruptor(lambda: shard.fill_(float("nan")))
    with pytest.raises(MemoryFault, match="UCE ERROR") as e:
        inj.fire_point("optimizer", 1)
    assert torch.isnan(shard).all()
    assert classify(e.value) == "memory" and not process_fatal(e.value)


def test_comm_calls_breaker_then_raises_comm_fault(tmp_path):
    broken = []
    inj = Injector(0, str(tmp_path), None, parse("comm:rank=0:step=0:phase=grad-sync"))
    inj.set_comm_breaker(lambda: broken.append(True))
    with pytest.raises(CommFault) as e:
        inj.fire_point("grad-sync", 0)
    assert broken == [True] and classify(e.value) == "comm"


def test_hang_blocks_only_the_calling_thread(tmp_path):
    inj = Injector(0, str(tmp_path), EventLog.for_rank(str(tmp_path), 0), parse("hang:rank=0:step=0"))
    t = threading.Thread(target=inj.fire_point, args=("forward", 0), daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # hung, and this thread (the "processor") still runs
    assert [e["kind"] for e in read_events(str(tmp_path / "events" / "rank_0.jsonl"))] == ["hang"]


_CHILD = textwrap.dedent("""
    import sys
    from mindspeed_ha.events import EventLog
    from mindspeed_ha.inject import Injector
    log_dir = sys.argv[1]
    inj = Injector.from_env(2, log_dir, EventLog.for_rank(log_dir, 2))
    for it in range(4):
        for phase in ("forward", "backward", "grad-sync", "optimizer"):
            inj.fire_point(phase, it)
    print("finished")
""")


@pytest.mark.parametrize("kind, code", [("kill", -9), ("exit", 1)])
def test_process_faults_write_event_first_and_not_again_after_restart(tmp_path, kind, code):
    env = dict(os.environ, **{ENV: f"{kind}:rank=2:step=2:phase=grad-sync"})
    run = lambda: subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], env=env,  # noqa: E731
                                 capture_output=True, text=True, timeout=60)
    first = run()
    assert first.returncode == code, first.stderr
    assert "finished" not in first.stdout
    ev = [e for e in read_events(str(tmp_path / "events" / "rank_2.jsonl")) if e["event"] == "inject"]
    assert len(ev) == 1
    assert (ev[0]["kind"], ev[0]["phase"], ev[0]["iteration"]) == (kind, "grad-sync", 2)
    second = run()  # the restarted worker of the same job
    assert second.returncode == 0 and "finished" in second.stdout, second.stderr
    assert len([e for e in read_events(str(tmp_path / "events" / "rank_2.jsonl"))
                if e["event"] == "inject"]) == 1


def test_classify():
    assert classify(MemoryFault("x")) == "memory"
    assert classify(RuntimeError("ACL stream synchronize failed, error code:507053 UCE ERROR")) == "memory"
    assert classify(RuntimeError("HBM MULTI BIT ECC ERROR")) == "memory"
    ecc = RuntimeError("CUDA error: uncorrectable ECC error encountered")
    assert classify(ecc) == "memory" and process_fatal(ecc)
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "other"
    assert classify(CollectiveStopped("stopped")) == "comm"
    assert classify(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")) == "comm"
    assert classify(RuntimeError("Connection reset by peer")) == "comm"
    assert classify(torch.distributed.DistBackendError("NCCL error in: ..., unhandled system error")) == "comm"
    assert classify(RuntimeError("HCCL function error: HcclAllReduce")) == "comm"
    assert classify(ValueError("shape mismatch")) == "other"
    assert classify(InjectedError("injected")) == "other"
    try:
        try:
            raise CommFault("link down")
        except CommFault as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert classify(outer) == "comm"
    assert not process_fatal(RuntimeError("UCE ERROR"))
    # every error CUDA documents as leaving the context unusable, as torch raises it
    for msg in ("device-side assert triggered", "misaligned address", "an illegal instruction was encountered",
                "hardware stack error", "invalid program counter", "unspecified launch failure",
                "the launch timed out and was terminated", "an illegal memory access was encountered"):
        assert process_fatal(torch.AcceleratorError(f"CUDA error: {msg}\nCUDA kernel errors might be asynchronously "
                                                    "reported at some other API call"))
    assert not process_fatal(RuntimeError("CUDA error: out of memory"))


_COMM_CHILD = textwrap.dedent("""
    import sys, json, datetime
    import torch, torch.distributed as dist
    from mindspeed_ha.faults import classify
    from mindspeed_ha.inject import Injector
    rank, port, log_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    inj = Injector.from_env(rank, log_dir, None)
    t = torch.ones(2)
    dist.all_reduce(t)
    out = {}
    for it in range(3):
        try:
            inj.fire_point("grad-sync", it)
            dist.all_reduce(t)
        except Exception as e:
            out = {"iteration": it, "class": classify(e), "type": type(e).__name__}
            break
    print(json.dumps(out), flush=True)
    # As a rank does after a fault (mindspeed_ha.process): no finalisation. The aborted group's gloo
    # threads may still run, and the interpreter's teardown then aborts ("terminate called without
    # an active exception"), which is not what this checks.
    import os
    os._exit(0)
""")


def test_comm_default_breaker_fails_the_gloo_peer(tmp_path):
    """kind=comm with no trainer breaker: this rank raises CommFault, its peer's next collective
    fails with a gloo connection error; both classify as "comm"."""
    import json

    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", **{ENV: "comm:rank=1:step=1:phase=grad-sync"})
    procs = [subprocess.Popen([sys.executable, "-c", _COMM_CHILD, str(r), str(store.port), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert outs[1] == {"iteration": 1, "class": "comm", "type": "CommFault"}
    assert outs[0]["iteration"] == 1 and outs[0]["class"] == "comm", outs[0]


LOG_WRITER = r"""
import os, sys
from mindspeed_ha.events import get_logger, setup_text_log
setup_text_log(sys.argv[1], int(sys.argv[2]))
log = get_logger("test")
for i in range(400):
    log.info("line %04d of writer %s %s", i, sys.argv[2], "x" * 100)
"""


def test_many_processes_share_one_rotating_log_without_losing_a_line(tmp_path):
    """Every rank, the agent and the controller of a node write DIR/ttp_log.log; rotation (10 MB x 5,
    here 64 KB) must not lose or tear lines when they rotate it at once."""
    env = {**os.environ, "MINDSPEED_HA_LOG_MAX_BYTES": "65536", "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", LOG_WRITER, str(tmp_path), str(w)], env=env,
                              stderr=subprocess.DEVNULL) for w in range(4)]
    assert all(p.wait(120) == 0 for p in procs)
    lines = [ln for f in tmp_path.glob("ttp_log.log*") if not f.name.endswith(".lock")
             for ln in f.read_text().splitlines()]
    mine = [ln for ln in lines if " mindspeed_ha.test: line " in ln]
    assert len(mine) == 1600 and all(ln.endswith("x" * 100) for ln in mine)  # none lost, none torn
    assert len({ln.split("line ")[1][:4] + ln.split("writer ")[1][:1] for ln in mine}) == 1600


@pytest.mark.alone  # (asserts a latency)
def test_slow_factor_one_ends_a_slowdown(tmp_path):
    """A straggler drill paces a rank; ``slow`` with factor 1 (live, or at a later step) brings it back
    to full speed."""
    import time
    inj = Injector(0, str(tmp_path), None, parse("slow:rank=0:step=2:factor=3"), job="j")
    inj.fire_point("forward", 1)
    time.sleep(0.05)                 # step 1 took ~50 ms
    inj.fire_point("forward", 2)     # from here each step sleeps ~2 x 50 ms
    assert 0.08 < inj._slow_s < 0.5
    inj.add("slow", 0, None, "forward", factor=1)
    inj.fire_point("forward", 3)     # (it fires at the next phase point: step 3 was already paced)
    t = time.perf_counter()
    inj.fire_point("forward", 4)
    inj.fire_point("forward", 5)
    assert inj._slow_s == 0 and time.perf_counter() - t < 0.05
