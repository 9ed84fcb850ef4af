"""Patch registry: one place, idempotent, removable; device selection."""
import subprocess
import sys

import pytest
import torch

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
        "import mindspeed_ha.megatron_adaptor, mindspeed_ha.patches as p\n"
        "import mindspeed_ha.megatron_adaptor\n"
        "import megatron.core.optimizer as o\n"
        "print(sorted(p.applied()), hasattr(o.get_megatron_optimizer, '__wrapped__'))")
    assert "'replica_optimizer'" in out and "'torch_cpu'" in out and out.endswith("True")


def test_patch_modules_installed_under_mindspeed_ha():
    import mindspeed_ha.patches as p
    import importlib
    for group, module in p.GROUPS.items():
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


def test_backends():
    assert [Device(k).backend for k in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
