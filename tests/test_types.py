"""The type checker: mypy over the whole package, with strict flags where the recovery's logic lives
(the controller, the recovery handlers, the planner, the replica optimizer; setup.cfg says which)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mypy_finds_no_type_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mypy", "-p", "mindspeed_ha", "--cache-dir", str(tmp_path / "cache")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout


def test_the_strict_modules_are_checked_strictly(tmp_path):
    """The strict flags reach the controller's package: an unannotated function there is an error."""
    pkg = tmp_path / "mindspeed_ha" / "control"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text("def untyped(x):\n    return x\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "setup.cfg"),
                           "--cache-dir", str(tmp_path / "cache"), "-p", "mindspeed_ha.control.probe"],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "no-untyped-def" in proc.stdout, proc.stdout + proc.stderr
