"""A cluster on loopback: two nodes of two ranks, each node with a log dir of its own (no shared file
system; node 1 listens on 127.0.0.2), keys made once with `mindspeed-ha keygen`. Nodes are lost with
their agents and started again on fresh, empty directories, as a scheduler would; the job is
preempted; it never starts whole. Every loss is compared with a fault-free run, bit for bit."""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import (MLM_ENV, MLM_MISSING, MLM_READY, MLM_TINY, PRETRAIN, TINY, all_rank_events, assert_ok, clean_env,
                     events, extended, extended_test, free_port, losses)

pytestmark = pytest.mark.timeout(420)
MINDSPEED_HA = [sys.executable, "-m", "mindspeed_ha.cli"]
ITERS = 100
FLAGS = [*TINY, "--train-iters", str(ITERS), "--enable-hbmfault-repair", "--enable-worker-reboot",
         "--ha-verify-replicas-interval", "1"]


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    proc = subprocess.run(MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", "4", PRETRAIN, *FLAGS,
                                          "--ha-log-dir", str(d)], env=clean_env(), capture_output=True, text=True,
                          timeout=300, cwd=str(d))
    assert_ok(proc)
    return d


@pytest.fixture(scope="module")
def ref(ref_dir):
    return losses(ref_dir)


# Megatron-LM's own loop (no dropout: another data-parallel split draws other masks)
MLM_FLAGS = [*MLM_TINY, "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(ITERS)]


@pytest.fixture(scope="module")
def mlm_ref_dir(tmp_path_factory):
    if not MLM_READY:
        pytest.skip(MLM_MISSING)
    d = tmp_path_factory.mktemp("mlm_ref")
    proc = subprocess.run(MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", "4", PRETRAIN, *MLM_FLAGS,
                                          "--ha-log-dir", str(d)], env=clean_env(MLM_ENV), capture_output=True,
                          text=True, timeout=300, cwd=str(d))
    assert_ok(proc)
    return d


def sample_hashes(dirs) -> dict:
    """iteration -> the samples_hash of every report of it (rank 0's step events)."""
    out = {}
    for e in events(dirs, "rank_0"):
        if e["event"] == "step" and not e.get("late"):
            out.setdefault(e["iteration"], set()).add(e["samples_hash"])
    return out


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    subprocess.run(MINDSPEED_HA + ["keygen", str(d)], check=True, capture_output=True, env=clean_env())
    return d


class Cluster:
    """Agents started and killed like nodes: each incarnation of a node has its own fresh log dir."""

    def __init__(self, tmp_path, keys, port, env=None, flags=(), slurm=False, nproc=2, nnodes=2):
        self.tmp, self.port, self.flags, self.slurm, self.nproc = tmp_path, port, list(flags), slurm, nproc
        self.nnodes = nnodes
        self.base = FLAGS
        self.env = clean_env({"MINDSPEED_HA_KEY_DIR": str(keys), **(env or {})})
        self.agents: dict[int, subprocess.Popen] = {}
        self.dirs: list = []
        self.node_dir: dict[int, object] = {}

    def start(self, node: int) -> subprocess.Popen:
        d = self.tmp / f"node{node}-{len(self.dirs)}"
        d.mkdir()
        self.dirs.append(d)
        self.node_dir[node] = d
        env = dict(self.env)
        if self.slurm:  # only Slurm's variables and the master's address
            env.update(SLURM_JOB_ID="4242", SLURM_NNODES=str(self.nnodes), SLURM_NODEID=str(node), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(self.port))
            shape = []
        else:
            shape = ["--nnodes", str(self.nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1",
                     "--master-port", str(self.port)]
        cmd = MINDSPEED_HA + ["run", *shape, "--nproc-per-node", str(self.nproc), "--local-addr", f"127.0.0.{node + 1}",
                              PRETRAIN, *self.base, *self.flags, "--ha-log-dir", str(d)]
        out = open(d / "agent.out", "w")
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(d))
        self.agents[node] = p
        return p

    def lose(self, node: int) -> None:
        """The node is gone: its agent and its workers (spares too), killed at once."""
        self.agents[node].kill()
        _kill(_processes(self.node_dir[node], node))
        self.agents[node].wait(30)

    def whole(self) -> None:
        """Every rank and agent registered with the controller: the job trains under HA."""
        self.wait(lambda: any(e["to"] == "normal" for e in self.controller("state")), "the job to register whole")

    def scaled_in_without_node_1(self) -> None:
        """Both nodes start, train 3 steps whole; node 1 is lost, and the job trains 2 steps scaled in."""
        self.start(0)
        self.start(1)
        self.whole()
        self.wait(lambda: self.iteration() >= 3, "3 steps at DP=4")
        self.lose(1)
        self.wait(lambda: self.controller("scaled_in"), "the scale-in", timeout=120)
        self.wait(lambda: self.iteration() >= self.controller("scaled_in")[-1]["iteration"] + 2, "2 steps at DP=2")

    def unpace(self, rank: int, controller_node: int | None = None) -> None:
        """The drill's events are over: ``rank``, which paced the job (a ``slow`` fault, so that nodes
        could come and go between steps), takes its steps at full speed again (``slow`` with factor 1,
        through the active controller: found in the job store, or in ``controller_node``'s log dir
        when node 0, which served the store, is gone), so the job's remaining steps are not paced."""
        where = ["--job-store", f"127.0.0.1:{self.port}"] if controller_node is None else \
            ["--log-dir", str(self.node_dir[controller_node])]
        p = subprocess.run(MINDSPEED_HA + ["inject", *where, "--kind", "slow", "--rank", str(rank), "--factor", "1",
                                           "--timeout", "15"],
                           env=self.env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr

    def out(self, node: int) -> str:
        return (self.node_dir[node] / "agent.out").read_text()[-4000:]

    def wait(self, pred, what: str, timeout: float = 180.0):
        t = time.monotonic()
        while True:
            v = pred()
            if v:
                return v
            assert time.monotonic() - t < timeout, f"timed out waiting for {what}: " + \
                " | ".join(f"node {n}: {self.out(n)[-1500:]}" for n in self.agents)
            time.sleep(0.2)

    def controller(self, event: str) -> list:
        return [e for e in events(self.dirs, "controller") if e["event"] == event]

    def iteration(self, rank: int = 0) -> int:
        """The newest step ``rank`` logged (with a pipeline, a rank of the last stage logs them)."""
        return max([e["iteration"] for e in events(self.dirs, f"rank_{rank}") if e["event"] == "step"] or [0])

    def close(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for n, d in enumerate(self.dirs):  # (a killed agent's workers would train on by themselves)
            _kill(_processes(d, int(d.name[4])))


def _processes(log_dir, node: int) -> list:
    return [e["worker_pid"] for e in events(log_dir, f"agent_{node}")
            if e["event"] in ("worker_start", "spare_template_start", "spare_start")]


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # (each worker leads a session of its own)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def metrics(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}


def test_slurm_nodes_with_own_log_dirs_node_lost_then_preempted(tmp_path, keys, ref):
    """Agents that know the job only from Slurm's variables. Node 1 is lost with its agent; its
    replacement starts on an empty log dir and joins through the job store; /metrics shows the
    recovery as it happens. Then the scheduler preempts node 0's agent (SIGTERM): the dying gasp is
    written and every process exits with 200; `--load` goes on bit-identical."""
    mport = free_port()
    ck = tmp_path / "ck"  # checkpoints on shared storage; logs node-local
    c = Cluster(tmp_path, keys, free_port(), slurm=True,
                flags=["--save", str(ck), "--save-interval", "1000", "--ha-metrics-port", str(mport)])
    try:
        c.start(0)
        c.start(1)
        c.wait(lambda: c.iteration() >= 4 and len(c.controller("standby")) >= 2, "training")
        assert metrics(mport)["mindspeed_ha_ranks_alive"] == 4
        c.lose(1)
        c.wait(lambda: c.controller("restart"), "the recovery")
        assert c.controller("restart")[0]["awaiting_node"] == [2, 3]
        during = metrics(mport)
        assert during["mindspeed_ha_ranks_alive"] == 2 and during['mindspeed_ha_state{state="recovering"}'] == 1
        # An operator on node 1, whose log dir knows nothing of the controller, asks through the store.
        # (--timeout: the store's answer, not its speed on a loaded host, is what this checks)
        st = subprocess.run(MINDSPEED_HA + ["status", "--log-dir", str(tmp_path / "empty"), "--job-store",
                                            f"127.0.0.1:{c.port}", "--ha-key-dir", str(keys), "--json",
                                            "--timeout", "30"],
                            env=clean_env(), capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, st.stdout + st.stderr
        assert [r["alive"] for r in json.loads(st.stdout)["ranks"]] == [True, True, False, False]
        c.start(1)
        c.wait(lambda: c.controller("recovered"), "the replacement node's recovery")
        after = c.wait(lambda: (m := metrics(mport))["mindspeed_ha_ranks_alive"] == 4 and m, "4 ranks alive")
        assert after['mindspeed_ha_recoveries_total{strategy="recover"}'] == 1
        assert after['mindspeed_ha_faults_total{kind="heartbeat-lost"}'] >= 1
        at = c.controller("recovered")[0]["iteration"]
        c.wait(lambda: c.iteration() >= at + 2, "training after the recovery")
        c.agents[0].send_signal(signal.SIGTERM)
        assert c.agents[0].wait(120) == 200, c.out(0)
        assert c.agents[1].wait(60) == 200, c.out(1)
    finally:
        c.close()
    gasp = c.controller("checkpoint")
    assert gasp and gasp[0]["kind"] == "dying_gasp", c.controller("diagnosis")
    assert "preempted" in c.controller("diagnosis")[-1]["text"]
    saved = gasp[0]["iteration"]
    got = losses(c.dirs)
    assert got == {i: ref[i] for i in got} and saved >= max(got) - 1  # (a step may be logged, not all saved)
    # Resume from the dying gasp on one node: the rest of the run, bit for bit.
    d = tmp_path / "resume"
    d.mkdir()
    proc = subprocess.run(MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", "4", PRETRAIN, *FLAGS,
                                          "--load", str(ck), "--ha-log-dir", str(d)],
                          env=clean_env(), capture_output=True, text=True, timeout=300, cwd=str(d))
    assert_ok(proc)
    assert losses(d) == {i: h for i, h in ref.items() if i > saved}


@extended_test  # (the controller's node lost in CI: test_hosts' three hosts, test_elastic_rank_0s_node_lost)
def test_controller_node_lost_three_times(tmp_path, keys, ref):
    """Node 0 (rank 0 hosts the controller, node 0's agent serves the job store) is lost; its
    replacement serves a new, empty store that the running job fills again, and joins. A standby on
    node 1 took over and named new standbys; then node 1, now the controller's, is lost; then node 0
    again. Each time the controller's node goes and comes back; the job ends whole, bit-identical.
    Rank 0 paces the job (0.3 s a step, from its first step in each of its processes): a slow
    recovery must not let the job end before the next loss."""
    c = Cluster(tmp_path, keys, free_port(), env={"MINDSPEED_HA_INJECT": "slow:rank=0:step=any:factor=4"})
    try:
        c.start(0)
        c.start(1)
        step = 3
        for n, node in enumerate((0, 1, 0), start=1):
            c.wait(lambda: c.iteration() >= step, f"iteration {step}")
            # (the controller's node can be lost once its standbys stand by: 2 named by each controller)
            c.wait(lambda: len(c.controller("standby")) >= 2 * n, f"the standbys of controller {n}")
            time.sleep(1.5)  # every rank hears of them in its next heartbeat's answer (0.5 s)
            c.lose(node)
            c.start(node)
            c.wait(lambda: len(c.controller("recovered")) >= n, f"recovery {n} (node {node})", timeout=240)
            step = c.controller("recovered")[-1]["iteration"] + 3
        c.unpace(0)
        assert c.agents[0].wait(240) == 0, c.out(0)
        assert c.agents[1].wait(60) == 0, c.out(1)
    finally:
        c.close()
    assert len(c.controller("takeover")) == 3
    assert [e["strategy"] for e in c.controller("recovered")] == ["recover"] * 3
    assert losses(c.dirs) == ref
    # The report reads every node's dirs: each controller's events are where it ran.
    rep = subprocess.run(MINDSPEED_HA + ["report", *map(str, c.dirs), "--no-picture"], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0, rep.stderr
    assert len([ln for ln in rep.stdout.splitlines() if "recovered" in ln and "recover " in ln]) == 3, rep.stdout


def test_a_node_that_never_comes_ends_the_job_with_its_name(tmp_path, keys):
    port = free_port()
    c = Cluster(tmp_path, keys, port, flags=["--ha-register-timeout", "4"])
    try:
        p = c.start(0)
        assert p.wait(120) == 201, c.out(0)
    finally:
        c.close()
    text = c.out(0)
    assert "node(s) 1 (rank(s) 2, 3) did not come up within --ha-register-timeout 4 s" in text, text


def test_several_nodes_without_keys_are_refused(tmp_path):
    p = subprocess.run(MINDSPEED_HA + ["run", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2",
                                       PRETRAIN, *FLAGS, "--ha-log-dir", str(tmp_path)],
                       env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "mindspeed-ha keygen" in p.stderr and "--ha-key-dir" in p.stderr and "Traceback" not in p.stderr


def assert_resized_losses(got: dict, ref: dict, first: int, bound: float) -> None:
    """Every iteration logged; bit-identical to the fault-free run up to iteration ``first`` (the first
    resize's), within ``bound`` relative after it (another data-parallel size sums in another order)."""
    assert sorted(got) == sorted(ref)
    assert {i: got[i] for i in ref if i <= first} == {i: ref[i] for i in ref if i <= first}
    rel = max(abs(float.fromhex(got[i]) / float.fromhex(ref[i]) - 1) for i in ref if i > first)
    assert rel < bound, rel


@extended_test  # (a lost node's scale-in: test_elastic_newcomer_lost_during_the_scale_out, in CI)
def test_a_lost_node_without_a_replacement_scales_the_job_in(tmp_path, keys, ref):
    """Recover and elastic both on; node 1 is lost and no replacement comes within --ha-spare-wait:
    recover waits for one, then the episode scales in — ranks 0 and 1 train on at DP=2 to the end.
    Bit-identical before the loss, within the bound of another data-parallel size after it."""
    c = Cluster(tmp_path, keys, free_port(), flags=["--enable-elastic-training", "--ha-spare-wait", "2"])
    try:
        c.scaled_in_without_node_1()
        assert c.agents[0].wait(240) == 0, c.out(0)
    finally:
        c.close()
    strategy = [e["reason"] for e in c.controller("strategy")]
    assert strategy[0].startswith("strategy recover; lost node(s) of rank(s) [2, 3]: their replacement is waited "
                                  "for up to 2 s"), strategy
    assert strategy[1] == "no replacement for rank(s) [2, 3] within --ha-spare-wait 2 s: the job scales in " \
                          "without them", strategy
    scaled = c.controller("scaled_in")
    assert [(e["old_dp"], e["dp"], e["kept"], e["dropped"]) for e in scaled] == [(4, 2, [[0], [1]], [2, 3])]
    assert_resized_losses(losses(c.dirs), ref, scaled[0]["iteration"], 1e-6)


# (a node lost and back in CI: test_elastic_newcomer_lost_during_the_scale_out, test_hosts' cut node;
# this one on the other megatron-core releases CI runs)
@pytest.mark.parametrize("loop", [extended("built-in", marks=[pytest.mark.megatron_release]),
                                  extended("megatron-lm", marks=[pytest.mark.megatron_release])])
def test_elastic_node_lost_twice_and_back_twice(tmp_path, keys, loop, request):
    """HIGH_AVAILABILITY=elastic-training only: node 1 is lost (no spare: DP 4 -> 2), its replacement
    comes (DP 2 -> 4, its ranks take weights, shards, counters and RNG from the kept ones), then
    the same again; through the built-in trainer and through Megatron-LM's own loop (whose
    newcomers build their model with Megatron-LM's set-up inside the scale-out). Every iteration
    is logged once; bit-identical up to the first loss, within the bound of another data-parallel
    size after it; every global batch holds the fault-free run's samples."""
    ref_dir = request.getfixturevalue("ref_dir" if loop == "built-in" else "mlm_ref_dir")
    ref = losses(ref_dir)
    # rank 0 (never lost) paces the job at a few tenths of a second a step, so that a node can start in time;
    # from step 3, which the node is never lost before (the pace is the step before it times 8)
    c = Cluster(tmp_path, keys, free_port(), env={"HIGH_AVAILABILITY": "elastic-training",
                                                  "MINDSPEED_HA_INJECT": "slow:rank=0:step=3:factor=8",
                                                  **(MLM_ENV if loop == "megatron-lm" else {})})
    c.base = [*(TINY if loop == "built-in" else MLM_FLAGS), "--train-iters", str(ITERS),
              "--ha-verify-replicas-interval", "1"]
    try:
        c.start(0)
        c.start(1)
        c.whole()
        for n in (1, 2):
            back = c.controller("scaled_out")
            c.wait(lambda: c.iteration() >= (back[-1]["iteration"] if back else 0) + 3, "3 steps at DP=4")
            c.lose(1)
            c.wait(lambda: len(c.controller("scaled_in")) >= n, f"scale-in {n}", timeout=120)
            c.wait(lambda: c.iteration() >= c.controller("scaled_in")[-1]["iteration"] + 3, "3 steps at DP=2")
            if n == 1:  # an operator on node 0 sees the layout
                st = subprocess.run(MINDSPEED_HA + ["status", "--log-dir", str(c.node_dir[0]), "--ha-key-dir", str(keys),
                                                    "--timeout", "15"],
                                    env=clean_env(), capture_output=True, text=True, timeout=60)
                assert "layout: data-parallel size 2, ranks [0, 1]; out of the layout [2, 3]" in st.stdout, \
                    st.stdout + st.stderr
            c.start(1)
            c.wait(lambda: len(c.controller("scaled_out")) >= n, f"scale-out {n}", timeout=120)
        c.unpace(0)
        assert c.agents[0].wait(300) == 0, c.out(0)
        assert c.agents[1].wait(60) == 0, c.out(1)
    finally:
        c.close()
    scaled_in, scaled_out = c.controller("scaled_in"), c.controller("scaled_out")
    assert [(e["old_dp"], e["dp"], e["dropped"]) for e in scaled_in] == [(4, 2, [2, 3])] * 2
    assert [(e["old_dp"], e["dp"], e["added"], e["redundancy"]) for e in scaled_out] == [(4 // 2, 4, [2, 3], True)] * 2
    steps = [e["iteration"] for e in events(c.dirs, "rank_0") if e["event"] == "step"]
    assert sorted(steps) == sorted(set(steps)) == list(range(1, ITERS + 1))
    assert_resized_losses(losses(c.dirs), ref, scaled_in[0]["iteration"], 1e-4)
    rep = subprocess.run(MINDSPEED_HA + ["report", *map(str, c.dirs), "--no-picture"], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert rep.stdout.count("recovered (data-parallel size 4 -> 2)") == 2, rep.stdout + rep.stderr
    assert rep.stdout.count("scaled out (data-parallel size 2 -> 4)") == 2, rep.stdout
    # every global batch, at DP=4 or 2, held exactly the fault-free run's samples of that iteration
    want = sample_hashes(ref_dir)
    assert len({h for v in want.values() for h in v}) == ITERS
    assert sample_hashes(c.dirs) == want


def test_elastic_newcomer_lost_during_the_scale_out(tmp_path, keys, ref_dir):
    """Node 1 is lost (DP 4 -> 2); its replacement comes, and newcomer rank 3 dies inside the scale-out,
    after every rank entered the DP=4 layout and before any state moved. The kept ranks answer with
    what they held before, the controller plans again with the loss known: the same DP=2 layout,
    entered again from that state; rank 3 leaves, and rank 2 alone (half of DP=3, which the batch
    forbids) is told to leave too. The job trains on at DP=2 to the end: every iteration logged once
    with the fault-free run's samples, within the bound of another data-parallel size."""
    c = Cluster(tmp_path, keys, free_port(), env={"HIGH_AVAILABILITY": "elastic-training",
                                                  "MINDSPEED_HA_INJECT": "slow:rank=0:step=3:factor=8"})
    c.base = [*TINY, "--train-iters", str(ITERS)]
    try:
        c.scaled_in_without_node_1()
        c.env["MINDSPEED_HA_INJECT"] = "kill:rank=3:step=any:phase=resize"  # the replacement node's
        c.start(1)
        c.wait(lambda: c.controller("scale_out_refused"), "the newcomer left alone to be refused", timeout=150)
        c.unpace(0)
        assert c.agents[0].wait(300) == 0, c.out(0)
        assert c.agents[1].wait(60) == 0, c.out(1)
    finally:
        c.close()
    scaled_in = c.controller("scaled_in")
    assert [(e["old_dp"], e["dp"], e["kept"], e["dropped"]) for e in scaled_in] == [(4, 2, [[0], [1]], [2, 3]),
                                                                                    (2, 2, [[0], [1]], [])]
    assert not c.controller("scaled_out")
    assert [e["newcomers"] for e in c.controller("scale_out_refused")] == [[2]]
    plans = c.controller("resize_plan")
    assert [(p["old_dp"], p["dp"]) for p in plans] == [(4, 2), (2, 4), (2, 2)], plans
    assert ([3], "process-exit") in [(f["ranks"], f["kind"]) for f in c.controller("fault")]
    assert [e["phase"] for e in events(c.dirs, "rank_3") if e["event"] == "inject"] == ["resize"]
    rep = subprocess.run(MINDSPEED_HA + ["report", *map(str, c.dirs), "--no-picture"], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert "data-parallel size 2 again: the interrupted resize undone" in rep.stdout, rep.stdout + rep.stderr
    steps = [e["iteration"] for e in events(c.dirs, "rank_0") if e["event"] == "step"]
    assert sorted(steps) == sorted(set(steps)) == list(range(1, ITERS + 1))
    assert_resized_losses(losses(c.dirs), losses(ref_dir), scaled_in[0]["iteration"], 1e-4)
    assert sample_hashes(c.dirs) == sample_hashes(ref_dir)


def eight_rank_reference(tmp_path, loop: str, *layout: str) -> tuple[list, dict, object]:
    """(flags, env, log dir) of a fault-free 8-rank run of ``layout`` through ``loop``, 40 iterations:
    what a drill on agents of the same ranks is compared with."""
    if loop == "megatron-lm" and not MLM_READY:
        pytest.skip(MLM_MISSING)
    base, env = (TINY, {}) if loop == "built-in" else (MLM_FLAGS, MLM_ENV)
    flags = [*base, *layout, "--train-iters", "40"]
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    assert_ok(subprocess.run(MINDSPEED_HA + ["run", "--standalone", "--nproc-per-node", "8", PRETRAIN, *flags,
                                            "--enable-high-availability", "--ha-log-dir", str(ref_dir)],
                             env=clean_env(env), capture_output=True, text=True, timeout=300, cwd=str(ref_dir)))
    return flags, env, ref_dir


MOE = ("--num-experts", "4", "--expert-model-parallel-size", "2")


@pytest.mark.parametrize("layout,gbs,kept,loop", [
    extended(("--tensor-model-parallel-size", "2"), "8", [[0, 1], [2, 3]], "built-in", id="tp2"),
    # (model parallelism's scale-in in CI: test_elastic's vpp2 and MoE drills)
    extended(MOE, "16", [[0], [1], [2], [3]], "built-in", id="moe"),
    extended(MOE, "16", [[0], [1], [2], [3]], "megatron-lm", id="moe-megatron-lm")], ids=["tp2", "moe", "moe-megatron-lm"])
def test_elastic_model_parallel_node_lost_and_back(tmp_path, keys, layout, gbs, kept, loop):
    """Two agents of four ranks, TP=2 x DP=4 or MoE (4 experts, EP=2) x DP=8: node 1 (whole
    replicas: with MoE, two blocks of the two replicas that hold every expert between them) is lost
    -> the job scales in to node 0, every rank keeping its TP position or its experts; its
    replacement comes -> the original layout again, the newcomers taking weights, shards, counters
    and RNG at their TP or expert-parallel position (MoE through Megatron-LM's loop too). Every
    iteration logged once with the fault-free run's samples; bit-identical before the loss, within
    the bound after it."""
    flags, env, ref_dir = eight_rank_reference(tmp_path, loop, *layout, "--global-batch-size", gbs)
    # rank 0 paces the job (8x its own step) so that node 1's replacement starts in time, until the scale-out
    c = Cluster(tmp_path, keys, free_port(), nproc=4, env={
        "HIGH_AVAILABILITY": "elastic-training", "MINDSPEED_HA_INJECT": "slow:rank=0:step=3:factor=8", **env})
    c.base = flags
    try:
        c.scaled_in_without_node_1()
        c.start(1)
        c.wait(lambda: c.controller("scaled_out"), "the scale-out", timeout=150)
        c.unpace(0)
        assert c.agents[0].wait(300) == 0, c.out(0)
        assert c.agents[1].wait(60) == 0, c.out(1)
    finally:
        c.close()
    scaled_in, scaled_out = c.controller("scaled_in"), c.controller("scaled_out")
    dp = len(kept)
    assert [(e["old_dp"], e["dp"], e["kept"], e["dropped"]) for e in scaled_in] == [(2 * dp, dp, kept, [4, 5, 6, 7])]
    assert [(e["old_dp"], e["dp"], e["added"]) for e in scaled_out] == [(dp, 2 * dp, [4, 5, 6, 7])]
    ref = losses(ref_dir)
    assert_resized_losses(losses(c.dirs), ref, scaled_in[0]["iteration"], 1e-4)
    assert sample_hashes(c.dirs) == sample_hashes(ref_dir)


# (in CI: a pipeline's scale-in, test_elastic's vpp2; Megatron-LM's loop's, test_megatron_lm's elastic drill)
@pytest.mark.parametrize("loop", [extended("built-in"), extended("megatron-lm")])
def test_elastic_pipeline_nodes_lost_and_back(tmp_path, keys, loop):
    """PP=2 x DP=4 on four agents of two ranks (megatron-core lays the stages outermost: nodes 0 and 1
    hold stage 0, nodes 2 and 3 stage 1). Node 3 is lost: replicas (2, 6) and (3, 7) lose their
    second stage, so ranks 2 and 3 leave with them, node 1's agent ends, and the job trains on as
    PP=2 x DP=2. Nodes 1 and 3 come back: the newcomers make whole replicas again and the job
    scales out to PP=2 x DP=4, each newcomer taking weights and shards of its stage and counters and
    RNG from the kept rank at its stage. Through both trainers (Megatron-LM's newcomers build their
    stage with its own set-up). Every iteration logged once with the fault-free run's samples;
    bit-identical before the loss, within the bound after it."""
    flags, env, ref_dir = eight_rank_reference(tmp_path, loop, "--pipeline-model-parallel-size", "2",
                                               "--global-batch-size", "8")
    # rank 0 paces the job (16x its own step) so that two nodes can start in time, until the scale-out
    c = Cluster(tmp_path, keys, free_port(), nnodes=4, env={
        "HIGH_AVAILABILITY": "elastic-training", "MINDSPEED_HA_INJECT": "slow:rank=0:step=3:factor=16", **env})
    c.base = flags
    try:
        for node in range(4):
            c.start(node)
        c.whole()
        c.wait(lambda: c.iteration(4) >= 3, "3 steps at DP=4")
        c.lose(3)
        c.wait(lambda: c.controller("scaled_in"), "the scale-in", timeout=120)
        assert c.agents[1].wait(60) == 0, c.out(1)  # (its ranks left the job)
        c.wait(lambda: c.iteration(4) >= c.controller("scaled_in")[-1]["iteration"] + 2, "2 steps at DP=2")
        c.start(1)
        c.start(3)
        c.wait(lambda: c.controller("scaled_out"), "the scale-out", timeout=150)
        c.unpace(0)
        for node in range(4):
            assert c.agents[node].wait(300) == 0, c.out(node)
    finally:
        c.close()
    scaled_in, scaled_out = c.controller("scaled_in"), c.controller("scaled_out")
    assert [(e["old_dp"], e["dp"], e["kept"], e["dropped"]) for e in scaled_in] == [
        (4, 2, [[0, 4], [1, 5]], [2, 3, 6, 7])]
    assert [(e["old_dp"], e["dp"], e["added"]) for e in scaled_out] == [(2, 4, [2, 3, 6, 7])]
    assert_resized_losses(losses(c.dirs), losses(ref_dir), scaled_in[0]["iteration"], 1e-4)
    assert sample_hashes(c.dirs) == sample_hashes(ref_dir)


@pytest.mark.parametrize("loop", ["built-in", extended("megatron-lm")])
def test_elastic_rank_0s_node_lost_a_standby_scales_the_job_in(tmp_path, keys, loop, request):
    """elastic-training only; node 0 — rank 0, which hosts the controller, and the agent serving the job
    store — is lost for good: the standby controller on node 1 takes over and scales the job in to
    ranks 2 and 3, which train to the end (rank 2 writes the losses now). Node 0 goes in the worst
    moment for the losses: step 11 has ended job-wide and rank 0 has not logged it yet; rank 2 does.
    Through both trainers."""
    ref = losses(request.getfixturevalue("ref_dir" if loop == "built-in" else "mlm_ref_dir"))
    c = Cluster(tmp_path, keys, free_port(), env={
        "HIGH_AVAILABILITY": "elastic-training",
        "MINDSPEED_HA_INJECT": "slow:rank=2:step=6:factor=4,hang:rank=0:step=11:phase=step-end",
        **(MLM_ENV if loop == "megatron-lm" else {})})
    c.base = [*(TINY if loop == "built-in" else MLM_FLAGS), "--train-iters", str(ITERS)]
    try:
        c.start(0)
        c.start(1)
        c.whole()
        c.wait(lambda: c.controller("standby"), "a standby controller")
        c.wait(lambda: any(e["event"] == "inject" and e["kind"] == "hang" for e in events(c.dirs, "rank_0")),
               "rank 0 between the end of step 11 and its log")
        c.lose(0)
        c.wait(lambda: c.controller("scaled_in"), "the scale-in", timeout=120)
        c.unpace(2, controller_node=1)
        assert c.agents[1].wait(300) == 0, c.out(1)
    finally:
        c.close()
    scaled = c.controller("scaled_in")
    assert [(e["old_dp"], e["dp"], e["kept"], e["dropped"]) for e in scaled] == [(4, 2, [[2], [3]], [0, 1])]
    assert_resized_losses(losses(c.dirs), ref, scaled[0]["iteration"], 1e-4)


@pytest.mark.parametrize("where", ["rank=2:step=7:phase=forward", extended("rank=2:step=7:phase=grad-sync", id="grad-sync")],
                         ids=["phases", "grad-sync"])
def test_a_frozen_node_replaced_then_thawed_finishes_bit_identical(tmp_path, keys, ref, where):
    """Node 1 freezes (SIGSTOP: silent, its sockets open) with rank 3 at the start of step 7's
    grad-sync and rank 2 at the start of its forward (ranks in different phases) or of its grad-sync
    too. The survivors run step 7's forward and backward and block in its gradient reduction. Node
    1's agent freezes too; a replacement node joins and its ranks are recovered from their twins (step
    7 recomputed); then the frozen workers are thawed (their agent 3 s later) and go on where they
    stopped, until the controller tells them to exit. Ranks thawed in their grad-sync complete the
    survivors' stopped reduction in the old communicators at once, while the survivors, slowed down
    from step 8 to 13, sit between zeroing their gradient buffer and their next backward. That must
    change nothing: the late result lands in no buffer of theirs (without that, one run in two of
    the second case diverged). Every loss bit-identical to the fault-free run's."""
    slow = ",".join(f"slow:rank={r}:step={s}:factor={f}" for r in (0, 1) for s, f in ((8, 5), (14, 1)))
    c = Cluster(tmp_path, keys, free_port(), env={
        "MINDSPEED_HA_INJECT": f"freeze:{where},freeze:rank=3:step=7:phase=grad-sync,{slow}"})
    frozen = []
    try:
        c.start(0)
        c.start(1)
        c.whole()
        c.wait(lambda: len([e for e in all_rank_events(c.node_dir[1]) if e["event"] == "inject"]) == 2,
               "both ranks of node 1 to freeze")
        frozen = [c.agents[1].pid, *_processes(c.node_dir[1], 1)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        old_agent = c.agents[1]
        c.env.pop("MINDSPEED_HA_INJECT")  # (the replacement's workers: no drill of their own)
        c.start(1)
        c.wait(lambda: c.controller("recovered"), "the replacement node's recovery")
        for pid in frozen[1:]:  # the workers first: they go on with step 7 before their agent can stop them
            os.kill(pid, signal.SIGCONT)
        time.sleep(3.0)
        os.kill(frozen[0], signal.SIGCONT)
        assert c.agents[0].wait(180) == 0, c.out(0)
        assert c.agents[1].wait(60) == 0, c.out(1)
        old_agent.wait(60)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        c.close()
    assert losses(c.dirs) == ref
