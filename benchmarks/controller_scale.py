"""Scale of the control plane: one real controller, N simulated processors.

Each simulated processor is a real DEALER socket with its own CurveZMQ handshake, registering and
heartbeating like a rank; they are multiplexed over a few processes. One rank is silenced; we print
how long the controller took to notice (detect_s, from the silenced rank's last heartbeat), how long
from detection until the stop action was sent to every other rank (decide_ms, measured by the
controller), and until every simulated rank had received it (deliver_ms, measured by the simulators).

With ``--recovery`` one rank reports a memory error instead, and the simulated ranks answer the
controller's orders as real ones would, with the status payloads of a DP=N layout (replica pairs r
and r + N/2): the controller plays its whole retry playbook (stop, status, plan, rebuild, repair,
rollback, resume, first step) at that scale, then ``mindspeed-ha status --json`` runs against it.
A recovery that fails says where and why (``recovery_failure``: the round, timeout / refusal / lost
message / new fault, and the controller's events that show it); the benchmark's log dir is kept then.

Every wait of the benchmark follows from the world size (``limits``): a round at N ranks is N orders
out and N answers in through one controller thread, and on a loaded host each costs milliseconds.
With ``--recovery`` so does the controller's loss limit (MINDSPEED_HA_DEAD_AFTER, unless set): a
simulator's ranks answer each round in turn, and at 16,384 ranks on a loaded 2-core host the default
1.8 heartbeats declared hundreds of answering ranks lost — faults retry cannot take, so no recovery.

With ``--relay`` the ranks sit on nodes of 8 behind agents that relay (``mindspeed-ha run --relay``): each
node's agent is a socket of its own, the controller's orders come to it naming its ranks, and it answers
for them in one frame (the ranks still register and heartbeat on their own sockets).

    python benchmarks/controller_scale.py --ranks 16384 [--recovery] [--relay]
Last line: JSON with ranks, detect_s, decide_ms, heartbeat_s (and more; with --recovery also
recovery_ok, recovery_s, recovery_round / recovery_round_s — the slowest round —, status_ok and,
when it failed, recovery_failure; orders_via: the orders the simulated ranks got directly and through agents;
round_cpu: each round's CPU, the controller thread's and the simulators', beside its wall time, and
slowest_round_controller_cpu_s: the most the controller's thread spent in one round;
training_controller_cpu_per_s: its CPU a second while the job trained, before the fault: the heartbeats).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jobs  # noqa: E402  (how every benchmark starts a job)

# What a round costs per rank on a loaded 2-core host, with margin: an order out and an answer in,
# each CurveZMQ-sealed, through the controller's one thread and the simulators' (unloaded, a round
# at 16,384 ranks takes about 1 s: 60 us a rank).
PER_RANK_S = 2e-3
# The retry playbook's timed steps: stop, status, rebuild, repair, rollback, resume, first step.
RECOVERY_STEPS = 7
NODE = 8  # ranks a node (--relay: behind one agent)


def limits(ranks: int, heartbeat: float) -> dict:
    """Every wait of the benchmark, from the world size (and the heartbeat interval)."""
    round_s = 10.0 + ranks * PER_RANK_S                  # one fan-out and its answers: 43 s at 16,384
    return {"register_s": 30.0 + ranks * 5 * PER_RANK_S,   # handshakes + registrations: 194 s at 16,384
            "round_s": round_s,
            "report_s": round_s + 10 * heartbeat,       # the simulators report who got the stop
            "recovery_s": RECOVERY_STEPS * round_s,     # the whole playbook
            "status_s": round_s,                         # mindspeed-ha status --json
            # --recovery: the controller's loss limit (MINDSPEED_HA_DEAD_AFTER). Its default, 1.8
            # heartbeats, is what the silence run measures; but while a round's N orders and N answers
            # go through, a simulator answers thousands of orders in turn and the controller reads
            # thousands of answers before the heartbeats queued behind them: on a loaded host, ranks
            # silent for seconds that a real rank's own heartbeat thread would never be. Lost ranks
            # there are no fault the recovery is measured on (retry cannot take them: it fails).
            "dead_after_s": max(1.8 * heartbeat, 3.0) + ranks * PER_RANK_S}


def communicators(r: int, world: int) -> dict:
    """A rank's ``comm`` status section (``comm.ledger``) as megatron-core's groups make it on nodes of
    8 ranks with TP=8: the world and the groups that span it, its node's (TP, TP-PP, model-parallel),
    the data-parallel ones across nodes (its optimizer instance's half too) and the pair across
    instances; every one idle with equal counts (so the rebuild keeps them all). A group's first
    member says its members (only those lists are built: the simulators share the controller's CPU)."""
    node, local = divmod(r, 8)
    dp_size = world // 8
    mine, half = r // 8, max(dp_size // 2, 1)
    first_half = mine < half
    twin = ((mine + half) % dp_size) * 8 + local
    groups = {  # key: (first member, its members when this rank is it)
        "world": (0, lambda: list(range(world))), "tp-dp": (0, lambda: list(range(world))),
        "tp-dp-cp": (0, lambda: list(range(world))),
        "tp": (8 * node, lambda: list(range(8 * node, 8 * node + 8))),
        "tp-pp": (8 * node, lambda: list(range(8 * node, 8 * node + 8))),
        "mp": (8 * node, lambda: list(range(8 * node, 8 * node + 8))),
        "dp": (local, lambda: list(range(local, world, 8))), "dp-cp": (local, lambda: list(range(local, world, 8))),
        "dp-instance": (local if first_half else local + 8 * half,
                        lambda: list(range(local, 8 * half, 8)) if first_half else list(range(local + 8 * half, world, 8))),
    }
    if twin != r:
        groups["across"] = (min(r, twin), lambda: sorted([r, twin]))
    return {"keys": list(groups), "ops": [12] * len(groups), "odd": {},
            "members": {key: members() for key, (first, members) in groups.items() if first == r}}


def simulate(a) -> None:
    """A simulator process: ranks [lo, hi) of the world; commands on stdin, reports on stdout."""
    from mindspeed_ha.control.wire import protocol, security
    from mindspeed_ha.control.wire.folding import as_columns  # (as a real agent carries its ranks' heartbeats)
    from mindspeed_ha.launcher.relay import results_frame  # (as a real agent batches its ranks' answers)
    keys = security.Keys.load(a.log_dir, insecure=a.insecure, timeout=10)
    ctx = zmq.Context(io_threads=1)
    ctx.max_sockets = 65536
    ranks = list(range(a.lo, a.hi))
    socks = {}
    unsent: collections.Counter = collections.Counter()  # frames a full queue refused: lost messages

    def send(r, data, what):
        try:
            socks[r].send(data, zmq.NOBLOCK)
            return True
        except zmq.Again:
            unsent[what] += 1
            return False

    def connected():
        """A simulated process's socket to the controller (a rank's, an agent's)."""
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.rcvhwm = s.sndhwm = 10000
        s.handshake_ivl = 300_000
        security.secure_client(s, keys)
        s.connect(a.endpoint)
        return s

    # --relay: each node's agent (a real socket of its own, registered as a relaying agent for its 8
    # ranks, all connected to it): the controller's orders come to it naming its ranks, it answers for
    # them in one frame, and it carries their heartbeats in its own. Its ranks register on its socket:
    # a real rank registers on its own, but that is once a job, and afterwards a rank behind a relaying
    # agent that is heard sends its controller nothing directly (what the controller does with a
    # registration is the same either way); so 131,072 ranks need 16,384 sockets, not 131,072.
    agents = {}
    for n in range(a.lo // NODE, -(-a.hi // NODE)) if a.relay else ():
        agents[n] = s = connected()
        node_ranks = list(range(n * NODE, min(a.hi, (n + 1) * NODE)))
        pids = [100000 + r for r in node_ranks]
        s.send(protocol.encode("agent", node=f"sim{n}", node_rank=n, nnodes=-(-a.world // NODE), pid=200000 + n,
                               ranks=node_ranks, pids=pids, relay=True, relayed=node_ranks, relayed_pids=pids))
    for r in ranks:
        socks[r] = agents[r // NODE] if a.relay else connected()
        send(r, protocol.encode("register", rank=r, world=a.world, node=f"sim{r // 8}", pid=100000 + r,
                                groups=[[r, (r + a.world // 2) % a.world]], agent_node=r // NODE), "register")
    print(json.dumps({"ready": len(ranks)}), flush=True)
    hb = a.heartbeat
    started = time.monotonic()
    n_ranks = len(ranks)
    # Heartbeats go out in 20 ms batches, each rank on its own phase of the interval.
    stdin = sys.stdin.fileno()  # (read raw: commands come in lines, and an empty read is the benchmark's end)
    os.set_blocking(stdin, True)
    buf = b""
    while b"\n" not in buf:    # heartbeats start once every rank is in: a starved controller must first
        chunk = os.read(stdin, 65536)  # finish the handshakes
        if not chunk:
            return
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    assert line.strip() == b"go", line
    start = time.monotonic()
    # What beats on its own: each rank, or (--relay) each node's agent with its ranks' heartbeats
    units: list = sorted(agents) if a.relay else ranks
    n_units = len(units)
    due = [start + hb * (i / n_units) for i in range(n_units)]
    nxt = 0
    silenced, last_hb = None, {}
    got_stop: dict[int, float] = {}
    # What this simulator saw, for a failed recovery's explanation: orders received and answered per
    # action (distinct ranks), the longest gap between two heartbeats of one rank and between two
    # turns of this loop (a starved simulator is silent ranks to the controller).
    received: dict[str, set] = collections.defaultdict(set)
    answered: dict[str, set] = collections.defaultdict(set)
    sent_at: dict[int, float] = {}
    hb_gap = [0.0, None, None]  # seconds, rank, when (wall clock)
    loop_gap, loop_at = 0.0, time.monotonic()
    # epoll on each socket's ZMQ_FD costs O(ready sockets) per wake-up; zmq.Poller would rebuild a
    # 4096-entry poll set every time and steal the CPU the controller is measured on.
    ep = select.epoll()
    by_fd = {}
    for r, s in socks.items() if not a.relay else ():
        by_fd[s.getsockopt(zmq.FD)] = r
        ep.register(s.getsockopt(zmq.FD), select.EPOLLIN)
    for n, s in agents.items():
        by_fd[s.getsockopt(zmq.FD)] = ("agent", n)
        ep.register(s.getsockopt(zmq.FD), select.EPOLLIN)
    os.set_blocking(stdin, False)
    report_at = None
    stop_after = None

    iteration = {"it": 10, "phase": "forward"}
    half = a.world // 2
    # --misbehave ACTION:HOW (to see a failed recovery explained): the odd ranks refuse ACTION, never
    # answer it (silent), or never receive it (lost).
    bad_action, _, bad_how = (a.misbehave or "").partition(":")
    bad_action = ACTIONS.get(bad_action, bad_action)  # (a round's name, or its order's)

    def answer(r, msg):
        """Recovery mode: a real rank's answer, sent on its own socket."""
        data = answer_data(r, msg)
        if data is None:
            return
        action = msg["action"]
        if send(r, protocol.encode("result", rank=r, action=action, id=msg["id"], ok=True, data=data), f"result:{action}"):
            for x in chain(msg):
                answered[x].add(r)
        if "resume" in chain(msg):  # the next step ends at once: the controller's MTTR stops there
            resumed(r)

    def chain(msg) -> list:
        """The orders a message carries: its own, and the next round's played with it (``then``)."""
        then = (msg.get("args") or {}).get("then")
        return [msg["action"], then[0]] if then else [msg["action"]]

    def resumed(r):
        iteration.update(it=11, phase="step")
        send(r, protocol.encode("hb", rank=r, it=11, upd=False, health="ok", phase="step", progress=2.0), "hb")

    def work() -> dict:
        """What a training rank's heartbeat says of its steps' own work (the straggler watch judges
        every one): a step per heartbeat interval, 50 ms of its own work each."""
        return {"wait": False, "steps": 10 + int((time.monotonic() - started) / hb), "busy": 0.05}

    def heartbeat(r) -> dict:
        return {"v": protocol.VERSION, "t": "hb", "rank": r, "it": iteration["it"], "upd": False, "health": "ok",
                "phase": iteration["phase"], "progress": 1.0 if iteration["it"] < 11 else 2.0, "pid": 100000 + r,
                "age": 0.0, **work()}

    def agent_beats(node, node_ranks) -> bool:
        """--relay: agent ``node``'s heartbeat, carrying its ranks' (``node_ranks``)."""
        try:
            agents[node].send(protocol.encode("agent_hb", node_rank=node, beats=as_columns([
                heartbeat(r) for r in node_ranks if r != silenced])), zmq.NOBLOCK)
            return True
        except zmq.Again:
            unsent["hb"] += len(node_ranks)
            return False

    def answer_data(r, msg):
        """Recovery mode: what a real rank's handlers would answer (a DP=world layout), with what its
        communicators carried (``communicators``), both answers where the order carries the next
        round's (as a rank's ``serving`` runs them); None: an order it does not answer."""
        first = one_answer(r, msg["action"])
        actions = chain(msg)
        return first if len(actions) == 1 or first is None else [first, one_answer(r, actions[1])]

    def status(r) -> dict:
        return {"replica": True, "rank": r, "iteration": 10, "updating": False, "touched": True,
                "replica_group": sorted([r, (r + half) % a.world]), "trainer_iteration": 10, "ended": 10,
                **({} if a.no_comm else {"comm": communicators(r, a.world)})}

    # Each rank's status, made before the fault: a real rank makes its own on its own host, all at once;
    # here thousands would be made in turn, inside the round, on the cores the controller is measured on.
    statuses = {r: status(r) for r in ranks} if a.respond else {}

    def one_answer(r, action):
        data = None
        if action == "ha-status":
            data = statuses[r]
        elif action in ("stop", "rebuild", "repair", "rollback", "resume"):
            data = {"rollback": "rollback", "repair": {"received": 0}}.get(action, "ok")
        return data

    def relay(n, msg):
        """--relay: agent ``n`` got an order for some of its ranks: each answers as above (or misbehaves
        as asked), and the agent sends their answers in one frame."""
        action, items, actions = msg["action"], [], chain(msg)
        via["agents"] += len(msg["ranks"])
        for r in msg["ranks"]:
            if bad_action in actions and bad_how in ("lost", "silent") and r % 2:
                if bad_how == "silent":
                    received[action].add(r)
                continue
            for x in actions:
                received[x].add(r)
            if action == "stop" and r not in got_stop:
                got_stop[r] = time.time()
            if bad_action in actions and bad_how == "refuse" and r % 2:
                items.append({"v": protocol.VERSION, "t": "result", "rank": r, "action": action, "id": msg["id"],
                              "ok": False, "error": f"simulated refusal of {bad_action}", "pid": 100000 + r})
                continue
            data = answer_data(r, msg) if a.respond else None
            if data is not None:
                items.append({"v": protocol.VERSION, "t": "result", "rank": r, "action": action, "id": msg["id"],
                              "ok": True, "data": data, "pid": 100000 + r})
        if items:
            try:
                agents[n].send(results_frame(n, items), zmq.NOBLOCK)
                for x in actions:
                    answered[x].update(i["rank"] for i in items)
            except zmq.Again:
                unsent[f"result:{action}"] += len(items)
        if "resume" in actions and a.respond:  # (the next step ends at once: its heartbeats, passed on at once)
            iteration.update(it=11, phase="step")
            agent_beats(n, msg["ranks"])

    def drain_agent(n):
        s = agents[n]
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            msg = protocol.decode(s.recv(zmq.NOBLOCK))
            if msg["t"] == "do" and "ranks" in msg:
                relay(n, msg)

    def drain(r):
        if isinstance(r, tuple):
            return drain_agent(r[1])
        s = socks[r]
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # also re-arms ZMQ_FD
            data = s.recv(zmq.NOBLOCK)
            if b"do" not in data:
                continue
            msg = protocol.decode(data)
            if msg["t"] != "do":
                continue
            via["direct"] += 1
            actions = chain(msg)
            if bad_action in actions and bad_how == "lost" and r % 2:
                continue  # (--misbehave: as if it never came)
            for x in actions:
                received[x].add(r)
            if msg["action"] == "stop" and r not in got_stop:
                got_stop[r] = time.time()
            if bad_action in actions and bad_how == "silent" and r % 2:
                continue
            if bad_action in actions and bad_how == "refuse" and r % 2:
                if send(r, protocol.encode("result", rank=r, action=msg["action"], id=msg["id"], ok=False,
                                           error=f"simulated refusal of {bad_action}"), f"result:{bad_action}"):
                    answered[bad_action].add(r)
                continue
            if a.respond:
                answer(r, msg)

    summary_path = os.path.join(a.log_dir, f"sim-{a.lo}.json")
    summarized = 0.0

    def summarize():
        """What this simulator saw so far, in a file: the benchmark reads it even if we are swamped."""
        with open(summary_path + ".tmp", "w") as f:
            json.dump({"ranks": [a.lo, a.hi], "received": {k: len(v) for k, v in received.items()},
                       "answered": {k: len(v) for k, v in answered.items()}, "unsent": dict(unsent),
                       "missed": {k: sorted(set(ranks) - v)[:8] for k, v in received.items() if len(v) < n_ranks},
                       "hb_gap_s": round(hb_gap[0], 3), "hb_gap_rank": hb_gap[1], "hb_gap_at": hb_gap[2],
                       "loop_gap_s": round(loop_gap, 3), "orders_via": dict(via)}, f)
        os.replace(summary_path + ".tmp", summary_path)

    beaten: list = []  # sockets a heartbeat went out on: a send can consume the FD's edge
    via: collections.Counter = collections.Counter()  # orders a rank got through its agent, and directly

    def beat():
        """The heartbeats that are due. A real rank's heartbeat thread does not wait while its rank
        answers an order; here thousands of ranks answer in turn, so this runs between their answers
        too (else a round's orders hold every heartbeat back for seconds on a loaded host)."""
        nonlocal nxt
        now = time.monotonic()
        k = 0
        while due[nxt] <= now + 0.01 and k < n_units:
            u = units[nxt]
            if a.relay:
                node_ranks = range(u * NODE, min(a.hi, (u + 1) * NODE))
                if agent_beats(u, node_ranks):
                    beaten.append(("agent", u))
            elif u != silenced:
                send(u, protocol.encode("hb", rank=u, it=iteration["it"], upd=False, health="ok",
                                        phase=iteration["phase"], progress=1.0, **work()), "hb")
                beaten.append(u)
            for r in node_ranks if a.relay else (u,):
                if r != silenced:
                    last_hb[r] = time.time()
                    if r in sent_at and now - sent_at[r] > hb_gap[0]:
                        hb_gap[:] = [now - sent_at[r], r, time.time()]
                    sent_at[r] = now
            due[nxt] += hb
            nxt = (nxt + 1) % n_units
            k += 1

    for r in ranks if not a.relay else ():
        drain(r)
    for node in agents:
        drain_agent(node)
    while True:
        now = time.monotonic()
        loop_gap, loop_at = max(loop_gap, now - loop_at), now
        if now - summarized > 1.0:
            summarized = now
            summarize()
        beat()
        while beaten:
            drain(beaten.pop())
        for node in agents if agents and nxt % 64 == 0 else ():  # (a send can consume an agent's edge too)
            drain_agent(node)
        wait = max(0.0, min(0.02, due[nxt] - time.monotonic()))
        for i, (fd, _) in enumerate(ep.poll(wait)):
            drain(by_fd[fd])
            if i % 64 == 63:
                beat()
        try:
            chunk = os.read(stdin, 65536)
            if not chunk:  # the benchmark is gone: so are we (never heartbeat on, loading the host)
                stop_after = time.monotonic()
            buf += chunk
        except BlockingIOError:
            pass
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = line.decode().split()
            if cmd and cmd[0] == "fault":  # this rank's memory error (recovery mode)
                r = int(cmd[1])
                if a.lo <= r < a.hi:
                    send(r, protocol.encode("fault", rank=r, kind="memory-error", iteration=11, phase="backward",
                                            detail="UCE ERROR (simulated)", at=time.time()), "fault")
                report_at = time.monotonic() + a.report_s
            elif cmd and cmd[0] == "silence":
                silenced = int(cmd[1]) if a.lo <= int(cmd[1]) < a.hi else None
                print(json.dumps({"silenced": silenced, "last_hb": last_hb.get(silenced)}), flush=True)
                report_at = time.monotonic() + a.report_s
            elif cmd and cmd[0] == "quit":
                stop_after = time.monotonic()
        # (counted only while a report is due: this loop turns hundreds of times a second, on the CPU
        # the controller is measured on)
        live = n_ranks - (silenced is not None)
        if report_at and (len(got_stop) - (silenced in got_stop) == live or time.monotonic() > report_at):
            print(json.dumps({"stop_received": len(got_stop), "of": live,
                              "last_stop": max(got_stop.values()) if got_stop else None}), flush=True)
            report_at = None
        if stop_after is not None:
            break
    summarize()
    for s in {*socks.values(), *agents.values()}:
        s.close()
    ctx.term()


class Events:
    """The controller's event log (events/controller.jsonl), read as it grows."""

    def __init__(self, log_dir: str):
        self.path = os.path.join(log_dir, "events", "controller.jsonl")
        self.all: list[dict] = []
        self._pos, self._rest = 0, b""

    def poll(self) -> list[dict]:
        """The events written since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self._pos += len(data)
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        self.all.extend(new)
        return new

    def wait(self, match, timeout: float, step: float = 0.05) -> dict | None:
        """The first event (from the start) that ``match`` accepts, waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            self.poll()
            for e in self.all[seen:]:
                if match(e):
                    return e
            seen = len(self.all)
            if time.monotonic() > deadline:
                return None
            time.sleep(step)


class Sim:
    """A simulator process and its report lines (read by a thread: a starved simulator must not
    block the benchmark past its limits)."""

    def __init__(self, cmd: list[str]):
        self.proc = jobs.popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.lines.put(json.loads(line))
            except ValueError:
                pass
        self.lines.put(None)  # its end

    def tell(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def report(self, key: str, timeout: float) -> dict | None:
        """Its next report that has ``key`` (None: none within ``timeout``, or it ended)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if msg is None:
                return None
            if key in msg:
                return msg


# The retry playbook's rounds, in order; each fails as "<round> failed (...)" (a merged one, "a+b": its
# failure is a new fault of the ranks that failed it, "other" in phase "recovery", with that detail).
ROUNDS = ("stop", "status", "plan", "rebuild+repair", "rollback+resume", "rebuild", "repair", "rollback", "resume",
          "first_step")
ACTIONS = {"stop": "stop", "status": "ha-status", "rebuild": "rebuild", "repair": "repair", "rollback": "rollback",
           "resume": "resume", "rebuild+repair": "rebuild", "rollback+resume": "rollback"}


def round_failed(e: dict) -> bool:
    """A fault that is a merged round's failure (the ranks that answered it had gone on)."""
    return e["event"] == "fault" and e.get("phase") == "recovery" and e["kind"] == "other" \
        and (e.get("detail") or "").split(" failed", 1)[0] in ROUNDS


def explain(events: list[dict], injected: dict | None, controller, summaries: list[dict], world: int,
            waited: float) -> dict:
    """Why a recovery did not come: the round, the kind of failure, and the events that show it.

    kind: "new fault" (faults other than the injected one came during the recovery: the playbook
    starts over, or falls back), "timeout" (a state past its time limit, a round past its wait),
    "refusal" (a rank answered an order with an error, a plan could not be made, the dump was
    refused), "lost message" (an order some simulated ranks never received, or answers they sent
    that the controller never counted), "no outcome" (none of those within the benchmark's wait)."""
    t0 = injected["time"] if injected else (events[0]["time"] if events else 0.0)
    after = [e for e in events if e["time"] >= t0]
    states = [e for e in after if e["event"] == "state"]
    moves = [f"{e['from']}-({e['outcome']})->{e['to']} after {e['seconds']}s" for e in states
             if e["from"] != e["to"]]
    failed = next((e for e in after if e["event"] in ("strategy_failed", "dump_refused") or round_failed(e)), None)
    others = [e for e in after if e["event"] == "fault" and e is not injected and e is not failed]
    timeouts = [e for e in states if e["outcome"] == "timeout"]
    state = states[-1]["to"] if states else "normal"
    # What the controller was doing when the benchmark gave up (read from it, where it exposes it).
    runner = getattr(controller, "runner", None)
    current = getattr(getattr(runner, "current", None), "name", None)
    episode = getattr(controller, "episode", None)
    phases = dict(getattr(episode, "phases", None) or {})
    waiting = len(getattr(runner, "waiting", ()) or ()) if runner is not None else None
    received = collections.Counter()
    answered = collections.Counter()
    unsent = collections.Counter()
    for s in summaries:
        received.update(s.get("received", {}))
        answered.update(s.get("answered", {}))
        unsent.update(s.get("unsent", {}))
    out: dict = {"state": state, "transitions": moves[:20], "phases_done": phases, "waited_s": round(waited, 1)}
    if summaries:
        out["simulators"] = {"received": dict(received), "answered": dict(answered), "unsent": dict(unsent),
                             "hb_gap_s": max(s.get("hb_gap_s", 0) for s in summaries),
                             "loop_gap_s": max(s.get("loop_gap_s", 0) for s in summaries)}
    reason = failed and (failed.get("reason") or failed.get("message") or failed.get("detail") or "")
    round_ = current
    if reason:
        head = reason.split(" failed", 1)[0].strip()
        round_ = head if head in ROUNDS else ("plan" if failed["event"] == "strategy_failed" else "dump")
    elif state in ("pause", "decide"):
        round_ = "stop"
    out["round"] = round_
    if others:
        kinds = collections.Counter(e["kind"] for e in others)
        first = others[0]
        where = next((s["from"] for s in states if s["time"] >= first["time"]), state)
        out.update(kind="new fault", why=f"{len(others)} fault(s) besides the injected one during the recovery "
                   f"({', '.join(f'{n} {k}' for k, n in kinds.most_common())}); the first: rank(s) "
                   f"{first['ranks'][:8]} {first['kind']} ({first.get('detail', '')}) in state {where}",
                   faults=[{k: e.get(k) for k in ("ranks", "kind", "detail", "detect_s")} for e in others[:5]])
    elif timeouts:
        e = timeouts[0]
        out.update(kind="timeout", why=f"state {e['from']} ran past its time limit after {e['seconds']}s "
                   f"(round {round_ or '?'})")
    elif reason and ("no answer" in reason or "timed out" in reason):
        action = ACTIONS.get(round_ or "")
        silent = received.get(action, 0) - answered.get(action, 0) if action and summaries else None
        secs = next((e["seconds"] for e in reversed(states) if e["outcome"] == "failed"), None)
        out.update(kind="timeout", why=(f"{silent} simulated rank(s) received {action!r} and never answered; "
                                        if silent else "") + f"the round gave up after {secs}s: {reason[:300]}")
    elif reason:
        out.update(kind="refusal", why=reason[:400])
    else:
        out.update(kind="no outcome", why=f"no recovered, strategy_failed or diagnosis event within {waited:.0f}s; "
                   f"the controller is in state {state}" + (f", round {current} waiting for {waiting} rank(s)"
                                                             if current else ""))
    action = ACTIONS.get(round_ or "")
    if action and summaries and out["kind"] in ("timeout", "no outcome"):
        # Who never got the order (lost on its way), who answered but was not counted (lost on the way back)
        got = received.get(action, 0)
        if got < world:
            out.update(kind="lost message", why=f"{world - got} simulated rank(s) never received {action!r}; " +
                       out["why"], missed=[m for s in summaries for m in s.get("missed", {}).get(action, [])][:8])
        elif unsent.get(f"result:{action}"):
            out.update(kind="lost message", why=f"{unsent[f'result:{action}']} answer(s) to {action!r} could not "
                       f"be sent (queue full); " + out["why"])
    return out


def status_json(log_dir: str, ranks: int, insecure: bool, timeout: float) -> bool:
    """``mindspeed-ha status --json`` against the running controller: every rank listed."""
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "status", "--log-dir", log_dir, "--json",
           "--timeout", f"{timeout:g}"]
    try:
        proc = subprocess.run(cmd + (["--ha-insecure"] if insecure else []), capture_output=True, text=True,
                              timeout=2 * timeout + 60)  # (+ the CLI's own start: imports)
    except subprocess.TimeoutExpired:
        print(f"status --json did not end within {2 * timeout + 60:g}s", flush=True)
        return False
    if proc.returncode != 0:
        print(f"status --json failed ({proc.returncode}): {proc.stderr[-1000:]}", flush=True)
        return False
    return len(json.loads(proc.stdout)["ranks"]) == ranks


def main() -> None:
    if os.environ.get("CTL_SCALE_DEBUG"):
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["CTL_SCALE_DEBUG"]), exit=True)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--procs", type=int, default=4, help="simulator processes")
    p.add_argument("--heartbeat", type=float, default=2.0,
                   help="heartbeat interval, seconds (the controller declares a rank lost after "
                        "max(1.8 heartbeats, 3 s), or MINDSPEED_HA_DEAD_AFTER; with --recovery plus "
                        "2 ms a rank, unless that is set)")
    p.add_argument("--insecure", action="store_true", help="without CurveZMQ")
    p.add_argument("--recovery", action="store_true",
                   help="a memory error instead of a silenced rank: the whole retry playbook at this scale")
    p.add_argument("--no-comm", action="store_true",
                   help="the status without its communicators' section (as before stop 66: every group remade)")
    p.add_argument("--keep", action="store_true", help="keep the log dir (it is kept anyway when a recovery fails)")
    p.add_argument("--misbehave", metavar="ACTION:HOW",
                   help="--recovery: the simulated odd ranks refuse ACTION (HOW=refuse), never answer it "
                        "(silent) or never receive it (lost), e.g. rebuild:refuse — a failed recovery, explained")
    p.add_argument("--relay", action="store_true",
                   help="nodes of 8 ranks behind agents that relay (mindspeed-ha run --relay): the controller's "
                        "orders go to each node's agent and come back answered in one frame a node")
    p.add_argument("--respond", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lo", type=int), p.add_argument("--hi", type=int), p.add_argument("--world", type=int)
    p.add_argument("--endpoint"), p.add_argument("--log-dir"), p.add_argument("--report-s", type=float)
    a = p.parse_args()
    if a.sim:
        return simulate(a)

    from mindspeed_ha.control.wire import security
    from mindspeed_ha.control.controller import Controller
    from mindspeed_ha.events import setup_text_log
    from mindspeed_ha.options import HAOptions
    lim = limits(a.ranks, a.heartbeat)
    if a.recovery and not os.environ.get("MINDSPEED_HA_DEAD_AFTER"):
        os.environ["MINDSPEED_HA_DEAD_AFTER"] = f"{lim['dead_after_s']:.1f}"  # (read by the Controller below)
    else:
        lim.pop("dead_after_s")
    log_dir = tempfile.mkdtemp(prefix="ctl-scale-")
    setup_text_log(log_dir)
    import logging
    logging.getLogger("mindspeed_ha").handlers[-1].setLevel(logging.ERROR)  # keep stdout for results
    opts = HAOptions(strategies=frozenset({"dump", "retry"} if a.recovery else {"dump"}), log_dir=log_dir,
                     insecure=a.insecure, heartbeat_s=a.heartbeat, hang_timeout_s=3600,
                     register_timeout_s=lim["register_s"])
    keys = security.Keys.load(log_dir, insecure=a.insecure, create=True)
    c = Controller(log_dir, a.ranks, opts, keys, host="127.0.0.1").start()
    events = Events(log_dir)
    if a.recovery:
        c.store()  # (a controller hosted by rank 0 has torch imported already; this one would pay it in rebuild)
    t0 = time.time()
    per = -(-a.ranks // a.procs)
    per = -(-per // NODE) * NODE  # (a node's ranks in one simulator)
    sims = []
    for i in range(a.procs):
        lo, hi = i * per, min(a.ranks, (i + 1) * per)
        if lo >= hi:
            break
        cmd = [sys.executable, __file__, "--sim", "--lo", str(lo), "--hi", str(hi), "--world", str(a.ranks),
               "--endpoint", c.endpoint, "--log-dir", log_dir, "--heartbeat", str(a.heartbeat),
               "--report-s", str(lim["report_s"])]
        if a.insecure:
            cmd.append("--insecure")
        if a.recovery:
            cmd.append("--respond")
        if a.no_comm:
            cmd.append("--no-comm")
        if a.relay:
            cmd.append("--relay")
        if a.misbehave:
            cmd += ["--misbehave", a.misbehave]
        sims.append(Sim(cmd))
    try:
        result = run(a, c, events, sims, lim, t0, log_dir)
    except SystemExit:
        print(f"events and text log kept in {log_dir}", flush=True)
        raise
    finally:
        for s in sims:
            s.tell("quit")
        deadline = time.monotonic() + lim["round_s"]
        for s in sims:
            try:
                s.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.proc.kill()  # (swamped: its last summary is in its file)
        c.close()
    summaries = []
    for i in range(len(sims)):
        try:
            with open(os.path.join(log_dir, f"sim-{i * per}.json")) as f:
                summaries.append(json.load(f))
        except (OSError, ValueError):
            pass
    result["orders_via"] = dict(sum((collections.Counter(s.get("orders_via", {})) for s in summaries),
                                    collections.Counter()))
    if a.recovery and not result["recovery_ok"]:
        result["recovery_failure"] = explain(events.all, result.pop("_injected"), c, summaries, a.ranks,
                                             result.pop("_waited"))
        f = result["recovery_failure"]
        print(f"recovery FAILED in round {f['round']} ({f['kind']}): {f['why'][:300]}", flush=True)
        print(f"  transitions: {'; '.join(f['transitions']) or '-'}", flush=True)
        if "simulators" in f:
            print(f"  simulators: {json.dumps(f['simulators'])}", flush=True)
        if a.misbehave and not a.keep:  # (a failure asked for)
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"  events and text log kept in {log_dir}", flush=True)
            result["log_dir"] = log_dir
    else:
        result.pop("_injected", None), result.pop("_waited", None)
        if a.keep:
            result["log_dir"] = log_dir
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    print(json.dumps(result))


class RoundClock:
    """Where each recovery round's time goes: the controller thread's CPU and the simulators' (the
    work of the ranks and agents, which on a cluster runs on their own hosts, here on the cores the
    controller is measured on), sampled every 10 ms by the round the controller plays then; and the
    training before the fault ("training": the heartbeats' load on the controller)."""

    def __init__(self, c, sims: list[Sim]):
        self.c, self.pids = c, [s.proc.pid for s in sims]
        self.used: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, name="round-clock", daemon=True)
        self.faulted = False

    def _round(self) -> str | None:
        """The round the controller plays now, or its state where it plays none (the pause: the stop;
        "training": before the fault; None: after the recovery)."""
        state = self.c.machine.state.value
        self.faulted = self.faulted or state != "normal"
        if state == "normal":
            return None if self.faulted else "training"
        runner = getattr(getattr(self.c, "recovery", None), "runner", None)
        if state != "recovering" or runner is None or getattr(runner, "current", None) is None:
            return "stop" if state == "pause" else state
        merged = getattr(runner, "merged", None)
        # (once the merged round's answers are in, the runner is in it, the merge still named)
        return f"{runner.current.name}+{merged.name}" if merged not in (None, runner.current) else runner.current.name

    def _simulators_cpu(self) -> float:
        total = 0.0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
        return total

    def _sample(self) -> None:
        thread = next((t for t in threading.enumerate() if t.name == "mindspeed-ha-controller"), None)
        if thread is None or thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
            return
        clock = time.pthread_getcpuclockid(thread.ident)
        last = None
        while not self.done.wait(0.01):
            try:
                now = (time.clock_gettime(clock), self._simulators_cpu(), time.monotonic())
            except OSError:  # (the controller's thread ended)
                return
            name = self._round()
            if last is not None and name is not None:
                acc = self.used[name]
                for i in range(3):
                    acc[i] += now[i] - last[i]
            last = now

    def start(self) -> RoundClock:
        self.thread.start()
        return self

    def stop(self) -> dict:
        """round -> {controller_cpu_s, simulators_cpu_s, wall_s}, in the order played ("training"
        first: before the fault)."""
        self.done.set()
        self.thread.join()
        return {name: {"controller_cpu_s": round(ctl, 3), "simulators_cpu_s": round(sim, 3), "wall_s": round(wall, 3)}
                for name, (ctl, sim, wall) in self.used.items() if wall >= 0.005}


def run(a, c, events: Events, sims: list[Sim], lim: dict, t0: float, log_dir: str) -> dict:
    for s in sims:
        if s.report("ready", lim["register_s"]) is None:
            raise SystemExit(f"a simulator did not connect its ranks within {lim['register_s']:g} s")
    up = events.wait(lambda e: e["event"] == "state" and e["from"] == "init", lim["register_s"] - (time.time() - t0))
    if up is None or up["to"] != "normal":
        raise SystemExit(f"ranks did not all register within {lim['register_s']:g} s ({up and up['outcome']})")
    t_reg = time.time() - t0
    for s in sims:
        s.tell("go")
    print(f"{a.ranks} ranks registered in {t_reg:.1f}s ({'insecure' if a.insecure else 'CurveZMQ'}), "
          f"heartbeat {a.heartbeat}s over {a.procs} simulator processes", flush=True)
    clock = RoundClock(c, sims).start()
    time.sleep(3 * a.heartbeat)  # steady state
    victim = a.ranks // 2 + 1
    for s in sims:
        s.tell(f"{'fault' if a.recovery else 'silence'} {victim}")
    last_hb = None
    if not a.recovery:
        reports = [s.report("silenced", lim["round_s"]) for s in sims]
        per = -(-a.ranks // len(sims) // NODE) * NODE
        last_hb = (reports[victim // per] or {}).get("last_hb")
    # The fault we caused (a rank's loss found meanwhile is reported as what it is: a new fault).
    kind = "memory-error" if a.recovery else "heartbeat-lost"
    fault = events.wait(lambda e: e["event"] == "fault", lim["round_s"] + 10 * a.heartbeat)
    if fault is None:
        raise SystemExit(f"the controller reported no fault within {lim['round_s'] + 10 * a.heartbeat:g} s")
    injected = events.wait(lambda e: e["event"] == "fault" and e["kind"] == kind and victim in e["ranks"],
                           lim["round_s"])
    if fault is not injected:
        print(f"first fault is not the one injected: {fault}", flush=True)
        fault = injected or fault  # (the figures are the injected fault's, where it came)
    detect_s = fault["detect_s"] if a.recovery or last_hb is None else fault["time"] - last_hb
    decision = events.wait(lambda e: e["event"] == "decision" and e["time"] >= fault["time"], lim["round_s"])
    stops = [s.report("stop_received", lim["report_s"] + lim["round_s"]) or {} for s in sims]
    last = max((s.get("last_stop") or 0) for s in stops)
    received = sum(s.get("stop_received", 0) for s in stops)
    deliver_ms = (last - fault["time"]) * 1e3 if last else None
    res = {"ranks": a.ranks, "heartbeat_s": a.heartbeat, "detect_s": round(detect_s, 3),
           "detect_heartbeats": round(detect_s / a.heartbeat, 2), "fault_kind": fault["kind"],
           "fault_ranks": fault["ranks"][:4], "victim": victim, "limits": {k: round(v, 1) for k, v in lim.items()},
           "decide_ms": decision and decision["decide_ms"],
           "decide_cpu_ms": decision and decision.get("cpu_ms"), "deliver_ms": deliver_ms and round(deliver_ms, 1),
           "stop_received": received, "register_s": round(t_reg, 1), "secure": not a.insecure}
    if a.recovery:
        t_wait = time.monotonic()
        end = events.wait(lambda e: e["event"] in ("recovered", "strategy_failed", "dump_refused", "diagnosis")
                          or round_failed(e), lim["recovery_s"])
        recovered = end if end is not None and end["event"] == "recovered" else None
        cpu = clock.stop()
        status_ok = status_json(log_dir, a.ranks, a.insecure, lim["status_s"])
        phases = (recovered or {}).get("phases", {})
        rounds = {k: v for k, v in phases.items() if k not in ("detect", "first_step")}
        slowest = max(rounds, key=rounds.get) if rounds else None
        res.update(recovery_ok=bool(recovered), recovery_s=recovered and recovered["mttr_s"],
                   recovery_phases=phases, recovery_round=slowest,
                   recovery_round_s=rounds[slowest] if slowest else None, status_ok=status_ok, round_cpu=cpu,
                   slowest_round_controller_cpu_s=max((v["controller_cpu_s"] for k, v in cpu.items()
                                                       if k in rounds), default=None),
                   _injected=injected, _waited=time.monotonic() - t_wait)
        if recovered:
            print(f"recovery at {a.ranks} ranks: ok, MTTR {res['recovery_s']} s, phases {phases}; slowest round "
                  f"{slowest} {res['recovery_round_s']} s; status --json {'ok' if status_ok else 'FAILED'}",
                  flush=True)
            print("  CPU by round (the controller's thread; the simulated ranks and agents, on the same cores): "
                  + ", ".join(f"{k} {v['controller_cpu_s']} s / {v['simulators_cpu_s']} s in {v['wall_s']} s"
                              for k, v in cpu.items()), flush=True)
        training = cpu.get("training")
        if training and training["wall_s"] > 0:  # (before the fault: the heartbeats, and nothing else)
            res["training_controller_cpu_per_s"] = round(training["controller_cpu_s"] / training["wall_s"], 3)
            print(f"  training before the fault: the controller's thread busy {res['training_controller_cpu_per_s']:.0%} "
                  f"of the time ({a.ranks / a.heartbeat:,.0f} heartbeats a second)", flush=True)
    else:
        clock.stop()
        print(f"silenced rank {victim}: detected after {detect_s:.3f}s ({detect_s / a.heartbeat:.2f} heartbeats); "
              f"stop sent to {decision and decision['ranks']} ranks {res['decide_ms']} ms after detection, "
              f"received by all {res['deliver_ms']} ms after detection", flush=True)
    res["dropped"] = sum(c.router.drops.counts.values())
    res["loadavg"] = [round(x, 1) for x in os.getloadavg()]
    return res


if __name__ == "__main__":
    main()
