"""Rounds through the node agents (``mindspeed-ha run --relay``): the controller sends each order for a
node's ranks to its agent once, the agent passes it on and sends their answers back in batches. The
recoveries are the same bit for bit; an agent that goes silent costs a resend, never the recovery."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import PRETRAIN, TINY, TINY_ITERS, all_rank_events, assert_ok, clean_env, events, losses, recomputed

MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]
ROUNDS = ("ha-status", "rebuild", "repair", "rollback", "resume")


def command(log_dir, nproc=4, relay=True):
    return MINDSPEED_HA + ["run", "--standalone", "--relay" if relay else "--no-relay", "--nproc-per-node", str(nproc),
                           PRETRAIN, *TINY,
                           "--train-iters", str(TINY_ITERS), "--enable-hbmfault-repair", "--enable-worker-reboot",
                           "--ha-log-dir", str(log_dir), "--ha-verify-replicas-interval", "1"]


@pytest.fixture
def ref(references):
    return references.tiny_layouts()["dp4"]


def round_orders(log_dir) -> list[dict]:
    """Each round's order as a rank took it (one that carried the next round's, ``then``: both)."""
    out = []
    for e in all_rank_events(log_dir):
        if e["event"] == "action" and e["action"] in ROUNDS:
            then = (e.get("args") or {}).get("then")
            out += [e] + ([{**e, "action": then[0]}] if then else [])
    return out


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "no-relay"])
def test_retry_and_recover_with_the_rounds_through_the_agent(tmp_path, ref, relay):
    """A memory error (retry), then a killed worker (recover): every loss equals the fault-free run's;
    every round's order to a rank whose process was connected to the agent came through the agent (the
    default), or, with --no-relay, every order came directly."""
    env = clean_env({"MINDSPEED_HA_INJECT": "uce:rank=2:step=4:phase=backward,kill:rank=1:step=7:phase=optimizer"})
    proc = subprocess.run(command(tmp_path, relay=relay), env=env, capture_output=True, text=True, timeout=240,
                          cwd=str(tmp_path))
    assert_ok(proc)
    assert losses(tmp_path) == ref
    rec = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert [e["strategy"] for e in rec] == ["retry", "recover"] and all(e["lost_steps"] == 0 for e in rec)
    orders = round_orders(tmp_path)
    assert {e["action"] for e in orders} == set(ROUNDS)
    first_pid = {e["rank"]: e["pid"] for e in all_rank_events(tmp_path) if e["event"] == "start" and e["rank"] != 1}
    survivors = [e for e in orders if e["pid"] == first_pid.get(e["rank"])]
    direct = [(e["rank"], e["action"]) for e in survivors if not e.get("relayed")]
    assert survivors and (not direct if relay else len(direct) == len(survivors)), direct
    if not relay:
        assert not any(e.get("relayed") for e in all_rank_events(tmp_path) if e["event"] == "action")
    # The ranks' heartbeats went through the agent once their links were answered (or never, --no-relay)
    beats = [int(n) for n in re.findall(r"agent 0: relayed \d+ order\(s\), \d+ answer\(s\) and (\d+) heartbeat",
                                        text_log(tmp_path))]
    assert (beats and beats[0] > 0) if relay else not beats, beats


def test_an_agent_stopped_during_a_retry_the_controller_sends_directly(tmp_path, ref):
    """The agent is stopped (SIGSTOP) before a memory error and continued only after the recovery:
    the orders it would have passed on reach the ranks directly (sent so after its silence, or sent
    again), and the job goes on bit-identical."""
    env = clean_env({"MINDSPEED_HA_INJECT": "uce:rank=2:step=8:phase=forward,slow:rank=0:step=2:factor=3,"
                                            "slow:rank=1:step=2:factor=3,slow:rank=2:step=2:factor=3,"
                                            "slow:rank=3:step=2:factor=3"})
    proc = subprocess.Popen(command(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(tmp_path))
    stopped_at = None
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120 and proc.poll() is None:
            steps = [e["iteration"] for e in events(tmp_path, "rank_0") if e["event"] == "step"]
            if steps and max(steps) >= 6:
                break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)  # (the agent: mindspeed-ha run is node 0's agent)
        stopped_at = time.time()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90:
            if any(e["event"] == "recovered" for e in events(tmp_path, "controller")):
                break
            time.sleep(0.1)
        continued_at = time.time()
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.communicate()
    assert_ok(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    assert losses(tmp_path) == ref and recomputed(tmp_path) in ([8], [])
    (rec,) = [e for e in events(tmp_path, "controller") if e["event"] == "recovered"]
    assert stopped_at < rec["time"] < continued_at, "the recovery did not happen while the agent was stopped"
    orders = [e for e in round_orders(tmp_path) if stopped_at < e["time"] < continued_at]
    assert {e["action"] for e in orders} == set(ROUNDS) and not any(e.get("relayed") for e in orders), orders
    # The ranks' heartbeats went through the agent, then directly while it was stopped (no rank was
    # taken for lost), then through it again
    log = text_log(tmp_path)
    for r in range(4):
        went = [m.group(1) for m in re.finditer(rf"rank {r}: (heartbeats go through the agent|no ack through the "
                                                 rf"agent)", log)]
        assert went[:1] == ["heartbeats go through the agent"] and "no ack through the agent" in went, (r, went)
        assert went[-1] == "heartbeats go through the agent", (r, went)
    assert [e["kind"] for e in events(tmp_path, "controller") if e["event"] == "fault"] == ["memory-error"]


def text_log(log_dir) -> str:
    with open(os.path.join(log_dir, "ttp_log.log")) as f:
        return f.read()


class Link:
    """What the rank's relay end needs of its ``ControllerLink``: answered by an active controller at
    ``endpoint``; the acks and the re-registrations it is handed, recorded."""

    def __init__(self, endpoint):
        self.active, self.endpoint, self.acks, self.registered = True, endpoint, [], 0

    def acked_through_agent(self, msg):
        if msg.get("endpoint") != self.endpoint:
            return False
        self.acks.append(msg)
        return True

    def register_again(self):
        self.registered += 1


def _received(relays, link, until=lambda: False, timeout=5.0):
    """The relays take what came (for ``link``) until ``until()`` holds, or for ``timeout``."""
    t0 = time.monotonic()
    while not until() and time.monotonic() - t0 < timeout:
        for r in relays:
            assert r.receive(link) == []   # (no order came)
        time.sleep(0.005)


def test_heartbeats_go_through_the_agent_together_and_directly_when_its_acks_stop():
    """Two ranks' heartbeats come to their agent's relay (real sockets): they go on together once both
    came (one alone waits up to BATCH_S; one marked ``now`` does not), each with the time it waited.
    Until the controller's ack comes back through the agent, each also goes directly; after, only
    through the agent; an ack from another controller than the link's is not taken. No ack within
    ack_wait: directly again, said once. The controller not knowing them: they register again."""
    from mindspeed_ha.control.wire import protocol
    from mindspeed_ha.control.wire.folding import rows
    from mindspeed_ha.launcher.relay import BATCH_S, RelayHub
    from mindspeed_ha.rank.processor.relay import AgentRelay
    hub = RelayHub(0)
    relays = [AgentRelay(hub.endpoint, r, 0.5) for r in (0, 1)]
    link = Link("tcp://10.0.0.1:5000")
    try:
        t0 = time.monotonic()
        while len(hub.pids) < 2 and time.monotonic() - t0 < 5:
            hub.collect()
        beat = dict(upd=False, health="ok", it=3)
        assert relays[0].next_beat(7.0) == relays[1].next_beat(7.0) > 7.0  # (one place in the interval a node)
        assert relays[0].beat(protocol.encode("hb", rank=0, **beat), link, time.monotonic())  # (both ways)
        time.sleep(0.05)
        hub.collect()
        assert not hub.beats_due(time.monotonic() - BATCH_S + 0.02)   # (waits for rank 1's)
        assert relays[1].beat(protocol.encode("hb", rank=1, **beat), link, time.monotonic())
        time.sleep(0.05)
        hub.collect()
        now = time.monotonic()
        assert hub.beats_due(now)
        taken = rows(hub.take_beats(now))
        ages = {b["rank"]: b["age"] for b in taken}   # (rank 0's waited for rank 1's: 50 ms at least)
        assert sorted(ages) == [0, 1] and 0.04 <= ages[0] < 5 and 0 <= ages[1] <= ages[0], ages
        ack = protocol.decode(protocol.encode("ack", epoch=2, state="normal"))
        hub.pass_ack(ack, "tcp://10.0.0.2:5000")   # (another controller than the links': not taken)
        _received(relays, link, timeout=0.3)
        assert link.acks == [] and relays[0].direct
        hub.pass_ack(ack, link.endpoint)   # (nothing owed now)
        relays[0].beat(protocol.encode("hb", rank=0, **beat), link, time.monotonic())
        relays[1].beat(protocol.encode("hb", rank=1, now=True, **beat), link, time.monotonic())
        time.sleep(0.05)
        hub.collect()
        hub.take_beats(time.monotonic())
        hub.pass_ack(ack, link.endpoint)
        _received(relays, link, lambda: len(link.acks) == 2)
        _received(relays, link, timeout=0.1)
        assert len(link.acks) == 2 and not relays[0].direct and not relays[1].direct
        now = time.monotonic()
        assert not relays[0].beat(protocol.encode("hb", rank=0, **beat), link, now)   # (through the agent only)
        assert not relays[0].fell_silent(now + relays[0].ack_wait - 0.1)
        assert relays[0].fell_silent(now + relays[0].ack_wait + 0.1)
        assert not relays[0].fell_silent(now + relays[0].ack_wait + 0.2) and relays[0].direct  # (once)
        hub.collect()
        hub.pass_unheard([1])
        _received(relays, link, lambda: link.registered, timeout=2.0)
        assert link.registered == 1 and relays[1].direct
    finally:
        for r in relays:
            r.close()
        hub.close()
