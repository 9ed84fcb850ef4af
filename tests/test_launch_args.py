"""`mindspeed-ha run`'s command line: torchrun's parser, its PET_* variables, Slurm's, and refusals
that name the flag. In process: nothing is launched."""
import pytest

from mindspeed_ha.launcher.args import LaunchError, build_parser, resolve

SCRIPT = ["train.py", "--enable-high-availability"]


def launch(argv, env=None):
    import os
    old = dict(os.environ)
    try:  # torchrun's parser reads PET_* defaults from the environment when it is built
        os.environ.clear()
        os.environ.update(env or {})
        return resolve(build_parser().parse_args(argv + SCRIPT), env or {})
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_torchrun_flags():
    a = launch(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4", "--master-addr", "10.0.0.1",
                "--master-port", "1234", "--rdzv-id", "job7", "--tee", "3", "--log-dir", "/x"])
    assert (a.nnodes, a.node_rank, a.nproc_per_node, a.master_addr, a.master_port, a.job_id) == \
        (2, 1, 4, "10.0.0.1", 1234, "job7")
    assert a.tee == "3" and a.log_dir == "/x" and a.script_args == ["--enable-high-availability"]
    assert a.cmd[-1] == "train.py"


def test_pet_variables_of_the_kubernetes_operator():
    a = launch([], {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "8",
                    "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"})
    assert (a.nnodes, a.node_rank, a.nproc_per_node, a.master_addr, a.master_port) == (3, 2, 8, "job-master-0", 23456)


def test_slurm_variables_and_what_wins_over_them():
    slurm = {"SLURM_JOB_ID": "99", "SLURM_NNODES": "4", "SLURM_NODEID": "3", "MASTER_ADDR": "n001",
             "MASTER_PORT": "29999"}
    a = launch(["--nproc-per-node", "2"], slurm)
    assert (a.nnodes, a.node_rank, a.master_addr, a.master_port, a.job_id) == (4, 3, "n001", 29999, "slurm-99")
    a = launch(["--nproc-per-node", "2", "--node-rank", "1"], {**slurm, "PET_NNODES": "2"})
    assert (a.nnodes, a.node_rank) == (2, 1)


def test_rdzv_endpoint_names_the_master_and_signals_the_preemption():
    a = launch(["--rdzv-backend", "c10d", "--rdzv-endpoint", "head:4000", "--signals-to-handle", "SIGTERM,SIGUSR1"])
    assert (a.master_addr, a.master_port) == ("head", 4000)
    assert [s.name for s in a.term_signals] == ["SIGTERM", "SIGUSR1"]


@pytest.mark.parametrize("argv, env, words", [
    (["--nnodes", "1:4"], {}, "--nnodes 1:4"),
    (["--nnodes", "2", "--node-rank", "2"], {}, "--node-rank 2"),
    (["--rdzv-backend", "etcd"], {}, "--rdzv-backend etcd"),
    (["--signals-to-handle", "SIGNOPE"], {}, "--signals-to-handle"),
    (["--run-path"], {}, "--run-path"),
    ([], {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "0"}, "MASTER_ADDR"),
])
def test_refusals_name_the_flag(argv, env, words):
    with pytest.raises(LaunchError, match=words.replace("[", r"\[")):
        launch(argv, env)


def test_node_network_on_loopback_and_without_a_route():
    """On loopback a job stays there; a master address with no IPv4 route here (unresolvable) falls
    back to what the host name says, with a note for the log, never a traceback."""
    from mindspeed_ha.launcher.network import node_network
    assert node_network("127.0.0.1", {}) == ("127.0.0.1", {}, "")
    host, env, note = node_network("no-such-host.invalid", {})
    assert host and env == {} and "no IPv4 route to the master address no-such-host.invalid" in note
