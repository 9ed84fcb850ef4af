"""Where a job's controller is, without a shared file system: the job's store.

The job store is the TCPStore at the job's ``--master-addr:--master-port``, served by node 0's
launcher agent (as torchrun's agent serves its rendezvous store; the workers' own rendezvous meets
there too). It holds, under ``mindspeed_ha/``:

    controller          the active controller's record: endpoint, epoch, standbys' endpoints, rank,
                        job id, public key (JSON)
    agent/<node rank>   each launcher agent: pid, host, and whether it has seen the job train
    beat/<epoch>        a counter the active controller of that epoch counts up every round: a
                        standby that reaches the store and sees it stand still knows the controller
                        has lost the store (its process, its node, or its network)
    takeover/<epoch>    the standby that may start that epoch with exactly half of the world: the
                        first to claim it (compare-and-set), so that two standbys that each hear
                        from half the ranks cannot both take over

Publishers re-write their records whenever the store lacks them (a replacement of node 0 serves a
new, empty store) and a controller never writes over a newer epoch's record.

The store moves when it is lost while the job runs (node 0's agent died, or node 0 is cut off from
a majority): every other agent stands ready with an empty store of its own, and the controller
picks one (``Succession.keep_store``) and names it in every answer it sends (``ack``'s ``store``);
each process's ``JobStore`` then ``move``s there. Records published keep going to the job's first
store too (``--master-addr``, the *home* store), whenever it answers: a replacement of node 0, which
knows nothing but that address, finds the running job there. All store traffic
runs on one background thread per process (``JobStore``), so a store that is down or slow never
blocks a heartbeat or the controller's loop: readers get the newest record that thread has seen.

Two other sources stay: ``DIR/controller.json`` (a shared or single-node log dir) and
``MS_TFT_IP`` / ``MS_TFT_PORT`` (MindSpore's names for where an external controller listens). The
control plane itself needs no torch; without it there is no store client and those two remain.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

from ...events import get_logger

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore

log = get_logger("control.discovery")
ENV = "MINDSPEED_HA_JOB_STORE"      # host:port of the job store, set by mindspeed-ha run for its workers
CONTROLLER_KEY = "mindspeed_ha/controller"
PERIOD_S = 0.5
# A home store that is gone (node 0's agent lost) is retried every 5 s at most: a replacement node 0
# serving it again finds the other agents' records there within that.
MIRROR_RETRY_MAX_S = 5.0


def agent_key(node_rank: int) -> str:
    return f"mindspeed_ha/agent/{int(node_rank)}"


def beat_key(epoch: int) -> str:
    return f"mindspeed_ha/beat/{int(epoch)}"


def takeover_key(epoch: int) -> str:
    return f"mindspeed_ha/takeover/{int(epoch)}"


def store_address(env: Mapping[str, str] = os.environ) -> tuple[str, int] | None:
    """The job store of this process: ``MINDSPEED_HA_JOB_STORE``, else torchrun's agent store
    (``MASTER_ADDR:MASTER_PORT`` when the workers use it), else none."""
    text = env.get(ENV, "")
    if not text and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR"):
        text = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
    return parse_address(text)


def parse_address(text: str) -> tuple[str, int] | None:
    """``host:port`` as (host, port); None for anything else."""
    host, _, port = text.rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def address_text(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"


def controller_is_external(env: Mapping[str, str] = os.environ) -> bool:
    """The job's controller runs as its own process (``mindspeed-ha controller``), not in rank 0:
    ``MINDSPEED_HA_CONTROLLER=external``, or MindSpore's ``MS_TFT_IP`` naming where it listens."""
    return env.get("MINDSPEED_HA_CONTROLLER", "rank0") != "rank0" or bool(env.get("MS_TFT_IP"))


def external_controller(env: Mapping[str, str] = os.environ) -> str | None:
    """``MS_TFT_IP`` / ``MS_TFT_PORT``: an external controller (``mindspeed-ha controller``) listens there."""
    ip, port = env.get("MS_TFT_IP"), env.get("MS_TFT_PORT")
    return f"tcp://{ip}:{int(port)}" if ip and port and port.isdigit() else None


class JobStore:
    """This process's view of the job store: records it publishes (kept there) and records it
    watches (their newest values), both maintained on one daemon thread."""

    def __init__(self, address: tuple[str, int], period_s: float = PERIOD_S, connect_timeout_s: float = 2.0,
                 publish_only: bool = False):
        """``publish_only``: the home store while the job's is elsewhere (``move``): records are
        written there, nothing is read, and a home store that is gone is retried less and less often
        (each failed attempt of a TCPStore client prints C++ errors of its own)."""
        self.address = self.home = address
        self._mirror: JobStore | None = None     # the home store, written to while the store is elsewhere
        self._publish_only = publish_only
        self.moves = 0                           # times the job store moved (0: it is at home)
        self.period_s, self.connect_timeout_s = period_s, connect_timeout_s
        self._lock = threading.Lock()
        self._own: dict[str, tuple[dict[str, Any], int | None]] = {}   # key -> (record, epoch or None)
        self._seen: dict[str, dict[str, Any]] = {}                      # key -> newest record read
        self._watch: set[str] = set()
        self._beats: set[str] = set()                                    # counters counted up each round
        self._counters: dict[str, tuple[int, float, float]] = {}  # counter -> (value, when it moved, last read)
        self._claims: dict[str, tuple[str, str | None]] = {}     # key -> (our claim, the winner's, once read)
        self.reachable = False
        self.ever_reached = False
        self.answered_at = 0.0       # (monotonic) the end of the last round the store answered in full
        self.refused = False         # since then, its host refused the connection: up, with no store
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._gen = 0        # the thread of this number talks to the store in use; a move starts another
        self._thread = self._start_thread()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "JobStore | None":
        addr = store_address(env)
        if addr is None:
            return None
        try:
            import torch.distributed  # noqa: F401
        except ImportError:  # a controller on a head node without torch: the other sources remain
            return None
        return cls(addr)

    # ---- what callers use ---------------------------------------------------------------------
    def publish(self, key: str, record: dict[str, Any], epoch: int | None = None) -> None:
        """Keep ``record`` under ``key`` (``epoch``: never over a record of a newer epoch)."""
        with self._lock:
            self._own[key] = (dict(record), epoch)
            mirror = self._mirror
        if mirror is not None:
            mirror.publish(key, record, epoch)
        self._wake.set()

    def withdraw(self, key: str) -> None:
        with self._lock:
            self._own.pop(key, None)
            mirror = self._mirror
        if mirror is not None:
            mirror.withdraw(key)

    def move(self, address: tuple[str, int]) -> bool:
        """Use the job store at ``address`` from now on (the controller moved it there); True if it
        is news. What this process publishes is written there, and to the home store as well."""
        address = (str(address[0]), int(address[1]))
        with self._lock:
            if address == self.address:
                return False
            log.warning("the job store moved from %s:%d to %s:%d", *self.address, *address)
            self.address = address
            self._gen += 1
            self.moves += 1
            self._counters = {k: (-1, 0.0, 0.0) for k in self._counters}  # (another store's counters)
            self.reachable, self.refused = False, False
            if address != self.home and self._mirror is None:
                self._mirror = JobStore(self.home, self.period_s, self.connect_timeout_s, publish_only=True)
                for key, (record, epoch) in self._own.items():
                    self._mirror.publish(key, record, epoch)
            # (a new thread: the old one may hang in a call to a store cut off, which returns only
            # when the link heals; it ends at its next turn, and what it read then is dropped)
            self._thread = self._start_thread()
        self._wake.set()
        return True

    def watch(self, *keys: str) -> None:
        with self._lock:
            self._watch.update(keys)
        self._wake.set()

    def beat(self, key: str) -> None:
        """Count the counter ``key`` up every round from now on, while the store answers."""
        with self._lock:
            self._beats.add(key)
        self._wake.set()

    def still_for(self, key: str) -> float:
        """Seconds the counter ``key`` stood still between reads of an unbroken run of them: 0.0
        before its first read and after the store failed to answer (a process that cannot see the
        store cannot tell a silent counter from a lost view of it; one whose read hangs learns no
        more until it answers)."""
        with self._lock:
            if key not in self._counters:
                self._counters[key] = (-1, 0.0, 0.0)  # (asked for: read from the next round on)
            _, moved, read = self._counters[key]
        return read - moved

    def claim(self, key: str, value: str) -> bool | None:
        """Claim ``key`` for ``value``, first come first served: True once the store says it is ours,
        False once it is another's, None until the store has answered (the claim is made then)."""
        with self._lock:
            mine, winner = self._claims.setdefault(key, (value, None))
        if winner is None:
            self._wake.set()
            return None
        return winner == mine

    def seen(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            return self._seen.get(key)

    def refresh(self, timeout: float = 2.0) -> None:
        """Wait until the thread has read the watched keys once more (at most ``timeout``)."""
        with self._lock:
            before = self._rounds
        self._wake.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._rounds > before + 1:
                    return
            time.sleep(0.02)

    def close(self) -> None:
        """Stop the thread and wait for it: a process must not exit while the thread is inside
        TCPStore's connect to a store that is gone (C++ would terminate the process). A connect
        retries once within its timeout, so two timeouts and a margin bound the wait."""
        self._stop.set()
        self._wake.set()
        if self._mirror is not None:
            self._mirror.close()
        self._thread.join(3 * self.connect_timeout_s + 1.0)

    # ---- the thread -----------------------------------------------------------------------------
    _rounds = 0

    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(self._gen,), name="mindspeed-ha-job-store", daemon=True)
        thread.start()
        return thread

    def _connect(self) -> TCPStore:
        import torch.distributed as dist
        with self._lock:
            host, port = self.address
        return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=self.connect_timeout_s),
                             wait_for_workers=False)

    def _run(self, gen: int) -> None:
        client: TCPStore | None = None
        failed = 0  # rounds failed in a row
        while not self._stop.is_set() and self._gen == gen:
            try:
                if client is None:
                    client = self._connect()
                self._round(client, gen)
                failed = 0
                if self._gen == gen:  # (else what it tells is about the store it left)
                    self.answered_at, self.refused = time.monotonic(), False
                    if not self.reachable:
                        log.debug("job store %s:%d reached", *self.address)
                    self.reachable = self.ever_reached = True
            except Exception as e:  # down, restarting, or not yet up: try again next period
                client, failed = None, failed + 1
                if self._gen == gen:
                    if self.reachable:
                        log.warning("job store %s:%d unreachable (%s); retrying", *self.address, str(e)[:120])
                    self.reachable = False
                    refused = _refuses(self.address)
                    with self._lock:
                        self.refused = refused and self._gen == gen
                        self._counters = {k: (-1, 0.0, 0.0) for k in self._counters}
            with self._lock:
                self._rounds += 1
            if self._publish_only and failed:  # (a new record waits for the next attempt: wakes are not heeded)
                self._stop.wait(min(MIRROR_RETRY_MAX_S, self.period_s * 2 ** failed))
                continue
            self._wake.wait(self.period_s)
            self._wake.clear()

    def _round(self, store: Store, gen: int) -> None:
        with self._lock:
            own, watch, beats, counters = dict(self._own), set(self._watch), set(self._beats), dict(self._counters)
            claims = {k: mine for k, (mine, winner) in self._claims.items() if winner is None}
        if self._publish_only:  # (the home store, while the job's is elsewhere: records only)
            watch, beats, counters, claims = set(), set(), {}, {}
        for key, mine in claims.items():
            # (the value is set only where the key is new: whoever set it first has it)
            winner = store.compare_set(key, "", mine)
            with self._lock:
                if self._gen != gen:
                    return
                self._claims[key] = (mine, winner.decode() if isinstance(winner, bytes) else str(winner))
        for key, (record, epoch) in own.items():
            self._keep(store, key, record, epoch)
        for key in beats:
            store.add(key, 1)
        for key, (last, moved, _) in counters.items():
            count = store.add(key, 0)
            now = time.monotonic()
            with self._lock:
                if self._gen != gen:  # (read in the store it left)
                    break
                self._counters[key] = (count, now, now) if count != last else (last, moved, now)
        for key in watch:
            value = _read(store, key)
            with self._lock:
                if value is None:
                    self._seen.pop(key, None)
                else:
                    self._seen[key] = value

    @staticmethod
    def _keep(store: Store, key: str, record: dict[str, Any], epoch: int | None) -> None:
        data = json.dumps(record, sort_keys=True).encode()
        current = store.get(key) if store.check([key]) else b""
        if current == data:
            return
        if epoch is not None and current:
            try:
                if int(json.loads(current).get("epoch", 0)) > epoch:
                    return  # a newer controller took over: its record stands
            except ValueError:
                pass
        # (torch's stub types the values str; the binding's std::string takes these bytes as they are)
        store.compare_set(key, current, data)  # type: ignore[arg-type]  # lost a race with another writer: the next round looks again


def _refuses(address: tuple[str, int]) -> bool:
    """The store's host answers, refusing the connection: the store is gone, not out of reach (a
    cut link or a dead host stays silent instead, and the two cannot be told apart)."""
    try:
        socket.create_connection(address, timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False  # (it accepts again: the next round will tell)


def _read(store: Store, key: str) -> dict[str, Any] | None:
    if not store.check([key]):
        return None
    try:
        value = json.loads(store.get(key))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
