"""The megatron-core releases mindspeed-ha runs on: which one the process imports, and the refusal of
one outside the supported range (before anything is built). The drills of every strategy on each
release CI tests are the tests marked ``megatron_release`` (docs/gpus.md)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import PRETRAIN, TINY, clean_env

pytestmark = pytest.mark.compat  # (on every torch CI tests, and on every megatron-core release)


def test_the_release_is_the_one_imported_not_the_one_pip_installed():
    """A Megatron-LM checkout on the path carries its own megatron.core, whatever pip installed beside
    it: the release is read from the imported package's package_info."""
    from importlib import metadata

    from megatron.core import package_info

    from mindspeed_ha import compat
    assert compat.megatron_core() == (package_info.MAJOR, package_info.MINOR, package_info.PATCH)
    if not os.environ.get("PYTHONPATH"):  # (an installed release: pip says the same)
        assert compat.megatron_core_version() == metadata.version("megatron-core")


@pytest.mark.parametrize("release,needle", [
    ((0, 11, 0), "megatron-core 0.11.0 is older than the releases mindspeed-ha supports"),
    ((0, 12, 0), "megatron-core 0.12.0 is older than the releases mindspeed-ha supports"),
    ((0, 20, 0), "megatron-core 0.20.0 is newer than any release mindspeed-ha has run on")])
def test_a_release_outside_the_range_is_refused_in_one_line(monkeypatch, release, needle):
    from mindspeed_ha import compat
    monkeypatch.setattr(compat, "megatron_core", lambda: release)
    monkeypatch.delenv(compat.UNTESTED_MEGATRON_CORE_ENV, raising=False)
    with pytest.raises(compat.CompatError) as e:
        compat.check()
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
    assert "supports megatron-core 0.12.1 to 0.19.x" in msg and "megatron-core>=0.12.1,<0.20" in msg, msg


def test_a_newer_release_may_be_tried_at_the_users_risk(monkeypatch):
    from mindspeed_ha import compat
    monkeypatch.setattr(compat, "megatron_core", lambda: (0, 20, 0))
    monkeypatch.setattr(compat, "_missing_megatron", lambda: [])  # (what this install has, read as 0.20's)
    monkeypatch.setenv(compat.UNTESTED_MEGATRON_CORE_ENV, "1")
    with pytest.warns(UserWarning, match="megatron-core 0.20.0 is not a tested combination"):
        compat.check()


def test_a_job_on_a_release_outside_the_range_ends_before_anything_trains(tmp_path):
    """The installed megatron-core laid out again as release 0.11.0 (its package_info changed), first
    on the path: a rank refuses it in one line (exit 2) before any model is built."""
    import megatron.core
    root = tmp_path / "mc"
    shutil.copytree(os.path.dirname(megatron.core.__file__), root / "megatron" / "core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    info = root / "megatron" / "core" / "package_info.py"
    text = info.read_text()
    for key, value in (("MAJOR", 0), ("MINOR", 11), ("PATCH", 0)):
        text = "\n".join(f"{key} = {value}" if line.startswith(f"{key} = ") else line for line in text.splitlines())
    info.write_text(text + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", PRETRAIN, *TINY,
           "--train-iters", "2", "--enable-high-availability", "--ha-log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, env=clean_env({"PYTHONPATH": str(root)}), capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    # (each rank refuses it; the first to exit has torchrun end the other, which may not have printed yet)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("mindspeed-ha: error")]
    assert proc.returncode != 0 and lines, proc.stderr[-3000:]
    assert all("megatron-core 0.11.0 is older than the releases mindspeed-ha supports" in ln for ln in lines), lines
    assert not [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank") and "Traceback" in ln], \
        proc.stderr[-3000:]  # (torchrun's own traceback of the failed workers is its own)
    assert not (tmp_path / "logs" / "events").exists() or not any(
        '"step"' in p.read_text() for p in (tmp_path / "logs" / "events").glob("rank_*.jsonl"))
