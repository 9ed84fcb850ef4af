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

    python benchmarks/controller_scale.py --ranks 16384 [--recovery]
Last line: JSON with ranks, detect_s, decide_ms, heartbeat_s (and more; with --recovery also
recovery_ok, recovery_s, recovery_round_s — the slowest round — and status_ok).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time

import zmq


def simulate(a) -> None:
    """A simulator process: ranks [lo, hi) of the world; commands on stdin, reports on stdout."""
    from mindspeed_ha.control import protocol as P, security
    keys = security.Keys.load(a.log_dir, insecure=a.insecure, timeout=10)
    ctx = zmq.Context(io_threads=1)
    ctx.max_sockets = 65536
    ranks = list(range(a.lo, a.hi))
    socks = {}
    for r in ranks:
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.rcvhwm = s.sndhwm = 10000
        s.handshake_ivl = 300_000
        security.secure_client(s, keys)
        s.connect(a.endpoint)
        s.send(P.encode("register", rank=r, world=a.world, node=f"sim{r // 8}", pid=100000 + r,
                        groups=[[r, (r + a.world // 2) % a.world]]))
        socks[r] = s
    print(json.dumps({"ready": len(ranks)}), flush=True)
    hb = a.heartbeat
    n = len(ranks)
    # Heartbeats go out in 20 ms batches, each rank on its own phase of the interval.
    os.set_blocking(sys.stdin.fileno(), True)
    assert sys.stdin.readline().strip() == "go"  # heartbeats start once every rank is in: a starved
    start = time.monotonic()                      # controller must first finish the handshakes
    due = [start + hb * (i / n) for i in range(n)]
    nxt = 0
    silenced, last_hb = None, {}
    got_stop: dict[int, float] = {}
    # epoll on each socket's ZMQ_FD costs O(ready sockets) per wake-up; zmq.Poller would rebuild a
    # 4096-entry poll set every time and steal the CPU the controller is measured on.
    ep = select.epoll()
    by_fd = {}
    for r, s in socks.items():
        by_fd[s.getsockopt(zmq.FD)] = r
        ep.register(s.getsockopt(zmq.FD), select.EPOLLIN)
    os.set_blocking(sys.stdin.fileno(), False)
    buf = ""
    report_at = None
    stop_after = None

    iteration = {"it": 10, "phase": "forward"}
    half = a.world // 2

    def answer(r, msg):
        """Recovery mode: what a real rank's handler would answer (a DP=world layout)."""
        action, data = msg["action"], None
        if action == "ha-status":
            data = {"replica": True, "rank": r, "iteration": 10, "updating": False, "touched": True,
                    "replica_group": sorted([r, (r + half) % a.world]), "trainer_iteration": 10, "ended": 10}
        elif action in ("stop", "rebuild", "repair", "rollback", "resume"):
            data = {"rollback": "rollback", "repair": {"received": 0}}.get(action, "ok")
        else:
            return
        socks[r].send(P.encode("result", rank=r, action=action, id=msg["id"], ok=True, data=data), zmq.NOBLOCK)
        if action == "resume":  # the next step ends at once: the controller's MTTR stops there
            iteration.update(it=11, phase="step")
            socks[r].send(P.encode("hb", rank=r, it=11, upd=False, health="ok", phase="step", progress=2.0),
                          zmq.NOBLOCK)

    def drain(r):
        s = socks[r]
        while s.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # also re-arms ZMQ_FD
            data = s.recv(zmq.NOBLOCK)
            if b"do" not in data:
                continue
            msg = P.decode(data)
            if msg["t"] != "do":
                continue
            if msg["action"] == "stop" and r not in got_stop:
                got_stop[r] = time.time()
            if a.respond:
                answer(r, msg)

    for r in ranks:
        drain(r)
    while True:
        now = time.monotonic()
        sent = []
        while due[nxt] <= now + 0.01 and len(sent) < n:
            r = ranks[nxt]
            if r != silenced:
                socks[r].send(P.encode("hb", rank=r, it=iteration["it"], upd=False, health="ok",
                                       phase=iteration["phase"], progress=1.0), zmq.NOBLOCK)
                last_hb[r] = time.time()
                sent.append(r)
            due[nxt] += hb
            nxt = (nxt + 1) % n
        for r in sent:  # a send can consume the FD's edge: look at those sockets directly
            drain(r)
        wait = max(0.0, min(0.02, due[nxt] - time.monotonic()))
        for fd, _ in ep.poll(wait):
            drain(by_fd[fd])
        try:
            buf += sys.stdin.read() or ""
        except (TypeError, OSError):
            pass
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            cmd = line.split()
            if cmd and cmd[0] == "fault":  # this rank's memory error (recovery mode)
                r = int(cmd[1])
                if a.lo <= r < a.hi:
                    socks[r].send(P.encode("fault", rank=r, kind="memory-error", iteration=11, phase="backward",
                                           detail="UCE ERROR (simulated)", at=time.time()))
                report_at = time.monotonic() + 10 * hb + 5
            elif cmd and cmd[0] == "silence":
                silenced = int(cmd[1]) if a.lo <= int(cmd[1]) < a.hi else None
                print(json.dumps({"silenced": silenced, "last_hb": last_hb.get(silenced)}), flush=True)
                report_at = time.monotonic() + 10 * hb + 5
            elif cmd and cmd[0] == "quit":
                stop_after = time.monotonic()
        live = [r for r in ranks if r != silenced]
        if report_at and (len([r for r in live if r in got_stop]) == len(live) or time.monotonic() > report_at):
            print(json.dumps({"stop_received": len(got_stop), "of": len(live),
                              "last_stop": max(got_stop.values()) if got_stop else None}), flush=True)
            report_at = None
        if stop_after is not None:
            break
    for s in socks.values():
        s.close()
    ctx.term()


def wait_recovery(log_dir: str, timeout: float) -> dict | None:
    """The controller's ``recovered`` event (None: a failure or the end of the job came instead)."""
    path = os.path.join(log_dir, "events", "controller.jsonl")
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in open(path):
            e = json.loads(line)
            if e["event"] == "recovered":
                return e
            if e["event"] in ("repair_failed", "diagnosis"):
                print(f"recovery failed: {e}", flush=True)
                return None
        time.sleep(0.2)
    return None


def status_json(log_dir: str, ranks: int, insecure: bool) -> bool:
    """``mindspeed-ha status --json`` against the running controller: every rank listed."""
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "status", "--log-dir", log_dir, "--json", "--timeout", "30"]
    proc = subprocess.run(cmd + (["--ha-insecure"] if insecure else []), capture_output=True, text=True, timeout=120)
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
                        "max(1.8 heartbeats, 3 s), or MINDSPEED_HA_DEAD_AFTER)")
    p.add_argument("--insecure", action="store_true", help="without CurveZMQ")
    p.add_argument("--recovery", action="store_true",
                   help="a memory error instead of a silenced rank: the whole retry playbook at this scale")
    p.add_argument("--respond", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lo", type=int), p.add_argument("--hi", type=int), p.add_argument("--world", type=int)
    p.add_argument("--endpoint"), p.add_argument("--log-dir")
    a = p.parse_args()
    if a.sim:
        return simulate(a)

    from mindspeed_ha.control import security
    from mindspeed_ha.control.controller import Controller
    from mindspeed_ha.events import setup_text_log
    from mindspeed_ha.options import HAOptions
    log_dir = tempfile.mkdtemp(prefix="ctl-scale-")
    setup_text_log(log_dir)
    import logging
    logging.getLogger("mindspeed_ha").handlers[-1].setLevel(logging.ERROR)  # keep stdout for results
    opts = HAOptions(strategies=frozenset({"dump", "retry"} if a.recovery else {"dump"}), log_dir=log_dir,
                     insecure=a.insecure, heartbeat_s=a.heartbeat, hang_timeout_s=3600)
    keys = security.Keys.load(log_dir, insecure=a.insecure, create=True)
    c = Controller(log_dir, a.ranks, opts, keys, host="127.0.0.1").start()
    if a.recovery:
        c.store()  # (a controller hosted by rank 0 has torch imported already; this one would pay it in rebuild)
    t0 = time.time()
    per = -(-a.ranks // a.procs)
    sims = []
    for i in range(a.procs):
        lo, hi = i * per, min(a.ranks, (i + 1) * per)
        cmd = [sys.executable, __file__, "--sim", "--lo", str(lo), "--hi", str(hi), "--world", str(a.ranks),
               "--endpoint", c.endpoint, "--log-dir", log_dir, "--heartbeat", str(a.heartbeat)]
        if a.insecure:
            cmd.append("--insecure")
        if a.recovery:
            cmd.append("--respond")
        sims.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for s in sims:
        json.loads(s.stdout.readline())
    while c.machine.state.value == "init":
        time.sleep(0.05)
        if time.time() - t0 > 600:
            raise SystemExit("ranks did not all register within 600 s")
    t_reg = time.time() - t0
    for s in sims:
        s.stdin.write("go\n")
        s.stdin.flush()
    print(f"{a.ranks} ranks registered in {t_reg:.1f}s ({'insecure' if a.insecure else 'CurveZMQ'}), "
          f"heartbeat {a.heartbeat}s over {a.procs} simulator processes", flush=True)
    time.sleep(3 * a.heartbeat)  # steady state
    victim = a.ranks // 2 + 1
    for s in sims:
        s.stdin.write(f"{'fault' if a.recovery else 'silence'} {victim}\n")
        s.stdin.flush()
    last_hb = None if a.recovery else [json.loads(s.stdout.readline())["last_hb"] for s in sims][victim // per]
    while not c.faults:
        time.sleep(0.002)
    fault = c.faults[0]
    detect_s = fault["detect_s"] if a.recovery else fault["time"] - last_hb
    t_dec = time.time() + 10
    decision = None
    while decision is None and time.time() < t_dec:
        for line in open(os.path.join(log_dir, "events", "controller.jsonl")):
            e = json.loads(line)
            if e["event"] == "decision":
                decision = e
                break
        time.sleep(0.05)
    stops = [json.loads(s.stdout.readline()) for s in sims]
    last = max((s["last_stop"] or 0) for s in stops)
    received = sum(s["stop_received"] for s in stops)
    deliver_ms = (last - fault["time"]) * 1e3 if last else None
    recovery = wait_recovery(log_dir, timeout=600) if a.recovery else None
    status_ok = status_json(log_dir, a.ranks, a.insecure) if a.recovery else None
    for s in sims:
        try:
            s.stdin.write("quit\n")
            s.stdin.flush()
        except BrokenPipeError:
            pass
    for s in sims:
        try:
            s.wait(30)
        except subprocess.TimeoutExpired:
            s.kill()
    c.close()
    res = {"ranks": a.ranks, "heartbeat_s": a.heartbeat, "detect_s": round(detect_s, 3),
           "detect_heartbeats": round(detect_s / a.heartbeat, 2), "fault_kind": fault["kind"],
           "fault_ranks": fault["ranks"][:4], "victim": victim, "loadavg": [round(x, 1) for x in os.getloadavg()],
           "decide_ms": decision and decision["decide_ms"],
           "decide_cpu_ms": decision and decision.get("cpu_ms"), "deliver_ms": deliver_ms and round(deliver_ms, 1),
           "stop_received": received, "register_s": round(t_reg, 1), "secure": not a.insecure,
           "dropped": sum(c.router.drops.counts.values())}
    if a.recovery:
        phases = (recovery or {}).get("phases", {})
        rounds = {k: v for k, v in phases.items() if k not in ("detect", "first_step")}
        res.update(recovery_ok=bool(recovery), recovery_s=recovery and recovery["mttr_s"],
                   recovery_phases=phases, recovery_round_s=max(rounds.values()) if rounds else None,
                   status_ok=status_ok)
        print(f"recovery at {a.ranks} ranks: {'ok' if recovery else 'FAILED'}, MTTR {res['recovery_s']} s, "
              f"phases {phases}; status --json {'ok' if status_ok else 'FAILED'}")
    if not a.recovery:
        print(f"silenced rank {victim}: detected after {detect_s:.3f}s ({detect_s / a.heartbeat:.2f} heartbeats); "
              f"stop sent to {decision and decision['ranks']} ranks {res['decide_ms']} ms after detection, "
              f"received by all {res['deliver_ms']} ms after detection")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
