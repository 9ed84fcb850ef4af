"""Nodes on hosts of their own: each node in a network namespace (tests/hosts.py), the job given
nothing but --master-addr, as on real hosts whose name resolves to a loopback address (this
machine's /etc/hosts maps its name to 127.0.0.1, in every namespace)."""
import json
import subprocess
import sys

import pytest

from helpers import PRETRAIN, TINY, TINY_ITERS, clean_env, events, free_port, losses
from hosts import Hosts

pytestmark = pytest.mark.timeout(300)
MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]
WHY_NOT = Hosts.available()


@pytest.fixture
def hosts():
    if WHY_NOT:
        pytest.skip(WHY_NOT)
    h = Hosts(2)
    yield h
    h.close()


def start_nodes(hosts: Hosts, tmp_path, flags: list, env: dict) -> tuple[list, list]:
    keys = tmp_path / "keys"
    subprocess.run(MINDSPEED_HA + ["keygen", str(keys)], check=True, capture_output=True, env=clean_env())
    env = clean_env({"MINDSPEED_HA_KEY_DIR": str(keys), **env})
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)
    port, agents, dirs = free_port(), [], []
    for node in range(len(hosts.names)):
        d = tmp_path / f"node{node}"
        d.mkdir()
        cmd = MINDSPEED_HA + ["run", "--nnodes", str(len(hosts.names)), "--node-rank", str(node), "--nproc-per-node",
                              "2", "--master-addr", hosts.addr(0), "--master-port", str(port), PRETRAIN, *flags,
                              "--ha-log-dir", str(d)]
        out = open(d / "agent.out", "w")
        agents.append(hosts.popen(node, cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(d)))
        dirs.append(d)
    return agents, dirs


def test_two_hosts_given_only_the_master_address_train_under_ha(tmp_path, hosts, references):
    """Two nodes of two ranks, each with its own log dir; GLOO_SOCKET_IFNAME unset. Each agent picks
    the interface on the route to the master address and says so; the controller listens on node
    0's address, not on a loopback one; every rank of both nodes registers with it, so that rank 3
    (node 1), killed in step 5, is restarted by node 1's agent and recovered from its twin on node
    0: losses bit-identical to the fault-free run's."""
    flags = [*TINY, "--train-iters", str(TINY_ITERS), "--enable-worker-reboot", "--ha-verify-replicas-interval", "1"]
    agents, dirs = start_nodes(hosts, tmp_path, flags, {"MINDSPEED_HA_INJECT": "kill:rank=3:step=5:phase=backward"})
    try:
        codes = [p.wait(240) for p in agents]
    finally:
        for p in agents:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], "\n".join((d / "agent.out").read_text()[-3000:] for d in dirs)
    assert losses(dirs) == references.tiny("dp4")
    for node, d in enumerate(dirs):
        (net,) = [e for e in events(d, f"agent_{node}") if e["event"] == "network"]
        assert (net["host"], net["GLOO_SOCKET_IFNAME"], net["NCCL_SOCKET_IFNAME"]) == (hosts.addr(node), "eth0", "eth0")
        assert "resolves to a loopback address" in (d / "agent.out").read_text()
    assert json.loads((dirs[0] / "controller.json").read_text())["host"] == hosts.addr(0)
    ctl = events(dirs, "controller")
    (rec,) = [e for e in ctl if e["event"] == "recovered"]
    assert rec["strategy"] == "recover" and [f["ranks"] for f in rec["faults"] if f["kind"] == "process-exit"] == [[3]]
    rejoined = [e for e in ctl if e["event"] == "rejoined"]
    assert [e["rank"] for e in rejoined] == [3]


def test_a_rank_that_reaches_no_controller_does_not_train(tmp_path):
    """A rank (not rank 0: it hosts no controller) whose link finds no controller — here none was ever
    announced — must not train with HA silently off: at its first step it waits for one up to
    --ha-register-timeout, then ends with 201 and a diagnosis that says so."""
    code = f"""
import sys, time
from mindspeed_ha.control.processor import Processor
from mindspeed_ha.options import HAOptions
opts = HAOptions(strategies=frozenset({{"dump"}}), log_dir={str(tmp_path)!r}, insecure=True, register_timeout_s=1.5)
p = Processor(1, 4, 1, "n0", opts, [[1, 3]]).start()
t0 = time.monotonic()
p.await_controller()
print("trained without a controller after", time.monotonic() - t0)
"""
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60,
                          cwd=str(tmp_path))
    assert proc.returncode == 201, proc.stdout + proc.stderr
    assert "could not reach a controller within --ha-register-timeout 1.5 s" in proc.stderr
    assert "HA would be off" in proc.stderr and "trained" not in proc.stdout
    diag = [e for e in events(tmp_path, "rank_1") if e["event"] == "diagnosis"]
    assert diag and diag[0]["exit_code"] == 201
