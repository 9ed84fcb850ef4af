"""The command line of ``mindspeed-ha run``: torchrun's, through torch's own parser, so every torchrun
flag and its ``PET_*`` environment default (what Kubernetes' training operator sets) means what it
means under torchrun; plus the agent's own flags; plus Slurm's variables where neither names a value.

Precedence for the job's shape: a flag, then its ``PET_*`` variable, then Slurm (``SLURM_NNODES``,
``SLURM_NODEID``, ``SLURM_JOB_ID``; the master from ``MASTER_ADDR`` / ``MASTER_PORT``), then
torchrun's defaults. ``resolve`` turns the parsed namespace into plain values (``Launch``) and
refuses, with the flag to change, what this launcher does not do.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal


class LaunchError(ValueError):
    """A launch this agent cannot do; the message names the flag or variable and what would work."""


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser
    p = argparse.ArgumentParser(prog="mindspeed-ha run", parents=[get_args_parser()], conflict_handler="resolve",
                                description="launch this node's workers (torchrun's flags) under mindspeed-ha")
    g = p.add_argument_group("mindspeed-ha agent")
    g.add_argument("--node-host", default=None,
                   help="address other nodes reach this one at (default: --local-addr, else 127.0.0.1 when the "
                        "master is loopback, else this host's address)")
    g.add_argument("--decision-timeout", type=float, default=15.0,
                   help="seconds to wait for the controller after a worker failed before acting alone")
    g.add_argument("--exit-grace", type=float, default=3.0,
                   help="seconds workers get to exit after an exit order before SIGTERM (+2s SIGKILL)")
    g.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                   help="the controller's orders to this node's ranks and their answers go through this agent: "
                        "one frame each way per node and round, not one per rank (what a job of thousands of "
                        "ranks needs; its ranks are still heard directly, and get directly what a lost agent owed). "
                        "On by default; --no-relay: every order to the ranks directly")
    return p


@dataclasses.dataclass
class Launch:
    """What an agent needs to know of its job, resolved from flags, PET_* and Slurm."""
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    standalone: bool
    job_id: str | None
    node_host: str | None
    cmd: list
    log_dir: str | None          # torchrun's --log-dir: per-rank stdout/stderr files (with --redirects/--tee)
    redirects: str
    tee: str
    local_ranks_filter: str
    role: str
    term_signals: tuple
    exit_grace: float
    decision_timeout: float
    monitor_interval: float
    script_args: list
    relay: bool = True           # --relay (--no-relay): the controller's orders and their answers go through the agent


def _from_env(name: str, env) -> bool:
    return f"PET_{name.upper()}" in env


def resolve(a: argparse.Namespace, env=os.environ) -> Launch:
    """The parsed command line (and the environment) as a ``Launch``; ``LaunchError`` for what
    cannot be done, naming the flag."""
    import sys
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes
    slurm = "SLURM_JOB_ID" in env
    nnodes_text = str(a.nnodes)
    if slurm and nnodes_text == "1:1" and not _from_env("nnodes", env) and env.get("SLURM_NNODES"):
        nnodes_text = env["SLURM_NNODES"]
    try:
        lo, hi = parse_min_max_nnodes(nnodes_text)
    except Exception:
        raise LaunchError(f"--nnodes {nnodes_text!r}: give a number of nodes, e.g. --nnodes 2") from None
    if lo != hi:
        raise LaunchError(f"--nnodes {nnodes_text}: a range of node counts (torchrun's elastic membership) is not "
                          f"how mindspeed-ha scales; give the job's node count, e.g. --nnodes {hi}")
    node_rank = int(a.node_rank)
    if slurm and node_rank == 0 and not _from_env("node_rank", env) and env.get("SLURM_NODEID"):
        node_rank = int(env["SLURM_NODEID"])
    if not 0 <= node_rank < hi:
        raise LaunchError(f"--node-rank {node_rank}: this job has nodes 0..{hi - 1} (--nnodes {hi})")
    try:
        nproc = determine_local_world_size(str(a.nproc_per_node))
    except ValueError as e:
        raise LaunchError(f"--nproc-per-node {a.nproc_per_node!r}: {e}") from None
    addr, port = a.master_addr, a.master_port
    if a.rdzv_endpoint and a.rdzv_backend in ("c10d", "static"):
        host, _, p = a.rdzv_endpoint.rpartition(":") if ":" in a.rdzv_endpoint else (a.rdzv_endpoint, "", "")
        addr, port = host or addr, int(p) if p else port
    elif a.rdzv_backend not in ("c10d", "static"):
        raise LaunchError(f"--rdzv-backend {a.rdzv_backend}: mindspeed-ha meets at a TCP store; use --rdzv-backend "
                          "c10d with --rdzv-endpoint HOST:PORT, or --master-addr/--master-port")
    if slurm and addr == "127.0.0.1" and not _from_env("master_addr", env) and hi > 1:
        if not env.get("MASTER_ADDR"):
            raise LaunchError("under Slurm with several nodes, set MASTER_ADDR (the first node's address, e.g. "
                              "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)) "
                              "and MASTER_PORT, or pass --master-addr/--master-port")
        addr = env["MASTER_ADDR"]
    if port is None:
        port = int(env["MASTER_PORT"]) if slurm and env.get("MASTER_PORT", "").isdigit() else 29500
    job_id = a.rdzv_id if a.rdzv_id not in (None, "", "none") else None
    if job_id is None and slurm:
        job_id = f"slurm-{env['SLURM_JOB_ID']}"
    unsupported = [(flag, getattr(a, dest)) for flag, dest, default in (
        ("--run-path", "run_path", False), ("--logs-specs", "logs_specs", None),
        ("--numa-binding", "numa_binding", None), ("--virtual-local-rank", "virtual_local_rank", False),
        ("--duplicate-stdout-filters", "duplicate_stdout_filters", []),
        ("--duplicate-stderr-filters", "duplicate_stderr_filters", []))
        if getattr(a, dest, default) not in (default, None, "", [])]
    if unsupported:
        raise LaunchError(f"{unsupported[0][0]} is a torchrun flag mindspeed-ha run does not support; drop it")
    signals = []
    for name in filter(None, (s.strip() for s in str(a.signals_to_handle or "").split(","))):
        try:
            signals.append(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
        except KeyError:
            raise LaunchError(f"--signals-to-handle: {name!r} is not a signal name (e.g. SIGTERM,SIGUSR1)") from None
    script_args = list(a.training_script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    if a.no_python:
        cmd = [a.training_script]
    else:
        cmd = [sys.executable, "-u"] + (["-m"] if a.module else []) + [a.training_script]
    grace = float(a.shutdown_timeout) if getattr(a, "shutdown_timeout", None) else float(a.exit_grace)
    return Launch(nnodes=hi, node_rank=node_rank, nproc_per_node=nproc, master_addr=addr, master_port=int(port),
                  standalone=bool(a.standalone), job_id=job_id, node_host=a.node_host or a.local_addr, cmd=cmd,
                  log_dir=a.log_dir, redirects=str(a.redirects), tee=str(a.tee),
                  local_ranks_filter=str(a.local_ranks_filter or ""), role=str(a.role or "default"),
                  term_signals=tuple(signals), exit_grace=grace, decision_timeout=float(a.decision_timeout),
                  monitor_interval=float(a.monitor_interval), script_args=script_args, relay=bool(a.relay))
