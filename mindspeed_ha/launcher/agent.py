"""``mindspeed-ha run``: a per-node launcher agent with torchrun's command line (args.py) that does
not kill the job on its own when one worker fails: it reports the exit (pid, code, signal) to the
controller at once and does what the controller decides (exit everyone, restart some workers).

Node 0's agent serves the job store at ``--master-addr:--master-port`` (torchrun's agent store: the
workers' rendezvous meets there, and it outlives every worker). Agents meet there before any worker
starts (rendezvous.py): a new job starts its workers; a node started again while the job runs
replaces the lost one, its workers started by the controller's restart order. The controller (a
thread in rank 0, the design's default) is announced in that store, so no node needs another's log
directory. A preemption signal (SIGTERM, or ``--signals-to-handle``) becomes a dying gasp and a
clean exit. Without any controller (HA off, or rank 0 died before it came up) the agent falls back
to torchrun's behaviour: one failure ends all.
"""
from __future__ import annotations

import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

from .. import exitcodes
from ..control.wire import discovery, protocol, security
from ..control.wire.announcement import read_controller_json
from ..control.wire.board import ProgressBoard
from ..control.wire.discovery import JobStore
from ..control.wire.link import RELAY_ENV, ControllerLink
from ..events import EventLog, get_logger, log_dir_from_env, setup_text_log
from ..options import JOINS_AS_ENV, HAConfigError, check_directory, check_writable, from_script_args
from . import network, rendezvous, spare
from .args import Launch, LaunchError, build_parser, resolve
from .devices import DeviceHealth
from .health import HealthHook
from .logs import WorkerLogs
from .relay import RelayHub
from .rendezvous import ranks_of

log = get_logger("launcher.agent")
TAKEOVER_WAIT_S = 30.0  # a lost controller's standby is waited for this long before the agent acts alone


def _scan(args: list[str], flag: str, has_value: bool = True):
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1] if has_value and i + 1 < len(args) else True
        if has_value and a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


class Worker:
    def __init__(self, rank: int, local_rank: int, popen):  # a Popen, or spare.Forked
        self.rank, self.local_rank, self.popen = rank, local_rank, popen
        self.reported = False
        self.code: int | None = None
        self.sig = 0
        self.restarts = 0


class Agent:
    def __init__(self, launch: Launch, env=os.environ):
        self.a = a = launch
        self.script_args = a.script_args
        self.log_dir = os.path.abspath(_scan(self.script_args, "--ha-log-dir") or log_dir_from_env())
        self.opts = from_script_args(self.script_args, env)   # None: HA off, or invalid (the workers say why)
        self.ha = self.opts is not None and self.opts.enabled
        self.insecure = bool(_scan(self.script_args, "--ha-insecure", False)) or security.is_insecure()
        kd = _scan(self.script_args, "--ha-key-dir") or env.get("MINDSPEED_HA_KEY_DIR")
        try:  # (the workers refuse them too, but this process writes its logs and reads keys first)
            check_writable(self.log_dir, "--ha-log-dir" if _scan(self.script_args, "--ha-log-dir") else "MINDSPEED_HA_LOG_DIR")
            check_directory(kd, "--ha-key-dir" if _scan(self.script_args, "--ha-key-dir") else "MINDSPEED_HA_KEY_DIR")
        except HAConfigError as e:
            raise LaunchError(str(e)) from None
        hb = _scan(self.script_args, "--ha-heartbeat-interval")
        self.hb = float(hb) if hb else 0.5
        if a.standalone:
            a.nnodes, a.node_rank, a.master_addr = 1, 0, "127.0.0.1"
            a.master_port = 0  # (the job store takes a free one: run() serves it first)
        if a.nnodes > 1 and not kd and not self.insecure:
            raise LaunchError(
                "a job of several nodes needs CurveZMQ keys that every node reads: make them once with "
                "`mindspeed-ha keygen /shared/or/secret/dir` (a Kubernetes Secret or a directory every node mounts) "
                "and pass --ha-key-dir DIR (or MINDSPEED_HA_KEY_DIR=DIR) on every node; or --ha-insecure on a "
                "trusted, isolated network")
        self.world = a.nnodes * a.nproc_per_node
        # Where the other nodes reach this one (the controller and standbys listen there, gloo and
        # NCCL advertise it): the address on the route to the master address, not what the host
        # name resolves to (often a loopback address).
        routed, self.net_env, self.net_note = network.node_network(a.master_addr, env)
        self.node_host = a.node_host or routed
        self.node = f"{socket.gethostname()}:{a.node_rank}"
        self.job_id = env.get("MINDSPEED_HA_JOB_ID") or a.job_id or (
            uuid.uuid4().hex if a.standalone or a.nnodes == 1 else f"{a.master_addr}-{a.master_port}")
        # The job's own keys; an external controller (``mindspeed-ha controller``) made its own, unnamed.
        external = discovery.controller_is_external(env)
        self.key_dir = os.path.abspath(security.key_dir_for(self.log_dir, kd, None if external else self.job_id))
        self.register_timeout = self.opts.register_timeout_s if self.opts else 300.0
        self.term_grace = self.opts.term_grace_s if self.opts else 60.0
        self.workers: dict[int, Worker] = {}
        self.exit_order: dict | None = None
        self.exit_deadline = 0.0
        self.first_failure = 0.0
        self._signal = 0
        self._preempted = 0.0        # when a preemption signal was passed on to the controller
        self._running_said = False   # our job-store record says the job has trained
        self.relay: RelayHub | None = None   # --relay: the controller's orders to our ranks pass here

    # ---- workers ------------------------------------------------------------------------------
    def _env(self, rank: int, local_rank: int, restarts: int) -> dict:
        a = self.a
        env = {**os.environ, **self.net_env}
        env.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(self.world),
                   LOCAL_WORLD_SIZE=str(a.nproc_per_node), GROUP_RANK=str(a.node_rank),
                   MASTER_ADDR=a.master_addr, MASTER_PORT=str(a.master_port),
                   # The rendezvous meets at the store this job's node 0 agent serves (torchrun's way):
                   # it outlives any worker, rank 0 included.
                   TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                   TORCHELASTIC_RUN_ID=self.job_id, MINDSPEED_HA_JOB_STORE=self._job_store(),
                   MINDSPEED_HA_LOG_DIR=self.log_dir, MINDSPEED_HA_JOB_ID=self.job_id,
                   MINDSPEED_HA_NODE=self.node, MINDSPEED_HA_NODE_HOST=self.node_host,
                   # (the rank tells the controller which agent restarts it, should this agent
                   # not have registered yet when the rank is lost)
                   MINDSPEED_HA_AGENT_NODE=str(a.node_rank), MINDSPEED_HA_AGENT_PID=str(os.getpid()),
                   MINDSPEED_HA_RESTART_COUNT=str(restarts), MINDSPEED_HA_HEARTBEAT=str(self.hb),
                   MINDSPEED_HA_PROGRESS_DIR=self.board_dir,
                   MINDSPEED_HA_TERM_SIGNALS=",".join(s.name for s in a.term_signals))
        if self.relay is not None:
            env[RELAY_ENV] = self.relay.endpoint
        if self.insecure:
            env["MINDSPEED_HA_INSECURE"] = "1"
        else:
            env["MINDSPEED_HA_KEY_DIR"] = self.key_dir
        return env

    def _job_store(self) -> str:
        """Where a worker started now finds the controller: the job store in use (it may have moved
        from --master-addr)."""
        return discovery.address_text(self.store.address)

    def _spawn(self, local_rank: int, restarts: int = 0, extra: dict[str, str] | None = None) -> Worker:
        rank = self.a.node_rank * self.a.nproc_per_node + local_rank
        out, err = self.logs.open(local_rank, restarts)
        # Own session: signals reach workers only through us, and killpg also reaches their children.
        env = {**self._env(rank, local_rank, restarts), **(extra or {})}
        p = subprocess.Popen(self.a.cmd + self.script_args, env=env, start_new_session=True, stdout=out, stderr=err)
        for f in (out, err):
            if f is not None:
                f.close()
        w = Worker(rank, local_rank, p)
        w.restarts = restarts
        self.workers[rank] = w
        self.events.emit("worker_start", worker_rank=rank, worker_pid=p.pid, restarts=restarts)
        return w

    def _start_workers(self) -> None:
        """The node's first workers: forks of the spare template where it starts them, else processes."""
        a = self.a
        local = {a.node_rank * a.nproc_per_node + lr: lr for lr in range(a.nproc_per_node)}
        forked = self.spares.start_workers({r: spare.assignment(r, lr, 0, self.logs.env(lr)) for r, lr in local.items()},
                                           self.register_timeout)
        for rank, lr in local.items():
            p = forked.get(rank)
            if p is None:
                self._spawn(lr, 0)
                continue
            for f in self.logs.open(lr, 0):  # (it writes there itself)
                if f is not None:
                    f.close()
            self.workers[rank] = Worker(rank, lr, p)
            self.events.emit("worker_start", worker_rank=rank, worker_pid=p.pid, restarts=0, forked=True)

    def _restart(self, rank: int, extra: dict[str, str]) -> None:
        """A new worker for ``rank``: a spare when one is there (its replacement is made at once),
        else a fresh process. (A replacement node's ranks had no worker here: restart 1.) ``extra``:
        variables for it alone (why it joins)."""
        old = self.workers.get(rank)
        local_rank = rank - self.a.node_rank * self.a.nproc_per_node
        restarts = old.restarts + 1 if old is not None else 1
        taken = self.spares.hand_over(spare.assignment(rank, local_rank, restarts,
                                                       {**self.logs.env(local_rank), discovery.ENV: self._job_store(),
                                                        **extra}))
        if taken is None:
            self._spawn(local_rank, restarts, extra)
            return
        for f in self.logs.open(local_rank, restarts):  # (the header line; the spare appends itself)
            if f is not None:
                f.close()
        sp, warm = taken
        nw = Worker(rank, local_rank, sp)
        nw.restarts = restarts
        self.workers[rank] = nw
        self.events.emit("worker_start", worker_rank=rank, worker_pid=sp.pid, restarts=nw.restarts, spare=True,
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
            rid = f"{os.getpid()}.exit.{w.popen.pid}"
            self.link.send(protocol.encode("exit", node_rank=self.a.node_rank, rank=w.rank, pid=w.popen.pid,
                                           code=w.code, signal=w.sig, at=at, rid=rid, **extra), rid=rid)
            if (w.code or w.sig) and not self.first_failure and self.exit_order is None:
                self.first_failure = time.monotonic()
                how = f"signal {w.sig}" if w.sig else f"exit code {w.code}"
                log.warning("worker rank %d (pid %d) ended with %s", w.rank, w.popen.pid, how)
            self._killpg(w, signal.SIGKILL)  # its own children, if any, go with it
            if self.relay is not None:
                self.relay.forget(w.rank)

    def _hello(self) -> bytes:
        ranks = ranks_of(self.a.node_rank, self.a.nproc_per_node)
        # (a replacement node's ranks have no worker until the controller orders their restart: pid 0)
        pids = [self.workers[r].popen.pid if r in self.workers else 0 for r in ranks]
        offer = {"store": self.store_offer} if self.store_offer else {}
        relay = {"relay": True, **self.relay.relayed()} if self.relay is not None else {}
        return protocol.encode("agent", node=self.node, node_rank=self.a.node_rank, nnodes=self.a.nnodes,
                               pid=os.getpid(), ranks=ranks, pids=pids, **offer, **relay)

    # ---- controller orders --------------------------------------------------------------------
    def _on_do(self, msg: dict) -> None:
        if "ranks" in msg:  # an order for some of our ranks, to pass on (--relay)
            if self.relay is not None:
                missing = self.relay.pass_on(msg)
                if missing:
                    log.warning("agent %d: order %s for rank(s) %s not connected here", self.a.node_rank,
                                msg["action"], missing)
            return
        action, args = msg["action"], msg.get("args", {})
        self.events.emit("order", action=action, args={k: v for k, v in args.items() if k != "diagnosis"})
        if action == "reconnect":  # the active controller handed over
            self.link.switch(str(args["endpoint"]))
        elif action == "exit" and self.exit_order is None:
            self.exit_order = args
            self.exit_deadline = time.monotonic() + self.a.exit_grace
        elif action == "restart":
            mine = set(ranks_of(self.a.node_rank, self.a.nproc_per_node))
            scale_out = {int(r) for r in args.get("scale_out") or ()}
            for r in args.get("ranks") or sorted(mine):
                r = int(r)
                if r not in mine:
                    continue
                w = self.workers.get(r)
                if w is not None:
                    self._killpg(w, signal.SIGKILL)
                    w.popen.wait()
                self._restart(r, {JOINS_AS_ENV: "scale-out"} if r in scale_out else {})
            self.first_failure = 0.0
            self.link.send(self._hello())

        elif action == "leave":
            # elastic: these ranks are out of the job for good; a failed one is no longer a failure
            # to wait on (the job trains on without it), and none of them is restarted.
            for r in args.get("ranks") or ():
                w = self.workers.get(int(r))
                if w is not None and w.reported:
                    w.code, w.sig = 0, 0
            if not [w for w in self.workers.values() if w.reported and (w.code or w.sig)]:
                self.first_failure = 0.0

    def _on_signal(self, signum, frame) -> None:
        """The scheduler preempts (SIGTERM, or one of --signals-to-handle): with HA on and a
        controller, the job stops and writes its dying-gasp checkpoint, then exits; a second signal,
        or no controller, ends the workers at once (torchrun's behaviour)."""
        if self.ha and self.link.active and not self._preempted and self.exit_order is None:
            self._preempted = time.monotonic()
            rid = f"{os.getpid()}.preempt"
            self.link.send(protocol.encode("preempt", node_rank=self.a.node_rank, signal=int(signum), rid=rid), rid=rid)
            return
        self._signal = signum
        for w in self.workers.values():
            self._killpg(w, signum)

    # ---- main loop ----------------------------------------------------------------------------
    def run(self) -> int:
        a = self.a
        setup_text_log(self.log_dir)
        self.events = EventLog(self.log_dir, f"agent_{a.node_rank}")
        if self.net_note:
            log.info("%s", self.net_note)
            self.events.emit("network", host=self.node_host, **self.net_env)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.board_dir = tempfile.mkdtemp(prefix="mindspeed-ha-", dir=shm)
        self.logs = WorkerLogs(a.log_dir, a.redirects, a.tee, a.local_ranks_filter, self.job_id,
                               a.nproc_per_node, a.node_rank, a.role)
        self.served = None
        self.store_offer = ""   # host:port of the store this agent serves, or stands ready to
        from ..comm.stores import serve
        if a.node_rank == 0:  # the job store: where this job's workers and agents meet
            try:
                # --standalone: the port is the one the store got, not one found free a moment before
                # it binds (another job's connections take ports meanwhile)
                self.served = serve(a.master_addr, a.master_port)
                a.master_port = a.master_port or self.served.port
            except OSError as e:
                raise LaunchError(f"node 0's agent cannot serve the job store at {a.master_addr}:{a.master_port} "
                                  f"({e.strerror or e}): run node 0 on the host --master-addr names, with a free "
                                  "--master-port") from None
            self.store_offer = f"{a.master_addr}:{a.master_port}"
        elif self.ha:  # an empty one, for the job store to move to should node 0's be lost
            try:
                self.served = serve(self.node_host, 0)
                self.store_offer = f"{self.node_host}:{self.served.port}"
            except OSError as e:
                log.warning("agent %d: cannot serve a standby job store on %s (%s): the job store cannot move here",
                            a.node_rank, self.node_host, e.strerror or e)
        self.store = JobStore((a.master_addr, a.master_port))
        try:
            return self._run()
        finally:
            self.store.close()
            self.logs.close()

    def _run(self) -> int:
        a = self.a
        if a.relay and self.ha:
            self.relay = RelayHub(a.node_rank)
        # recover: workers started ahead of time that a restart hands a lost rank to; on a CPU node the
        # same template starts the first workers (spare.py)
        self.spares = spare.Pool(spare.wanted(self.script_args), self.a.cmd + self.script_args,
                                 self._env(-1, -1, 0), self.events, f"agent {a.node_rank}",
                                 os.path.join(self.board_dir, "spares"), spare.forks_workers(self.script_args))
        # evidence of sub-healthy ranks from outside training: the user's hook and the GPUs' driver
        hook = HealthHook(self.opts.health_cmd, self.opts.health_interval_s) \
            if self.opts and self.opts.health_cmd else None
        gpus = DeviceHealth.open(a.nproc_per_node, self.opts.health_interval_s, time.monotonic()) \
            if self.opts else None
        self.health = [h for h in (hook, gpus) if h is not None]
        try:
            keys = security.Keys.load(self.log_dir, self.key_dir if not self.insecure else None, self.insecure,
                                      create=(a.nnodes == 1), timeout=5.0)
        except security.SecurityError as e:
            raise LaunchError(str(e)) from None
        if a.node_rank == 0 and not discovery.controller_is_external():
            info = read_controller_json(self.log_dir)
            if info and info.get("job_id") != self.job_id:
                os.unlink(os.path.join(self.log_dir, "controller.json"))  # a previous job's
        self.link = ControllerLink(keys, self.log_dir, self.job_id, self._hello, self.hb,
                                   name=f"agent {a.node_rank}", store=self.store)
        if self.relay is not None:
            self.link.also_poll(self.relay.sock)
        old = {s: signal.signal(s, self._on_signal) for s in set(a.term_signals) | {signal.SIGINT, signal.SIGTERM}}
        log.info("agent %d/%d: %d workers of %d, master %s:%d, job %s, log dir %s", a.node_rank, a.nnodes,
                 a.nproc_per_node, self.world, a.master_addr, a.master_port, self.job_id, self.log_dir)
        self.started = time.monotonic()
        try:
            joining = self._meet()
            if joining is None:
                return exitcodes.NOT_REGISTERED
            if not joining:
                self._start_workers()
            self.link.send(self._hello())
            return self._loop()
        finally:
            for w in self.workers.values():
                self._killpg(w, signal.SIGKILL)
                try:
                    w.popen.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            self.spares.close()
            if self.relay is not None:
                log.info("agent %d: relayed %d order(s), %d answer(s) and %d heartbeat(s)", a.node_rank,
                         self.relay.passed, self.relay.answered, self.relay.beats)
                self.relay.close()
            for h in self.health:
                h.close()
            self.link.close()
            shutil.rmtree(self.board_dir, ignore_errors=True)
            for s, handler in old.items():
                signal.signal(s, handler)

    def _meet(self) -> bool | None:
        """Meet the other agents at the job store: False for a new job (start the workers), True to
        join a running one as a lost node's replacement (its workers start when the controller
        orders their restart), None when nodes never came (the diagnosis is out)."""
        a = self.a
        record = {"pid": os.getpid(), "host": self.node_host, "node": self.node}
        try:
            found = rendezvous.meet(self.store, a.node_rank, a.nnodes, a.nproc_per_node, self.job_id, record,
                                    self.register_timeout)
        except rendezvous.NotRegistered as e:
            self._diagnose(f"mindspeed-ha agent {a.node_rank}: the job cannot start: {e}. (exit code "
                           f"{exitcodes.NOT_REGISTERED}: restart the job when every node can come up)")
            return None
        if found == "running" and self._controller_running():
            log.warning("agent %d: job %s is running: this node replaces a lost one; its workers start when the "
                        "controller restarts them", a.node_rank, self.job_id)
            self.events.emit("replacement", node_rank=a.node_rank)
            return True
        return False

    def _controller_running(self, wait_s: float = 10.0) -> bool:
        t = time.monotonic()
        while time.monotonic() - t < wait_s and not self.link.active:
            self.link.maintain()
            self.link.receive(50)
        return self.link.active and self.link.state not in ("", "init", "done", "exit")

    def _diagnose(self, text: str) -> None:
        self.events.emit("diagnosis", text=text)
        log.error("%s", text)
        print(text, file=sys.stderr, flush=True)

    def _say_running(self) -> None:
        """Once the job trains, our job-store record says so: a replacement of node 0, meeting in
        a new store, must join the running job, not start a second one."""
        if not self._running_said and self.link.active and self.link.state not in ("", "init"):
            self._running_said = True
            self.store.publish(discovery.agent_key(self.a.node_rank),
                               {"pid": os.getpid(), "host": self.node_host, "node": self.node,
                                "job_id": self.job_id, "running": True})

    def _loop(self) -> int:
        next_hb = 0.0
        acks_seen = 0   # (the controller's acks that came: each passed on to the ranks whose heartbeats we carried)
        sig_deadline = 0.0
        termed = False
        all_gone_at = 0.0
        while True:
            self.link.maintain()
            for msg in self.link.receive(20):
                if msg["t"] == "do":
                    self._on_do(msg)
                elif msg["t"] == "unheard" and self.relay is not None:
                    self.relay.pass_unheard(msg["ranks"])
            relayed: dict = {}
            now = time.monotonic()
            if self.relay is not None:
                if self.link.acks != acks_seen and self.link.last_ack is not None and self.link.endpoint:
                    acks_seen = self.link.acks
                    self.relay.pass_ack(self.link.last_ack, self.link.endpoint)
                items = self.relay.collect()
                if items:  # (what came this turn: the rest goes in the next)
                    self.link.send(self.relay.results_frame(items))
                if self.relay.changed:  # a rank connected or ended: the controller knows at once
                    self.relay.changed, next_hb = False, 0.0
                relayed = self.relay.relayed()
                if self.relay.beats_due(now) and self.link.active:  # (our heartbeat carries them)
                    relayed["beats"], next_hb = self.relay.take_beats(now), 0.0
            if now >= next_hb and self.link.sock is not None:
                # (while our ranks' heartbeats come, ours goes with them: the beats of a node come
                # together once every interval, and our own would be a second frame in it)
                next_hb = now + (1.5 * self.hb if "beats" in relayed else self.hb)
                self.link.send(protocol.encode("agent_hb", node_rank=self.a.node_rank, spares=self.spares.warm(),
                                               **relayed))
                self._say_running()
            self._poll_workers()
            if self.exit_order is None and not self._signal:
                self.spares.maintain(now)
                for ranks, why in (f for h in self.health for f in h.poll(now, self.workers)):
                    self.events.emit("health", ranks=ranks, detail=why)
                    self.link.send(protocol.encode("health", node_rank=self.a.node_rank, ranks=ranks, detail=why))
            alive = [w for w in self.workers.values() if not w.reported]
            if self._preempted and self.exit_order is None and now - self._preempted > self.term_grace + 10.0:
                log.error("agent %d: no exit order %.0f s after the preemption signal: ending the workers",
                          self.a.node_rank, now - self._preempted)
                self._signal = signal.SIGTERM
                for w in alive:
                    self._killpg(w, signal.SIGTERM)
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
            if self.ha and not self.link.ever_active and now - self.started > self.register_timeout:
                self._diagnose(f"mindspeed-ha agent {self.a.node_rank}: no mindspeed-ha controller was reachable "
                               f"within --ha-register-timeout {self.register_timeout:g} s (it is announced in the "
                               f"job store at {self.a.master_addr}:{self.a.master_port} once rank 0 has built its "
                               f"model): HA would be off, so the job ends. Events: {self.log_dir}/events.")
                for w in alive:
                    self._killpg(w, signal.SIGKILL)
                return exitcodes.NOT_REGISTERED
            failed = [w for w in self.workers.values() if w.reported and (w.code or w.sig)]
            if not alive and not failed and self.workers:
                return 0
            if not failed:
                continue
            # A worker failed and no order came (yet): act alone when there is no controller to wait for.
            all_gone_at = all_gone_at or (now if not alive else 0.0)
            waited = now - self.first_failure
            # Wait for the controller while it is reachable and busy with a recovery (a dump or
            # a repair can outlast the decision timeout); act alone when it is gone, ignores the
            # failure, or takes longer than any of its states may.
            busy = self.link.recovering
            # The controller is gone and the links move to a standby, which takes the recovery over:
            # wait for it too (a controller whose own rank hung ends itself for a standby).
            succession = (self.link.ever_active and not self.link.active
                          and now - self.link.active_at < TAKEOVER_WAIT_S)
            # (an HA job's agent that has not reached the controller yet waits for it as for an
            # order — a rank lost right after the job started is the controller's to recover: the
            # exit report goes there once the link connects)
            if ((not self.link.ever_active and not self.ha)
                    or (waited > self.a.decision_timeout and not busy and not succession)
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
        unheard = time.monotonic() - self.link.active_at
        if not self.link.ever_active:
            why = "no mindspeed-ha controller was reachable"
        elif not self.link.active and unheard > self.a.decision_timeout:
            why = (f"no controller has answered this node for {unheard:.0f}s: it is cut off from the job (a "
                   "partition, or the controller's side is gone), which goes on without it on the side that "
                   "reaches the job store, or ended there")
        else:
            why = f"the controller gave no order within {self.a.decision_timeout:g}s"
        self._diagnose(f"mindspeed-ha agent {self.a.node_rank}: worker rank {first.rank} (pid {first.popen.pid}) "
                       f"ended with {how}; {why}, so every worker of this node was stopped "
                       f"(torchrun behaviour). Events: {self.log_dir}/events.")
        # (a flag refused by the workers before any model: the job's code is theirs, 2, not a fault's)
        return first.code if not first.sig and first.code in exitcodes.JOB_WIDE else exitcodes.FAULT


def main(argv: list[str] | None = None) -> int:
    try:
        agent = Agent(resolve(build_parser().parse_args(argv)))
        return agent.run()
    except LaunchError as e:
        print(f"mindspeed-ha run: {e}", file=sys.stderr)
        return exitcodes.BAD_INPUT
