"""``mindspeed-ha``: run | controller | keygen | status | inject | migrate | report.

The operator's commands (status, inject, migrate) find the job's controller where it announced
itself (the log dir's controller.json, or the job store) and ask it with the operator's key. Every
way they cannot reach the job — no controller announced, keys elsewhere or another job's, a log dir
of another job, a rank out of range, no answer — ends with one line on stderr that says what to
pass, and exit code 2 (a controller that answers and refuses: exit 1).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import zmq

from .events import log_dir_from_env, read_events


def _add_security(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-dir", "--ha-log-dir", dest="log_dir", default=None,
                   help="the job's log dir (env MINDSPEED_HA_LOG_DIR, default ./logs)")
    p.add_argument("--ha-key-dir", default=None)
    p.add_argument("--ha-insecure", action="store_true")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--job-store", default=None, metavar="HOST:PORT",
                   help="find the controller in the job's store (its --master-addr:--master-port) instead of "
                        "DIR/controller.json: for a node-local log dir on another node")


class Unreachable(Exception):
    """The operator's command cannot reach the job: one line saying why, and what to pass."""


def _controller_record(args, log_dir: str) -> dict:
    """Where the job's controller announced itself: DIR/controller.json, or the job store's record."""
    from .control.wire.announcement import read_controller_json
    if not args.job_store:
        info = read_controller_json(log_dir)
        if info is None:
            raise Unreachable(f"no controller is announced in {log_dir} (no readable {log_dir}/controller.json): "
                              "pass the job's --log-dir (env MINDSPEED_HA_LOG_DIR), or --job-store HOST:PORT "
                              "(its --master-addr:--master-port) where the log dirs are node-local; a starting job "
                              "announces its controller within seconds")
        return info
    from .control.wire.discovery import CONTROLLER_KEY, JobStore, parse_address
    address = parse_address(args.job_store)
    if address is None:
        raise Unreachable(f"--job-store {args.job_store!r} is no address: pass --job-store HOST:PORT (the job's "
                          "--master-addr:--master-port)")
    store = JobStore(address)
    try:
        store.watch(CONTROLLER_KEY)
        store.refresh(timeout=args.timeout)
        info = store.seen(CONTROLLER_KEY)
    finally:
        store.close()
    if not info or "endpoint" not in info:
        raise Unreachable(f"no controller is announced in the job store at {args.job_store} (within "
                          f"{args.timeout:g} s): pass the job's --master-addr:--master-port as --job-store, or its "
                          "--log-dir; a starting job announces its controller within seconds")
    return info


def _job_of(info: dict) -> str:
    job = info.get("job_id")
    return f"job {job}" if job else "the job"


def _keys(args, log_dir: str, info: dict):
    """The operator's keys for the announced job's controller, checked against what it announced."""
    from .control.wire import security
    job, job_id = _job_of(info), info.get("job_id")
    insecure = security.is_insecure(args.ha_insecure)
    if info.get("secure") is False and not insecure:
        raise Unreachable(f"{job}'s controller at {info['endpoint']} runs without authentication (started with "
                          "--ha-insecure): pass --ha-insecure")
    if info.get("secure") and insecure:
        raise Unreachable(f"{job}'s controller at {info['endpoint']} takes only its CurveZMQ keys: drop "
                          "--ha-insecure (and MINDSPEED_HA_INSECURE), and pass --ha-key-dir if the job was "
                          "started with one")
    try:
        keys = security.Keys.load(log_dir, args.ha_key_dir, args.ha_insecure, timeout=0.5, job=job_id,
                                  role="operator")
    except security.SecurityError as e:
        where = security.key_dir_for(log_dir, args.ha_key_dir, job_id)
        if not os.path.exists(os.path.join(where, "client.key_secret")):
            named = "--ha-key-dir" if args.ha_key_dir else (
                "MINDSPEED_HA_KEY_DIR" if os.environ.get("MINDSPEED_HA_KEY_DIR") else "the log dir's own")
            raise Unreachable(f"no CurveZMQ keys for {job} in {where} ({named}): pass the --ha-key-dir the job "
                              "was started with (the dir mindspeed-ha keygen made), or MINDSPEED_HA_KEY_DIR") from None
        raise Unreachable(f"{e}") from None
    announced = info.get("server_public_key")
    if keys.secure and announced and announced != keys.server_public_text():
        raise Unreachable(f"the keys in {keys.key_dir} are not {job}'s: its controller ({info['endpoint']}) has "
                          "another server key; pass the --ha-key-dir of that job, or the --log-dir (or "
                          "--job-store) of the job these keys belong to")
    return keys


def _check_job(info: dict, where: str) -> None:
    """An operator whose environment names a job (MINDSPEED_HA_JOB_ID) asks that job only."""
    wanted, announced = os.environ.get("MINDSPEED_HA_JOB_ID"), info.get("job_id")
    if wanted and announced and wanted != announced:
        raise Unreachable(f"{where} announces job {announced}'s controller, not job {wanted}'s (MINDSPEED_HA_JOB_ID): "
                          f"pass the --log-dir of job {wanted}, or unset MINDSPEED_HA_JOB_ID to ask job {announced}")


def _check_rank(info: dict, rank: int) -> None:
    world = info.get("world_size")
    if isinstance(world, int) and world > 0 and not 0 <= rank < world:
        raise Unreachable(f"there is no rank {rank} in {_job_of(info)} (world size {world}): pass --rank 0..{world - 1}")


def _request(args, data: bytes, rank: int | None = None) -> dict:
    """One authenticated request to the active controller: its answer (status or refused).
    ``rank``: the rank the request is about, checked against the job's world size first."""
    from .control.wire import protocol, security
    log_dir = log_dir_from_env(args.log_dir)
    info = _controller_record(args, log_dir)
    where = f"the job store at {args.job_store}" if args.job_store else f"{log_dir}/controller.json"
    _check_job(info, where)
    if rank is not None:
        _check_rank(info, rank)
    keys = _keys(args, log_dir, info)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    security.secure_client(s, keys)
    try:
        s.connect(info["endpoint"])
        s.send(data)
        while s.poll(int(args.timeout * 1000)):
            msg = protocol.decode(s.recv())
            if msg["t"] in ("status", "refused"):
                return msg
    finally:
        s.close()
        ctx.term()
    raise Unreachable(f"no controller answered at {info['endpoint']} within {args.timeout:g} s ({where} names "
                      f"{_job_of(info)}'s, epoch {info.get('epoch', '?')}): the job may have ended, or its controller "
                      "moved; pass the --log-dir (or --job-store) of a running job, or a longer --timeout")


def cmd_status(args) -> int:
    from .control.wire import protocol
    log_dir = log_dir_from_env(args.log_dir)
    try:
        msg = _request(args, protocol.encode("status?"))
    except Unreachable as e:  # what the event log knows, then the line that says what to pass
        faults = [f for f in read_events(os.path.join(log_dir, "events", "controller.jsonl"))
                  if f.get("event") == "fault"]
        if args.json:
            print(json.dumps({"state": "unreachable", "faults": faults, "note": f"{e}; faults from the event log"},
                             indent=1))
        else:
            _print_faults(faults)
        raise
    if msg["t"] != "status":
        return _answer(msg)
    st: dict[str, Any] = msg["body"]
    if args.json:
        print(json.dumps(st, indent=1))
        return 0
    c = st["controller"]
    print(f"state {st['state']}  epoch {st['epoch']}  world {st['world_size']}  "
          f"controller rank {c['rank']} pid {c['pid']} at {c['endpoint']}")
    print("backups: " + (", ".join(f"rank {b['rank']} at {b['endpoint']}" for b in st["backups"]) or "none"))
    if st.get("layout"):  # elastic: the job was resized
        lay = st["layout"]
        print(f"layout: data-parallel size {lay['data_parallel_size']}, ranks {lay['ranks']}"
              + (f"; out of the layout {lay['left']}" if lay["left"] else "")
              + (f"; joining {lay['joining']}" if lay["joining"] else ""))
    print(f"{'rank':>5} {'pid':>8} {'node':<20} {'iter':>6} {'phase':<11} {'health':<8} alive  replica groups")
    for r in st["ranks"]:
        print(f"{r['rank']:>5} {r['pid']:>8} {r['node']:<20} {r['iteration']:>6} {r['phase']:<11} "
              f"{r['health']:<8} {'yes' if r['alive'] else 'no':<6} {r['replica_groups']}")
    _print_faults(st["faults"])
    return 0


def _print_faults(faults: list[dict]) -> None:
    for f in faults:
        print(f"fault: ranks {f['ranks']} {f['kind']} at iteration {f['iteration']} phase {f['phase']} "
              f"(detected in {f['detect_s']}s)")


def cmd_inject(args) -> int:
    from .control.wire import protocol
    fields = {"kind": args.kind, "rank": args.rank}
    if args.step is not None:
        fields["step"] = args.step
    if args.phase:
        fields["phase"] = args.phase
    if args.factor is not None:
        fields["factor"] = args.factor
    return _answer(_request(args, protocol.encode("inject", **fields), rank=args.rank))


def cmd_migrate(args) -> int:
    from .control.wire import protocol
    return _answer(_request(args, protocol.encode("migrate", rank=args.rank, reason=args.reason), rank=args.rank))


def _answer(msg: dict) -> int:
    """Print the controller's answer to a request; 0 if it took it."""
    if msg["t"] == "refused":
        print(f"refused: {msg['reason']}", file=sys.stderr)
        return 1
    body = msg["body"]
    print(json.dumps(body))
    return 0 if body.get("ok") else 1


def cmd_controller(args) -> int:
    from .control.controller import run_standalone
    from .events import setup_text_log
    from .options import HAOptions
    log_dir = log_dir_from_env(args.log_dir)
    setup_text_log(log_dir)
    # (the strategies: the ranks', as they register; the dump until then)
    opts = HAOptions(strategies=frozenset({"dump"}), source="ranks", log_dir=log_dir, key_dir=args.ha_key_dir,
                     insecure=args.ha_insecure, heartbeat_s=args.ha_heartbeat_interval,
                     hang_timeout_s=args.ha_hang_timeout)
    # MindSpore's names for where an external controller listens, when the flags do not say
    host = args.host or os.environ.get("MS_TFT_IP") or None
    port = args.port or int(os.environ.get("MS_TFT_PORT") or 0)
    return run_standalone(log_dir, args.world_size, opts, host=host, port=port)


def cmd_keygen(args) -> int:
    """Keys for a job whose nodes share no log dir: made once, handed to every node (a Kubernetes
    Secret, a directory every node mounts) and named with --ha-key-dir."""
    from .control.wire import security
    d = os.path.abspath(args.dir)
    if os.path.exists(os.path.join(d, "client.key_secret")) and not args.force:
        print(f"{d} already holds keys; --force makes new ones (every node must then get the new ones)", file=sys.stderr)
        return 1
    if args.force and os.path.isdir(d):
        import shutil
        shutil.rmtree(d)
    security.create_keys(d)
    print(f"CurveZMQ keys in {d} (mode 0700, secrets 0600). Give every node this directory and start each with "
          f"--ha-key-dir {d} (or MINDSPEED_HA_KEY_DIR={d}). Kubernetes: kubectl create secret generic mindspeed-ha-keys "
          f"--from-file={d} and mount it (defaultMode 0600; its files are flat, so the authorized/ copies are "
          "rebuilt from the public keys).")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        from .launcher.agent import main as run
        from .process import exit_done
        exit_done(run(argv[1:]))  # (the agent imported torch: no finalisation of it, see exit_done)
    p = argparse.ArgumentParser(prog="mindspeed-ha", description="mindspeed-ha: training fault tolerance")
    sub = p.add_subparsers(dest="cmd", required=True)
    from .control.wire.protocol import INJECT_KINDS, INJECT_PHASES
    # (torchrun's parser needs torch: built only for a run; `mindspeed-ha run --help` shows it)
    sub.add_parser("run", help="launch workers on this node (torchrun's flags; mindspeed-ha run --help)",
                   add_help=False).add_argument("rest", nargs=argparse.REMAINDER)
    k = sub.add_parser("keygen", help="make CurveZMQ keys once for a job of several nodes")
    k.add_argument("dir")
    k.add_argument("--force", action="store_true", help="replace keys already there")
    c = sub.add_parser("controller", help="run the controller as a standalone process")
    _add_security(c)
    c.add_argument("--world-size", type=int, required=True)
    c.add_argument("--host", default=None)
    c.add_argument("--port", type=int, default=0)
    c.add_argument("--ha-heartbeat-interval", type=float, default=0.5)
    c.add_argument("--ha-hang-timeout", type=float, default=60.0)
    s = sub.add_parser("status", help="ranks, iteration, state, controller, faults of a live job")
    _add_security(s)
    s.add_argument("--json", action="store_true")
    i = sub.add_parser("inject", help="inject a fault into a live job (through the controller)")
    _add_security(i)
    i.add_argument("--kind", required=True, choices=INJECT_KINDS)
    i.add_argument("--rank", type=int, required=True)
    i.add_argument("--step", type=int, default=None)
    i.add_argument("--phase", default=None, choices=INJECT_PHASES)
    i.add_argument("--factor", type=float, default=None, help="slow: steps take FACTOR times as long (default 3; 1: back to full speed)")
    m = sub.add_parser("migrate", help="move a rank to a spare worker at the next step boundary")
    _add_security(m)
    m.add_argument("--rank", type=int, required=True)
    m.add_argument("--reason", default="requested by an operator")
    r = sub.add_parser("report", help="every fault and recovery of a job, and DIR/recovery_timeline.png")
    r.add_argument("log_dir", nargs="+", help="the job's log dir (node-local dirs: every node's)")
    r.add_argument("--json", action="store_true")
    r.add_argument("--no-picture", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "report":
        from .report import main as report
        return report(args.log_dir, picture=not args.no_picture, as_json=args.json)
    command = {"controller": cmd_controller, "status": cmd_status, "inject": cmd_inject, "keygen": cmd_keygen,
               "migrate": cmd_migrate}[args.cmd]
    try:
        return command(args)
    except Unreachable as e:
        print(f"mindspeed-ha {args.cmd}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
