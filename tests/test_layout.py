"""Bad parallel layouts are refused before any model is built, naming flags and proposing a layout."""
import pytest

from helpers import TINY, torchrun
from mindspeed_ha.layout import validate
from mindspeed_ha.options import HAConfigError, from_args
from mindspeed_ha.trainer.args import build_parser, finalize


def check(world, argv):
    args = finalize(build_parser().parse_args(argv), world)
    validate(world, args, from_args(args, {}))


def test_good_layouts_pass():
    check(4, ["--enable-high-availability", "--use-distributed-optimizer"])
    check(8, ["--enable-high-availability", "--use-distributed-optimizer", "--tensor-model-parallel-size", "2"])
    check(4, ["--enable-high-availability", "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"])
    check(2, ["--tensor-model-parallel-size", "2"])  # HA off: anything megatron accepts


@pytest.mark.parametrize("world,argv,needles", [
    (4, ["--tensor-model-parallel-size", "4"],
     ["data-parallel x context-parallel size must be at least 2", "--tensor-model-parallel-size 4",
      "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 (DP=2)"]),
    (6, ["--tensor-model-parallel-size", "2"],
     ["divisible by --optimizer-replica-num 2", "it is 3", "(DP=2)"]),
    (12, ["--optimizer-replica-num", "3", "--tensor-model-parallel-size", "3", "--num-attention-heads", "6"], ["--optimizer-replica-num 3", "it is 4", "(DP=3)"]),
    (8, ["--optimizer-replica-num", "3"], ["no layout of 8 ranks", "multiple of 3"]),
    (3, [], ["no layout of 3 ranks", "--distributed-optimizer-no-replica"]),
    (8, ["--num-experts", "4", "--expert-model-parallel-size", "8", "--tensor-model-parallel-size", "1"],
     ["expert data-parallel size is 1", "--expert-model-parallel-size 4"]),
])
def test_bad_layouts(world, argv, needles):
    with pytest.raises(HAConfigError) as e:
        check(world, ["--enable-high-availability", "--use-distributed-optimizer", *argv])
    for n in needles:
        assert n in str(e.value), str(e.value)


@pytest.mark.parametrize("argv,needle", [
    (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], "add --pipeline-model-parallel-size 2"),
    (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "each of the 2 pipeline stages holds 2 layers"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
     "a divisor of 3 smaller than it"),
])
def test_bad_interleaved_pipelines(argv, needle):
    from mindspeed_ha.trainer.args import ArgError
    with pytest.raises(ArgError, match=needle):
        check(4, ["--use-distributed-optimizer", *argv])
    args = finalize(build_parser().parse_args(["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                                               "--num-layers-per-virtual-pipeline-stage", "2"]), 4)
    assert args.virtual_pipeline_model_parallel_size == 2


def test_elastic_refuses_layouts_it_cannot_shrink():
    """Context parallelism is refused; MoE is accepted while its experts are split like the dense
    layers (a replica's experts then stay on it), and refused with an expert-TP size of its own."""
    elastic = ["--enable-elastic-training", "--use-distributed-optimizer"]
    with pytest.raises(HAConfigError, match="elastic scale-in keeps every TP/PP position"):
        check(8, [*elastic, "--context-parallel-size", "2"])
    moe = [*elastic, "--num-experts", "4", "--expert-model-parallel-size", "2"]
    check(8, moe)
    check(8, [*elastic, "--pipeline-model-parallel-size", "2"])
    args = finalize(build_parser().parse_args([*moe, "--tensor-model-parallel-size", "2"]), 8)
    args.expert_tensor_parallel_size = 1  # (Megatron-LM's flag; the built-in trainer has none)
    with pytest.raises(HAConfigError, match="drop --expert-tensor-parallel-size 1"):
        validate(8, args, from_args(args, {}))


def test_replica_needs_distributed_optimizer():
    with pytest.raises(HAConfigError, match="--use-distributed-optimizer"):
        args = finalize(build_parser().parse_args(["--enable-high-availability"]), 4)
        validate(4, args, from_args(args, {}))


def test_same_message_on_every_rank_no_traceback(tmp_path):
    args = [a for a in TINY] + ["--train-iters", "2", "--enable-high-availability", "--tensor-model-parallel-size", "4"]
    proc = torchrun(4, args, tmp_path, timeout=120)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if "mindspeed-ha: error" in l]
    # (torchrun ends the others once one exits: on a loaded host a rank can go before it has printed)
    assert 1 <= len(lines) <= 4, proc.stderr[-3000:]
    assert len({l.split("): ", 1)[1] for l in lines}) == 1  # identical text on every rank that printed
    # torchrun prints its own ChildFailedError; the workers print no traceback of theirs
    assert 'pretrain_gpt.py", line' not in proc.stderr and "HAConfigError" not in proc.stderr


@pytest.mark.parametrize("argv,env,needle", [
    (["--save", "{blocker}/ck"], {}, "--save {blocker}/ck: cannot write there"),
    (["--ha-log-dir", "{blocker}/logs"], {}, "--ha-log-dir {blocker}/logs: cannot write there"),
    (["--ha-key-dir", "{blocker}/keys"], {}, "--ha-key-dir {blocker}/keys: not a directory"),
    (["--ha-heartbeat-interval", "nan"], {}, "--ha-heartbeat-interval nan"),
    ([], {"HIGH_AVAILABILITY": ","}, "HIGH_AVAILABILITY=',' names no strategy"),
    ([], {"MINDSPEED_HA_INJECT": "kill:rank=9:step=1"}, "there is no rank 9 in a job of 2 ranks"),
    ([], {"MINDSPEED_HA_INJECT": "cuda-illegal-address:rank=0:step=1"}, "needs a CUDA device, and this rank trains on cpu"),
    ([], {"MINDSPEED_HA_INJECT": "held:rank=0:step=1", "MINDSPEED_HA_EMULATE_NCCL": "0"},
     "needs a stream-ordered backend (NCCL, HCCL), and this rank's collectives run on gloo"),
    (["--overlap-grad-reduce", "--overlap-param-gather"], {"MINDSPEED_HA_INJECT": "kill:rank=1:step=1:phase=param-sync"},
     "phase param-sync never comes in this layout, --overlap-param-gather"),
])
def test_bad_input_refused_on_every_rank_before_any_model(tmp_path, argv, env, needle):
    """Refused before anything is built (no rendezvous: each rank runs on its own here), with the flag
    or variable named, the same on every rank, exit 2, no traceback."""
    import subprocess
    import sys
    from helpers import PRETRAIN, clean_env
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = [a.format(blocker=blocker) for a in argv]
    cmd = [sys.executable, PRETRAIN, *TINY, "--train-iters", "2", "--enable-high-availability",
           "--ha-log-dir", str(tmp_path / "log"), *argv]
    procs = [subprocess.run(cmd, env=clean_env({**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}),
                            capture_output=True, text=True, timeout=120) for r in (0, 1)]
    for r, proc in enumerate(procs):
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip() == f"mindspeed-ha: error (rank {r}): " + proc.stderr.split("): ", 1)[1].strip()
        assert needle.format(blocker=blocker) in proc.stderr and "Traceback" not in proc.stderr


def test_mindspeed_ha_run_ends_with_the_workers_refusal(tmp_path):
    """Under `mindspeed-ha run` a layout the ranks refuse ends the job with their code, 2 (a flag to
    fix, do not restart), not with a fault's 1: the agent, with no controller to ask, ends with it."""
    import subprocess
    import sys
    from helpers import PRETRAIN, clean_env
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "2", PRETRAIN, *TINY,
           "--train-iters", "2", "--enable-high-availability", "--tensor-model-parallel-size", "4",
           "--ha-log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "mindspeed-ha: error (rank 0)" in proc.stderr and "--tensor-model-parallel-size" in proc.stderr


@pytest.mark.parametrize("flag,needle", [("--ha-log-dir", "cannot write there"), ("--ha-key-dir", "not a directory")])
def test_mindspeed_ha_run_refuses_a_directory_it_cannot_make(tmp_path, flag, needle):
    """A log or key directory under a file: `mindspeed-ha run` itself says so, naming the flag and the
    path, exit 2, no traceback (it writes its logs and reads the keys before any worker starts)."""
    import subprocess
    import sys
    from helpers import PRETRAIN, clean_env
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = [flag, str(blocker / "d")] + (["--ha-log-dir", str(tmp_path / "logs")] if flag != "--ha-log-dir" else [])
    cmd = [sys.executable, "-m", "mindspeed_ha.cli", "run", "--standalone", "--nproc-per-node", "2", PRETRAIN, *TINY,
           "--train-iters", "2", "--enable-high-availability", *argv]
    proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{flag} {blocker / 'd'}: {needle}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
