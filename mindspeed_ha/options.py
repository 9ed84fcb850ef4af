"""HA switches: one options object from command-line flags, ``HIGH_AVAILABILITY`` and MindIO aliases.

Precedence: ``HIGH_AVAILABILITY`` (comma list) > ``MS_ENABLE_TFT`` > flags. Strategies are tried in
the order retry -> recover -> elastic-training -> dump; dump (the dying-gasp checkpoint) is always on when HA is on.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from typing import Mapping, overload

STRATEGIES = ("dump", "retry", "recover", "elastic-training")
PREFERENCE = ("retry", "recover", "elastic-training", "dump")  # the controller tries them in this order

# What each strategy needs before this build can honour it. A strategy listed here is refused with
# this message instead of being silently ignored.
NOT_BUILT: dict[str, str] = {}

_FLAG_TO_STRATEGY = {
    "enable_high_availability": "dump",
    "enable_hbmfault_repair": "retry",
    "enable_worker_reboot": "recover",
    "enable_elastic_training": "elastic-training",
}
_TFT_ALIAS = {"TTP": "dump", "UCE": "retry", "ARF": "recover"}
WARM_UP_HANG_S = 30.0  # the least a process's first steps get before they count as hung (control.policy.ranks)
# A process's first steps allocate, connect and warm up: they count neither toward a hang (see
# WARM_UP_HANG_S) nor as a measure of its speed. The rank and the controller both need the number.
WARM_UP_STEPS = 3


class HAConfigError(ValueError):
    """A configuration the user must change; the message names the flags and proposes a fix."""


# Drills on the state layouts of the optimizers megatron-core takes on a GPU (replica.drill_optimizers):
# Transformer Engine's FusedAdam (the step count per param group), and with master params and scales.
DRILL_OPTIMIZER_ENV = "MINDSPEED_HA_DRILL_OPTIMIZER"
# Why an agent starts a worker into a running job: "scale-out" (a newcomer, which then builds itself
# before it registers: rank.session.build_ahead); unset for a recovery's restart.
JOINS_AS_ENV = "MINDSPEED_HA_JOINS_AS"
DRILL_OPTIMIZERS = ("fused-adam", "fused-adam-master")


def drill_optimizer(env: Mapping[str, str] | None = None) -> str | None:
    """The drill optimizer a job asks for (None: megatron-core's own choice); refused when unknown."""
    env = os.environ if env is None else env
    value = env.get(DRILL_OPTIMIZER_ENV, "").strip().lower()
    if value and value not in DRILL_OPTIMIZERS:
        raise HAConfigError(f"{DRILL_OPTIMIZER_ENV}={value!r} is not a drill optimizer; use one of "
                            f"{', '.join(DRILL_OPTIMIZERS)}, or unset it for megatron-core's own")
    return value or None


@dataclasses.dataclass(frozen=True)
class HAOptions:
    strategies: frozenset[str] = frozenset()
    replica: bool = True           # False with --distributed-optimizer-no-replica
    replica_num: int = 2
    verify_replicas_interval: int = 0
    log_dir: str = "./logs"
    key_dir: str | None = None
    insecure: bool = False
    heartbeat_s: float = 0.5
    hang_timeout_s: float = 60.0
    order_timeout_s: float | None = None  # None: from the hang timeout (``orders_wait_s``)
    collective_timeout_s: float = 600.0  # --distributed-timeout-minutes: every group's, rebuilt ones too
    dump_timeout_s: float | None = None  # None: from the state's size
    recovery_message_mib: int = 64  # a repair's, a reshard's and the dump resync's largest message
    spares: int = 1                # recover: pre-started workers each agent keeps ready
    straggler_ratio: float = 1.3   # a rank whose own step work is this many times the others' median...
    straggler_steps: int = 5       # ...for this many steps in a row is a straggler
    migrate_stragglers: bool = False
    health_cmd: str | None = None  # run by each launcher agent; a non-zero exit or a named rank: sub-healthy
    health_interval_s: float = 30.0
    register_timeout_s: float = 300.0  # every node and rank must have come up by then
    term_grace_s: float = 60.0     # preemption: the dying gasp must be written within this
    max_restarts: int = 5          # recover: restarts per rank, and replacements per node
    max_recurrences: int = 2       # recoveries of the same fault at the same iteration (1 for a software error)
    desync_after_s: float = 5.0    # every rank waiting this long in collectives: their counts say if it is a desync
    spare_wait_s: float = 30.0     # recover + elastic: how long a lost node's replacement is waited for
    metrics_port: int | None = None  # the active controller serves Prometheus metrics here
    # where the strategies came from: flags | HIGH_AVAILABILITY | MS_ENABLE_TFT | ranks (a controller
    # of its own process: the ranks' registrations say them)
    source: str = "flags"

    @property
    def enabled(self) -> bool:
        return bool(self.strategies)

    @property
    def use_replica_optimizer(self) -> bool:
        return self.enabled and self.replica

    def orders_wait_s(self, joining: bool = False) -> float:
        """How long a rank out of training (after a fault; ``joining``: a restarted worker) waits for the
        controller's next order while no recovery is under way: --ha-order-timeout, else three hang
        timeouts, at least 30 s (a restarted worker: 120 s, its set-up included)."""
        if self.order_timeout_s is not None:
            return self.order_timeout_s
        return max(120.0 if joining else 30.0, 3 * self.hang_timeout_s)

    def ordered_strategies(self) -> list[str]:
        return [s for s in PREFERENCE if s in self.strategies]


def add_ha_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("mindspeed-ha (high availability)")
    g.add_argument("--enable-high-availability", action="store_true",
                   help="Replica optimizer; after any fault the dump: the survivors write a dying-gasp checkpoint (MindIO: TTP)")
    g.add_argument("--enable-hbmfault-repair", action="store_true",
                   help="retry: repair memory errors (Ascend UCE) and communication faults in place (MindIO: UCE)")
    g.add_argument("--enable-worker-reboot", action="store_true",
                   help="recover: restart only the failed process or node (MindIO: ARF)")
    g.add_argument("--enable-elastic-training", action="store_true",
                   help="Scale data parallelism in when no spare exists, out when it returns")
    g.add_argument("--distributed-optimizer-no-replica", action="store_true",
                   help="Keep the plain distributed optimizer; recovery reloads the periodic checkpoint")
    g.add_argument("--optimizer-replica-num", type=int, default=2,
                   help="Copies of every optimizer shard (default 2)")
    g.add_argument("--ha-verify-replicas-interval", type=int, default=0,
                   help="Every N iterations replica peers compare shard fingerprints (0 = off)")
    g.add_argument("--ha-log-dir", default=None,
                   help="Logs and events directory (env MINDSPEED_HA_LOG_DIR, default ./logs)")
    g.add_argument("--ha-key-dir", default=None, help="CurveZMQ keys (default DIR/keys, made per job)")
    g.add_argument("--ha-insecure", action="store_true", help="Turn CurveZMQ off (not recommended)")
    g.add_argument("--ha-heartbeat-interval", type=float, default=0.5, help="Seconds between heartbeats")
    g.add_argument("--ha-recovery-message-mib", type=int, default=64,
                   help="Largest message (MiB) a repair, an elastic reshard or the dump's weight resync sends: "
                        "the memory each holds beside the state it moves (default 64)")
    g.add_argument("--ha-hang-timeout", type=float, default=60.0,
                   help="Seconds without progress before a live rank is declared hung")
    g.add_argument("--ha-desync-after", type=float, default=None, metavar="SECONDS",
                   help="Seconds every rank may wait in its collectives before their counts of the collectives they "
                        "issued are compared: members of one group in collectives that cannot match are a desync, "
                        "named and recovered as a hang well before --ha-hang-timeout (0: off; default 5, or half "
                        "the hang timeout if that is shorter)")
    g.add_argument("--ha-order-timeout", type=float, default=None,
                   help="Seconds a rank that left training for a recovery waits for the controller's next "
                        "order while no recovery is under way, before it gives up (default: 3 x "
                        "--ha-hang-timeout, at least 30; a restarted worker waits at least 120)")
    g.add_argument("--ha-spares", type=int, default=1,
                   help="recover: pre-started workers each launcher agent keeps ready to take a lost rank "
                        "(default 1; 0 starts a fresh process per restart)")
    g.add_argument("--ha-straggler-ratio", type=float, default=1.3,
                   help="A rank whose own step work (its step time less its waits for peers) is this many "
                        "times the other ranks' median is slow (default 1.3)")
    g.add_argument("--ha-straggler-steps", type=int, default=5,
                   help="Slow for this many steps in a row: a straggler (a 'straggler' event; default 5)")
    g.add_argument("--ha-migrate-stragglers", action="store_true",
                   help="Move a straggler to a spare worker at a step boundary (needs --enable-worker-reboot)")
    g.add_argument("--ha-health-cmd", default=None,
                   help="A command each launcher agent runs every --ha-health-interval seconds: a non-zero exit "
                        "makes the node's ranks sub-healthy, a line 'sub-healthy LOCAL_RANK [why]' one of them "
                        "(a 'sub_healthy' event; moved to a spare with --ha-migrate-stragglers)")
    g.add_argument("--ha-health-interval", type=float, default=30.0,
                   help="Seconds between runs of --ha-health-cmd (default 30)")
    g.add_argument("--no-verify-checkpoint", action="store_true",
                   help="--load reads a checkpoint without checking its files against their checksums "
                        "(for huge checkpoints; settings are still checked)")
    g.add_argument("--ha-register-timeout", type=float, default=300.0,
                   help="Seconds every node's agent and every rank have to come up; then the job ends with "
                        "a diagnosis naming the missing ones (default 300)")
    g.add_argument("--ha-term-grace", type=float, default=60.0,
                   help="Preemption (SIGTERM, or a signal of mindspeed-ha run's --signals-to-handle): seconds "
                        "the dying-gasp checkpoint may take before every process is killed (default 60)")
    g.add_argument("--ha-max-restarts", type=int, default=5,
                   help="recover: restarts of one rank, and replacements of one node, before the next strategy "
                        "(the dump) takes over and the job ends with exit code 3, do not restart (default 5)")
    g.add_argument("--ha-max-recurrences", type=int, default=2, metavar="N",
                   help="Recoveries of the same fault (same ranks, kind and error) at the same iteration before it is "
                        "taken for a bug of the job and the job ends (the dump with --save, then exit code 3, do not "
                        "restart) with a diagnosis naming it; an error of the job's own code (ValueError, "
                        "ImportError, ...) is recovered once at most (default 2)")
    g.add_argument("--ha-spare-wait", type=float, default=30.0, metavar="SECONDS",
                   help="recover with elastic training: seconds a lost node's replacement is waited for before "
                        "the job scales in without it (0: scale in at once; default 30)")
    g.add_argument("--ha-metrics-port", type=int, default=None,
                   help="The active controller serves Prometheus metrics on http://HOST:PORT/metrics")
    g.add_argument("--ha-dump-timeout", type=float, default=None,
                   help="Seconds the dump may take (default: 120, more for a large state; extended while "
                        "the writers make progress)")
    return parser


def _parse_list(value: str, var: str) -> set[str]:
    items = {v.strip().lower() for v in value.split(",") if v.strip()}
    bad = sorted(items - set(STRATEGIES))
    if bad:
        raise HAConfigError(
            f"{var}={value!r}: unknown value(s) {', '.join(map(repr, bad))}; "
            f"use a comma list of {', '.join(STRATEGIES)} (e.g. {var}=retry,recover)")
    return items


def _parse_tft(value: str) -> set[str]:
    body = value.strip().strip("{}")
    if not body.strip():
        raise HAConfigError(f"MS_ENABLE_TFT={value!r} names no feature; expected e.g. "
                            "MS_ENABLE_TFT=\"{TTP:1,UCE:1,ARF:1}\" (keys TTP, UCE, ARF, values 0/1), or unset it")
    out = set()
    for part in filter(None, (p.strip() for p in body.split(","))):
        m = re.fullmatch(r"([A-Za-z]+)\s*:\s*([01])", part)
        if not m or m.group(1).upper() not in _TFT_ALIAS:
            raise HAConfigError(
                f"MS_ENABLE_TFT={value!r}: cannot read {part!r}; expected e.g. "
                "MS_ENABLE_TFT=\"{TTP:1,UCE:1,ARF:1}\" with keys TTP, UCE, ARF and values 0/1")
        if m.group(2) == "1":
            out.add(_TFT_ALIAS[m.group(1).upper()])
    return out


@overload
def _seconds(args, name: str, default: float) -> float: ...


@overload
def _seconds(args, name: str, default: None) -> float | None: ...


def _seconds(args, name: str, default: float | None) -> float | None:
    """A time flag: a finite number of seconds above zero (None: not given, where that is allowed)."""
    value = getattr(args, name, default)
    if value is None:
        return default
    flag = "--" + name.replace("_", "-")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise HAConfigError(f"{flag} {value!r}: give a number of seconds, e.g. {flag} {default or 60}") from None
    if not math.isfinite(value) or value <= 0:
        raise HAConfigError(f"{flag} {value}: give a finite number of seconds above 0 (default {default})")
    return value


def from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> HAOptions:
    env = os.environ if env is None else env
    if "HIGH_AVAILABILITY" in env:  # set, even to nothing: it decides (an empty value is a mistake)
        strategies, source = _parse_list(env["HIGH_AVAILABILITY"], "HIGH_AVAILABILITY"), "HIGH_AVAILABILITY"
        if not strategies:
            raise HAConfigError(
                f"HIGH_AVAILABILITY={env['HIGH_AVAILABILITY']!r} names no strategy; set it to a comma list of "
                f"{', '.join(STRATEGIES)} (e.g. HIGH_AVAILABILITY=retry,recover) or unset it")
    elif "MS_ENABLE_TFT" in env:
        strategies, source = _parse_tft(env["MS_ENABLE_TFT"]), "MS_ENABLE_TFT"
    else:
        strategies = {s for flag, s in _FLAG_TO_STRATEGY.items() if getattr(args, flag, False)}
        source = "flags"
    if strategies:
        strategies.add("dump")  # the last resort under every other strategy
    for s in sorted(strategies):
        if s in NOT_BUILT:
            raise HAConfigError(
                f"{NOT_BUILT[s]}. Today mindspeed-ha supports --enable-high-availability "
                "(HIGH_AVAILABILITY=dump), --enable-hbmfault-repair (retry) and --enable-worker-reboot "
                "(recover); drop the other switch.")
    no_replica = bool(getattr(args, "distributed_optimizer_no_replica", False))
    replica_num = int(getattr(args, "optimizer_replica_num", 2))
    interval = int(getattr(args, "ha_verify_replicas_interval", 0))
    if no_replica and "elastic-training" in strategies:
        raise HAConfigError("--enable-elastic-training moves optimizer shards from their twins, which "
                            "--distributed-optimizer-no-replica turns off; drop one of the two")
    if no_replica and not strategies:
        raise HAConfigError("--distributed-optimizer-no-replica only has a meaning with high availability "
                            "on; add --enable-high-availability (or HIGH_AVAILABILITY=dump) or drop it")
    if replica_num < 2:
        raise HAConfigError(f"--optimizer-replica-num {replica_num}: needs at least 2 copies of every "
                            "shard; use --optimizer-replica-num 2 (the default)")
    spares = int(getattr(args, "ha_spares", 1))
    if spares < 0:
        raise HAConfigError(f"--ha-spares {spares}: use 0 (no spare: a restart starts a fresh process) or a "
                            "positive N (default 1)")
    spare_wait = getattr(args, "ha_spare_wait", 30.0)
    if not (isinstance(spare_wait, (int, float)) and 0 <= spare_wait < float("inf")):
        raise HAConfigError(f"--ha-spare-wait {spare_wait}: give the seconds to wait for a lost node's replacement "
                            "before scaling in, 0 or more (0: at once)")
    max_restarts = int(getattr(args, "ha_max_restarts", 5))
    if max_restarts < 0:
        raise HAConfigError(f"--ha-max-restarts {max_restarts}: use 0 (never restart a worker) or a positive N "
                            "(default 5)")
    max_recurrences = int(getattr(args, "ha_max_recurrences", 2))
    if max_recurrences < 1:
        raise HAConfigError(f"--ha-max-recurrences {max_recurrences}: give how often the same fault at the same "
                            "iteration is recovered before the job ends, 1 or more (default 2)")
    metrics_port = getattr(args, "ha_metrics_port", None)
    if metrics_port is not None and not 0 < int(metrics_port) < 65536:
        raise HAConfigError(f"--ha-metrics-port {metrics_port}: give a TCP port between 1 and 65535, e.g. 9400")
    if interval < 0:
        raise HAConfigError(f"--ha-verify-replicas-interval {interval}: use 0 (off) or a positive N")
    ratio, steps = getattr(args, "ha_straggler_ratio", 1.3), int(getattr(args, "ha_straggler_steps", 5))
    if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio > 1):
        raise HAConfigError(f"--ha-straggler-ratio {ratio}: give a number above 1 (default 1.3)")
    if steps < 1:
        raise HAConfigError(f"--ha-straggler-steps {steps}: give a positive number of steps (default 5)")
    migrate = bool(getattr(args, "ha_migrate_stragglers", False))
    if migrate and "recover" not in strategies:
        raise HAConfigError("--ha-migrate-stragglers moves a rank to a spare worker, which the recover strategy "
                            "provides: add --enable-worker-reboot (or HIGH_AVAILABILITY=...,recover) or drop it")
    if interval and (not strategies or no_replica):
        raise HAConfigError("--ha-verify-replicas-interval compares replica shards and needs the replica "
                            "optimizer: add --enable-high-availability and drop "
                            "--distributed-optimizer-no-replica, or set the interval to 0")
    drill_optimizer(env)
    message_mib = getattr(args, "ha_recovery_message_mib", 64)
    if not isinstance(message_mib, int) or not 1 <= message_mib <= 1 << 14:
        raise HAConfigError(f"--ha-recovery-message-mib {message_mib}: give a whole number of MiB from 1 to 16384 "
                            "(default 64; smaller holds less memory beside a moved shard, larger sends fewer messages)")
    hang = _seconds(args, "ha_hang_timeout", 60.0)
    desync = getattr(args, "ha_desync_after", None)
    desync = min(5.0, hang / 2) if desync is None else desync
    if not (isinstance(desync, (int, float)) and 0 <= desync < hang):
        raise HAConfigError(f"--ha-desync-after {desync}: give the seconds every rank may wait in its collectives "
                            f"before a desync is looked for, from 0 (off) to below --ha-hang-timeout {hang:g} "
                            "(default 5)")
    collective = 60.0 * float(getattr(args, "distributed_timeout_minutes", None) or 10)
    if strategies and 2 * max(hang, WARM_UP_HANG_S) >= collective:
        # The controller names a hang after up to twice its limit (every rank still: a host stall
        # more often than a hang), a process's first steps after at least WARM_UP_HANG_S. NCCL's
        # watchdog must not act first: a timed-out collective there aborts the communicator.
        lower = (f" or lower --ha-hang-timeout below {collective / 2:g}" if 2 * WARM_UP_HANG_S < collective else "")
        raise HAConfigError(
            f"--ha-hang-timeout {hang:g} s: the controller may take up to {2 * max(hang, WARM_UP_HANG_S):g} s to name "
            f"a hang, and the collectives time out after {collective:g} s (--distributed-timeout-minutes "
            f"{collective / 60:g}), before it; raise --distributed-timeout-minutes to at least "
            f"{math.floor(2 * max(hang, WARM_UP_HANG_S) / 60) + 1}{lower}")
    return HAOptions(
        strategies=frozenset(strategies), replica=not no_replica, replica_num=replica_num,
        verify_replicas_interval=interval,
        log_dir=getattr(args, "ha_log_dir", None) or env.get("MINDSPEED_HA_LOG_DIR") or "./logs",
        key_dir=getattr(args, "ha_key_dir", None), insecure=bool(getattr(args, "ha_insecure", False)),
        heartbeat_s=_seconds(args, "ha_heartbeat_interval", 0.5), hang_timeout_s=hang,
        order_timeout_s=_seconds(args, "ha_order_timeout", None), collective_timeout_s=collective,
        dump_timeout_s=_seconds(args, "ha_dump_timeout", None), recovery_message_mib=message_mib,
        spares=spares, source=source,
        straggler_ratio=float(ratio), straggler_steps=steps, migrate_stragglers=migrate,
        health_cmd=getattr(args, "ha_health_cmd", None) or None,
        health_interval_s=_seconds(args, "ha_health_interval", 30.0),
        register_timeout_s=_seconds(args, "ha_register_timeout", 300.0),
        term_grace_s=_seconds(args, "ha_term_grace", 60.0), max_restarts=max_restarts,
        max_recurrences=max_recurrences, desync_after_s=float(desync), spare_wait_s=spare_wait,
        metrics_port=None if metrics_port is None else int(metrics_port))


def from_script_args(script_args: list[str], env: Mapping[str, str] | None = None) -> HAOptions | None:
    """The HA options of a training script's command line (what a launcher agent needs of them);
    None when they are invalid (the workers report that, with the flag to change). No abbreviation
    is read as one of them: a script's own flag that starts like one (Megatron's ``--optimizer``,
    ``--optimizer-replica-num``'s prefix) is the script's, as in Megatron-LM's own parser."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ns, _ = add_ha_args(parser).parse_known_args(script_args)
    try:
        return from_args(ns, env)
    except HAConfigError:
        return None


def check_dirs(opts: HAOptions, log_dir_flag: bool, save: str | None) -> None:
    """The directories a rank writes or reads, refused before anything is built, each by its flag."""
    check_writable(opts.log_dir, "--ha-log-dir" if log_dir_flag else "MINDSPEED_HA_LOG_DIR")
    check_writable(save, "--save")
    check_directory(opts.key_dir, "--ha-key-dir")


def check_directory(path: str | None, flag: str) -> None:
    """Refuse a path that is not a directory and cannot be made one (it may be read-only: keys
    mounted from a secret are read there, not written)."""
    if not path or os.path.isdir(path):
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise HAConfigError(f"{flag} {path}: not a directory, and it cannot be made one ({e.strerror or e}); "
                            "give a directory (`mindspeed-ha keygen DIR` makes the keys there)") from None


def check_writable(path: str | None, flag: str) -> None:
    """Refuse a directory this job could not write into, before anything is built."""
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".mindspeed-ha-write-check-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise HAConfigError(f"{flag} {path}: cannot write there ({e.strerror or e}); give a directory this job "
                            "may create and write") from None
