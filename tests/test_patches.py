"""Patch registry: one place, idempotent, removable; device selection."""
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.compat  # (the CPU shim and device detection, on every torch CI tests)

from mindspeed_ha.device import Device, DeviceError, detect


def run_py(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_apply_is_idempotent_and_remove_restores():
    # In a subprocess: the CPU shim changes process-wide torch state.
    out = run_py(
        "import torch, mindspeed_ha.patches as p\n"
        "orig = torch.cuda.current_device\n"
        "assert p.apply('torch_cpu') is True and p.apply('torch_cpu') is False\n"
        "t = torch.zeros(2, device='cuda')\n"
        "assert t.device.type == 'cpu' and t.type() == 'torch.cuda.FloatTensor'\n"
        "assert not torch.cuda.is_available() and torch.cuda.current_device() == torch.device('cpu')\n"
        "p.remove_all()\n"
        "assert torch.cuda.current_device is orig and p.applied() == set()\n"
        "assert torch.zeros(1).type() == 'torch.FloatTensor'\n"
        "try:\n    torch.zeros(1, device='cuda'); print('still patched')\n"
        "except (AssertionError, RuntimeError):\n    print('restored')\n")
    assert out == "restored"


def test_megatron_adaptor_applies_everything_once():
    out = run_py(
        "import mindspeed_ha.megatron_adaptor, mindspeed_ha.patches\n"
        "import mindspeed_ha.megatron_adaptor\n"
        "import megatron.core.optimizer\n"
        "print(sorted(mindspeed_ha.patches.applied()),\n"
        "      hasattr(megatron.core.optimizer.get_megatron_optimizer, '__wrapped__'))")
    assert "'replica_optimizer'" in out and "'torch_cpu'" in out and out.endswith("True")


def test_patch_modules_installed_under_mindspeed_ha():
    import importlib

    from mindspeed_ha import patches
    for group, module in patches.GROUPS.items():
        assert module.startswith("mindspeed_ha.patches")
        if group != "megatron_training":
            importlib.import_module(module)


@pytest.mark.parametrize("env,kind", [({}, "cpu"), ({"MINDSPEED_HA_DEVICE": "cpu"}, "cpu"),
                                      ({"MINDSPEED_HA_DEVICE": " CPU "}, "cpu")])
def test_device_detect(env, kind):
    d = detect(env)
    assert d.kind == kind and d.backend == "gloo" and d.needs_cpu_shim


@pytest.mark.parametrize("value,needle", [("tpu", "not a device"), ("npu", "torch_npu is not importable"),
                                          ("cuda", "no CUDA device")])
def test_device_override_errors(value, needle):
    if value == "cuda" and torch.cuda.device_count() > 0:
        pytest.skip("a CUDA device is present")
    with pytest.raises(DeviceError, match=needle):
        detect({"MINDSPEED_HA_DEVICE": value})


@pytest.mark.parametrize("visible,local,env,ok", [
    (1, 1, {}, True), (8, 8, {}, True), (1, 2, {}, False), (2, 4, {"CUDA_VISIBLE_DEVICES": "0,1"}, False),
    (1, 2, {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, "nccl>=2.30")])
def test_more_local_ranks_than_gpus_is_refused_naming_the_flag(monkeypatch, visible, local, env, ok):
    from mindspeed_ha import compat
    monkeypatch.setattr(compat, "cuda_device_count", lambda: visible)
    monkeypatch.setattr(compat, "nccl_version", lambda: (2, 27, 3))  # below 2.30: no sharing a GPU
    if ok is True:
        Device("cuda").check_local_ranks(local, env)
        return
    with pytest.raises(DeviceError) as e:
        Device("cuda").check_local_ranks(local, env)
    text = str(e.value)
    assert f"--nproc-per-node {local} starts {local} ranks" in text and f"{visible} CUDA device(s) are visible" in text
    assert f"--nproc-per-node {visible}" in text and "CUDA_VISIBLE_DEVICES" in text
    assert ("CUDA_VISIBLE_DEVICES=0,1" in text) == ("CUDA_VISIBLE_DEVICES" in env)
    assert "NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1" in text and "this NCCL is 2.27.3" in text
    monkeypatch.setattr(compat, "nccl_version", lambda: (2, 30, 1))
    if ok == "nccl>=2.30":  # then ranks may share the GPU
        Device("cuda").check_local_ranks(local, env)
        assert Device("cuda").torch_device(1) == torch.device("cuda", 0)


def test_ranks_may_share_a_gpu_under_any_nccl_as_nccl_hosts_of_their_own(monkeypatch):
    """MINDSPEED_HA_NCCL_HOST_PER_RANK=1 (a drill on a one-GPU machine): the refusal names it, and with
    it the ranks share the GPU; each process then gets an NCCL_HOSTID of its own before its first NCCL
    call, and NCCL's socket transport on the loopback unless the user chose another."""
    from mindspeed_ha import compat
    from mindspeed_ha.device import HOST_PER_RANK_ENV, own_nccl_host
    monkeypatch.setattr(compat, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(compat, "nccl_version", lambda: (2, 28, 9))
    with pytest.raises(DeviceError, match=f"{HOST_PER_RANK_ENV}=1: each rank an NCCL host of its own"):
        Device("cuda").check_local_ranks(4, {})
    Device("cuda").check_local_ranks(4, {HOST_PER_RANK_ENV: "1"})
    env = {"NCCL_SOCKET_IFNAME": "eth0"}
    own_nccl_host(3, env)
    assert env["NCCL_HOSTID"].endswith("-rank3") and env["NCCL_NET"] == "Socket" and env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"  # (the user's)
    other = {}
    own_nccl_host(2, other)
    assert other["NCCL_HOSTID"] != env["NCCL_HOSTID"] and other["NCCL_SOCKET_IFNAME"] == "lo"


def test_nccl_communicators_are_made_to_be_aborted_by_the_engine(caplog):
    """With HA on, before any group: the watchdog only marks a failed collective's work (a user's 1 or
    3, which end survivors, are replaced and said; a user's 2 is kept), communicators are torch's
    default, blocking (not set: a user's non-blocking is theirs), connected at set-up, NVLS off, the legacy ProcessGroupNCCL on torch 2.15; a user's own value
    of any of those is kept."""
    from mindspeed_ha.device.backends import NCCL_DEFAULTS, nccl_environment
    env = {}
    got = nccl_environment(env)
    assert got == dict(NCCL_DEFAULTS) == env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and "TORCH_NCCL_USE_COMM_NONBLOCKING" not in env
    assert env["NCCL_RUNTIME_CONNECT"] == "0" and env["TORCH_DIST_USE_NCCL2"] == "0"
    users = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "NCCL_RUNTIME_CONNECT": "1"}
    with caplog.at_level("WARNING"):
        got = nccl_environment(users)
    assert got["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and got["NCCL_RUNTIME_CONNECT"] == "1"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 would end a survivor" in caplog.text
    assert nccl_environment({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    with caplog.at_level("WARNING"):
        got = nccl_environment({"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"})
    assert got["TORCH_NCCL_USE_COMM_NONBLOCKING"] == "1"  # (a user's non-blocking is kept, and its risk said)
    assert "TORCH_NCCL_USE_COMM_NONBLOCKING=1 kept" in caplog.text and "TORCH_NCCL_NONBLOCKING_TIMEOUT" in caplog.text


def test_cpu_never_refuses_local_ranks():
    Device("cpu").check_local_ranks(64, {})


def test_backends():
    assert [Device(k).backend for k in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
