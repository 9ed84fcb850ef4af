"""Every tensor the engine creates names its device.

On a GPU a tensor made without ``device=`` lands on the CPU: an NCCL collective over it fails ("No
backend type associated with device type cpu") and an op that meets device tensors raises. CI has
no GPU to catch that, so the source is read instead: each torch factory call in ``mindspeed_ha/`` and
``patches/`` must say where its tensor lives (``device=current()``, or ``device="cpu"`` where the CPU
is meant), or be moved at once (``.to(...)``).
"""
import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.compat

REPO = Path(__file__).resolve().parents[1]
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "eye", "rand",
             "randn", "randint", "randperm", "empty_strided"}
CPU_ONLY = {"from_numpy", "frombuffer"}  # CPU by definition: fine only when moved at once
MOVES = {"to", "cuda", "npu"}


def undeclared(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        name = node.func.attr
        if name not in FACTORIES | CPU_ONLY:
            continue
        moved = isinstance(parent.get(node), ast.Attribute) and parent[node].attr in MOVES
        named = name in FACTORIES and any(k.arg == "device" for k in node.keywords)
        if not (named or moved):
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            found.append(f"{where}:{node.lineno}: torch.{name}(...) names no device")
    return found


def test_every_tensor_the_engine_creates_names_its_device():
    found = [f for root in ("mindspeed_ha", "patches") for p in sorted((REPO / root).rglob("*.py"))
             for f in undeclared(p)]
    assert not found, "\n".join(found)


def test_the_check_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "sample.py"
    bad.write_text("import torch\n"
                   "a = torch.tensor([1])\n"                   # caught
                   "b = torch.zeros(2, device='cpu')\n"        # named
                   "c = torch.from_numpy(x)\n"                  # caught
                   "d = torch.from_numpy(x).to(dev)\n"         # moved
                   "e = torch.empty(3).to(dev)\n")             # moved
    assert [f.split(": ", 1)[0].rsplit(":", 1)[1] for f in undeclared(bad)] == ["2", "4"]
