"""``mindspeed-ha run``: a per-node launcher agent with torchrun's flags that does not kill the job
on its own when one worker fails: it reports the exit (pid, code, signal) to the controller at once
and does what the controller decides (exit everyone, restart one worker, restart all).

Where the controller lives: a thread in rank 0 (the design's default). The agent on node 0 makes the
job's keys before starting any worker; every agent learns the controller's address from
``DIR/controller.json`` and follows takeovers like a processor does. Without any controller (HA off,
or rank 0 died before it came up) the agent falls back to torchrun's behaviour: one failure ends all.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

from ..control import protocol as P, security
from ..control.election import read_controller_json
from ..control.board import ProgressBoard
from ..control.link import ControllerLink
from ..events import EventLog, get_logger, log_dir_from_env, setup_text_log
from ..options import from_script_args
from . import spare
from .health import HealthHook

log = get_logger("launcher.agent")


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="mindspeed-ha run", description=__doc__.split("\n\n")[0])
    p.add_argument("--standalone", action="store_true", help="single node, free port on 127.0.0.1")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=29500)
    p.add_argument("--node-host", default=None, help="address other nodes reach this one at "
                   "(default: 127.0.0.1 when the master is loopback, else this host's address)")
    p.add_argument("--decision-timeout", type=float, default=15.0,
                   help="seconds to wait for the controller after a worker failed before acting alone")
    p.add_argument("--exit-grace", type=float, default=3.0,
                   help="seconds workers get to exit after an exit order before SIGTERM (+2s SIGKILL)")
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p


def _scan(args: list[str], flag: str, has_value: bool = True):
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1] if has_value and i + 1 < len(args) else True
        if has_value and a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, rank: int, local_rank: int, popen):  # a Popen, or spare.Forked
        self.rank, self.local_rank, self.popen = rank, local_rank, popen
        self.reported = False
        self.code: int | None = None
        self.sig = 0
        self.restarts = 0


class Agent:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.script_args = list(a.script_args)
        if self.script_args[:1] == ["--"]:
            self.script_args = self.script_args[1:]
        self.log_dir = os.path.abspath(_scan(self.script_args, "--ha-log-dir") or log_dir_from_env())
        self.insecure = bool(_scan(self.script_args, "--ha-insecure", False)) or security.is_insecure()
        kd = _scan(self.script_args, "--ha-key-dir")
        hb = _scan(self.script_args, "--ha-heartbeat-interval")
        self.hb = float(hb) if hb else 0.5
        if a.standalone:
            a.nnodes, a.node_rank, a.master_addr = 1, 0, "127.0.0.1"
            a.master_port = _free_port()
        self.world = a.nnodes * a.nproc_per_node
        loop = a.master_addr.startswith("127.") or a.master_addr == "localhost"
        self.node_host = a.node_host or ("127.0.0.1" if loop else socket.gethostbyname(socket.gethostname()))
        self.node = f"{socket.gethostname()}:{a.node_rank}"
        self.job_id = os.environ.get("MINDSPEED_HA_JOB_ID") or (
            uuid.uuid4().hex if a.standalone or a.nnodes == 1 else f"{a.master_addr}-{a.master_port}")
        # The job's own keys; an external controller (``mindspeed-ha controller``) made its own, unnamed.
        external = os.environ.get("MINDSPEED_HA_CONTROLLER", "rank0") != "rank0"
        self.key_dir = os.path.abspath(security.key_dir_for(self.log_dir, kd, None if external else self.job_id))
        self.workers: dict[int, Worker] = {}
        self.exit_order: dict | None = None
        self.exit_deadline = 0.0
        self.first_failure = 0.0
        self._signal = 0

    # ---- workers ------------------------------------------------------------------------------
    def _env(self, rank: int, local_rank: int, restarts: int) -> dict:
        a = self.a
        env = dict(os.environ)
        env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(self.world),
                   LOCAL_WORLD_SIZE=str(a.nproc_per_node), GROUP_RANK=str(a.node_rank),
                   MASTER_ADDR=a.master_addr, MASTER_PORT=str(a.master_port),
                   MINDSPEED_HA_LOG_DIR=self.log_dir, MINDSPEED_HA_JOB_ID=self.job_id,
                   MINDSPEED_HA_NODE=self.node, MINDSPEED_HA_NODE_HOST=self.node_host,
                   MINDSPEED_HA_RESTART_COUNT=str(restarts), MINDSPEED_HA_HEARTBEAT=str(self.hb),
                   MINDSPEED_HA_PROGRESS_DIR=self.board_dir)
        if self.insecure:
            env["MINDSPEED_HA_INSECURE"] = "1"
        else:
            env["MINDSPEED_HA_KEY_DIR"] = self.key_dir
        return env

    def _cmd(self) -> list[str]:
        return [sys.executable, "-u"] + (["-m"] if self.a.module else []) + [self.a.script] + self.script_args

    def _spawn(self, local_rank: int, restarts: int = 0) -> Worker:
        rank = self.a.node_rank * self.a.nproc_per_node + local_rank
        # Own session: signals reach workers only through us, and killpg also reaches their children.
        p = subprocess.Popen(self._cmd(), env=self._env(rank, local_rank, restarts), start_new_session=True)
        w = Worker(rank, local_rank, p)
        w.restarts = restarts
        self.workers[rank] = w
        self.events.emit("worker_start", worker_rank=rank, worker_pid=p.pid, restarts=restarts)
        return w

    def _restart(self, w: Worker) -> None:
        """A new worker for ``w``'s rank: a spare when one is there (its replacement is made at
        once), else a fresh process."""
        taken = self.spares.hand_over(spare.assignment(w.rank, w.local_rank, w.restarts + 1))
        if taken is None:
            self._spawn(w.local_rank, w.restarts + 1)
            return
        sp, warm = taken
        nw = Worker(w.rank, w.local_rank, sp)
        nw.restarts = w.restarts + 1
        self.workers[w.rank] = nw
        self.events.emit("worker_start", worker_rank=w.rank, worker_pid=sp.pid, restarts=nw.restarts, spare=True,
                         warm=warm)

    def _killpg(self, w: Worker, sig: int) -> None:
        try:
            os.killpg(w.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _poll_workers(self) -> None:
        for w in list(self.workers.values()):
            if w.reported:
                continue
            rc = w.popen.poll()
            if rc is None:
                continue
            w.reported = True
            w.code, w.sig = (rc, 0) if rc >= 0 else (0, -rc)
            at = time.time()
            where = ProgressBoard.read(os.path.join(self.board_dir, f"rank_{w.rank}"))
            extra = {"iteration": where[0], "phase": where[1][:64]} if where else {}
            self.events.emit("worker_exit", worker_rank=w.rank, worker_pid=w.popen.pid, code=w.code,
                             signal=w.sig, **extra)
            self.link.send(P.encode("exit", node_rank=self.a.node_rank, rank=w.rank, pid=w.popen.pid,
                                    code=w.code, signal=w.sig, at=at, **extra), replay=True)
            if (w.code or w.sig) and not self.first_failure and self.exit_order is None:
                self.first_failure = time.monotonic()
                how = f"signal {w.sig}" if w.sig else f"exit code {w.code}"
                log.warning("worker rank %d (pid %d) ended with %s", w.rank, w.popen.pid, how)
            self._killpg(w, signal.SIGKILL)  # its own children, if any, go with it

    def _hello(self) -> bytes:
        ws = sorted(self.workers.values(), key=lambda w: w.rank)
        return P.encode("agent", node=self.node, node_rank=self.a.node_rank, nnodes=self.a.nnodes,
                        pid=os.getpid(), ranks=[w.rank for w in ws], pids=[w.popen.pid for w in ws])

    # ---- controller orders --------------------------------------------------------------------
    def _on_do(self, msg: dict) -> None:
        action, args = msg["action"], msg.get("args", {})
        self.events.emit("order", action=action, args={k: v for k, v in args.items() if k != "diagnosis"})
        if action == "reconnect":  # the active controller handed over
            self.link.switch(str(args["endpoint"]))
        elif action == "exit" and self.exit_order is None:
            self.exit_order = args
            self.exit_deadline = time.monotonic() + self.a.exit_grace
        elif action == "restart":
            ranks = args.get("ranks") or sorted(self.workers)
            for r in ranks:
                w = self.workers.get(int(r))
                if w is None:
                    continue
                self._killpg(w, signal.SIGKILL)
                w.popen.wait()
                self._restart(w)
            self.first_failure = 0.0
            self.link.send(self._hello())

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum
        for w in self.workers.values():
            self._killpg(w, signum)

    # ---- main loop ----------------------------------------------------------------------------
    def run(self) -> int:
        a = self.a
        setup_text_log(self.log_dir)
        self.events = EventLog(self.log_dir, f"agent_{a.node_rank}")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.board_dir = tempfile.mkdtemp(prefix="mindspeed-ha-", dir=shm)
        # recover: workers started ahead of time that a restart hands a lost rank to (spare.py)
        self.spares = spare.Pool(spare.wanted(self.script_args), self._cmd(), self._env(-1, -1, 0), self.events,
                                 f"agent {a.node_rank}", os.path.join(self.board_dir, "spares"))
        opts = from_script_args(self.script_args)
        self.health = HealthHook(opts.health_cmd, opts.health_interval_s) if opts and opts.health_cmd else None
        keys = security.Keys.load(self.log_dir, self.key_dir if not self.insecure else None, self.insecure,
                                  create=(a.node_rank == 0))
        if a.node_rank == 0 and os.environ.get("MINDSPEED_HA_CONTROLLER", "rank0") == "rank0":
            info = read_controller_json(self.log_dir)
            if info and info.get("job_id") != self.job_id:
                os.unlink(os.path.join(self.log_dir, "controller.json"))  # a previous job's
        self.link = ControllerLink(keys, self.log_dir, self.job_id, self._hello, self.hb,
                                   name=f"agent {a.node_rank}")
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        log.info("agent %d/%d: %d workers of %d, master %s:%d, job %s, log dir %s", a.node_rank, a.nnodes,
                 a.nproc_per_node, self.world, a.master_addr, a.master_port, self.job_id, self.log_dir)
        # Node 0 starts the job (its rank 0 hosts the controller): only another node can be a replacement.
        restarts = 1 if a.node_rank != 0 and self._job_running() else 0
        for lr in range(a.nproc_per_node):
            self._spawn(lr, restarts)
        if restarts:
            self.link.send(self._hello())
        try:
            return self._loop()
        finally:
            for w in self.workers.values():
                self._killpg(w, signal.SIGKILL)
                try:
                    w.popen.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            self.spares.close()
            if self.health is not None:
                self.health.close()
            self.link.close()
            shutil.rmtree(self.board_dir, ignore_errors=True)
            for s, h in old.items():
                signal.signal(s, h)

    def _job_running(self, wait_s: float = 5.0) -> bool:
        """A replacement for a lost node: this job's controller is up and past its start. Then the
        workers start as restarted ones (they join the running job instead of its rendezvous)."""
        if read_controller_json(self.log_dir, self.job_id) is None:
            return False
        t = time.monotonic()
        while time.monotonic() - t < wait_s and not self.link.active:
            self.link.maintain()
            self.link.receive(50)
        running = self.link.active and self.link.state not in ("", "init", "done", "exit")
        if running:
            log.warning("agent %d: job %s is running (controller state %s): starting the workers as "
                        "replacements that join it", self.a.node_rank, self.job_id, self.link.state)
        return running

    def _loop(self) -> int:
        next_hb = 0.0
        sig_deadline = 0.0
        termed = False
        all_gone_at = 0.0
        while True:
            self.link.maintain()
            for msg in self.link.receive(20):
                if msg["t"] == "do":
                    self._on_do(msg)
            now = time.monotonic()
            if now >= next_hb and self.link.sock is not None:
                next_hb = now + self.hb
                self.link.send(P.encode("agent_hb", node_rank=self.a.node_rank, spares=self.spares.warm()))
            self._poll_workers()
            if self.exit_order is None and not self._signal:
                self.spares.maintain(now)
                for ranks, why in self.health.poll(now, self.workers) if self.health is not None else ():
                    self.events.emit("health", ranks=ranks, detail=why)
                    self.link.send(P.encode("health", node_rank=self.a.node_rank, ranks=ranks, detail=why))
            alive = [w for w in self.workers.values() if not w.reported]
            if self._signal:
                if not alive:
                    return 128 + self._signal
                sig_deadline = sig_deadline or now + 5.0
                if now > sig_deadline:
                    for w in alive:
                        self._killpg(w, signal.SIGKILL)
                continue
            if self.exit_order is not None:
                if alive and now > self.exit_deadline and not termed:
                    termed = True
                    for w in alive:
                        self._killpg(w, signal.SIGTERM)
                elif alive and now > self.exit_deadline + 2.0:
                    for w in alive:
                        self._killpg(w, signal.SIGKILL)
                if not alive:
                    text = self.exit_order.get("diagnosis") or "mindspeed-ha: the controller ended the job"
                    print(text, file=sys.stderr, flush=True)
                    return int(self.exit_order.get("code", 1)) or 0
                continue
            failed = [w for w in self.workers.values() if w.reported and (w.code or w.sig)]
            if not alive and not failed:
                return 0
            if not failed:
                continue
            # A worker failed and no order came (yet): act alone when there is no controller to wait for.
            all_gone_at = all_gone_at or (now if not alive else 0.0)
            waited = now - self.first_failure
            # Wait for the controller while it is reachable and busy with a recovery (a dump or
            # a repair can outlast the decision timeout); act alone when it is gone, ignores the
            # failure, or takes longer than any of its states may.
            busy = self.link.active and self.link.state not in ("normal", "init", "done")
            if (not self.link.ever_active or (waited > self.a.decision_timeout and not busy)
                    or waited > self.a.decision_timeout + 150.0 or (all_gone_at and now - all_gone_at > 3.0)):
                return self._act_alone(failed, alive)

    def _act_alone(self, failed, alive) -> int:
        for w in alive:
            self._killpg(w, signal.SIGTERM)
        t = time.monotonic()
        while any(w.popen.poll() is None for w in alive) and time.monotonic() - t < 2.0:
            time.sleep(0.05)
        for w in alive:
            self._killpg(w, signal.SIGKILL)
        first = failed[0]
        how = f"killed by signal {first.sig}" if first.sig else f"exit code {first.code}"
        why = ("no mindspeed-ha controller was reachable" if not self.link.ever_active
               else f"the controller gave no order within {self.a.decision_timeout:g}s")
        text = (f"mindspeed-ha agent {self.a.node_rank}: worker rank {first.rank} (pid {first.popen.pid}) "
                f"ended with {how}; {why}, so every worker of this node was stopped "
                f"(torchrun behaviour). Events: {self.log_dir}/events.")
        self.events.emit("diagnosis", text=text)
        print(text, file=sys.stderr, flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    return Agent(build_parser().parse_args(argv)).run()
