"""The control plane's four rooms and the one direction between them, read from the source:

    wire <- controller -> strategies -> policy

policy imports nothing else of control/; wire imports nothing else of control/; the strategies import
the policy (the state machine's round runner, the ledger); the controller imports the wire, the
strategies and the policy. Of its clients, the rank's processor (rank/processor/) imports only the wire
(it is handed the controller as a factory), and so does launcher code. Every import counts: inside
functions and under TYPE_CHECKING too.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOMS = ("wire", "policy", "strategies", "controller")
# room -> the other rooms of control/ it may import
MAY_IMPORT = {"wire": set(), "policy": set(), "strategies": {"policy"}, "controller": {"wire", "policy", "strategies"}}
# the control plane's clients outside control/ (a package -> the rooms of control/ its modules may import)
CLIENTS_MAY_IMPORT = {"mindspeed_ha.rank.processor": {"wire"}, "mindspeed_ha.launcher": {"wire"}}


def _module_name(path: str, root: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imported(module: str, is_package: bool, node: ast.AST) -> list[str]:
    """The dotted names an import node brings in (relative ones resolved against ``module``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def _room(name: str) -> str | None:
    """The room of control/ a dotted name lies in ("" for control/ itself), None outside control/."""
    prefix = "mindspeed_ha.control"
    if name != prefix and not name.startswith(prefix + "."):
        return None
    rest = name[len(prefix) + 1:].split(".")[0] if name != prefix else ""
    return rest if rest in ROOMS else ""


def violations(root: str) -> list[str]:
    """Every import against the direction, as "module imports name" lines."""
    package = os.path.join(root, "mindspeed_ha")
    found = []
    for dirpath, _, files in os.walk(package):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            module = _module_name(path, root)
            here = _room(module)
            client = next((c for c in CLIENTS_MAY_IMPORT if module == c or module.startswith(c + ".")), None)
            if here is None and client is None:
                continue
            tree = ast.parse(open(path).read(), path)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                for name in _imported(module, f == "__init__.py", node):
                    there = _room(name)
                    if there is None or there == here:
                        continue
                    if client is not None:
                        allowed = there in CLIENTS_MAY_IMPORT[client]
                    elif here == "":  # control/__init__: the rooms' common door imports none of them
                        allowed = False
                    else:
                        allowed = there in MAY_IMPORT[here]
                    if not allowed:
                        found.append(f"{module} imports {name}")
    return sorted(set(found))


def test_control_plane_imports_go_one_way():
    control = os.path.join(ROOT, "mindspeed_ha", "control")
    for room in ROOMS:
        assert os.path.isfile(os.path.join(control, room, "__init__.py")), room
    flat = [f for f in os.listdir(control) if f.endswith(".py")]
    assert flat == ["__init__.py"], f"control/ holds only its sub-packages: {flat}"
    rooms = sorted(d for d in os.listdir(control) if os.path.isfile(os.path.join(control, d, "__init__.py")))
    assert rooms == sorted(ROOMS), f"control/ holds only its four sub-packages: {rooms}"
    assert violations(ROOT) == []


def test_the_check_finds_an_import_against_the_direction(tmp_path):
    """A policy module that imports the wire, a module of the rank's processor that imports the
    controller or the policy, a wire module that imports the policy (even under TYPE_CHECKING), a
    launcher module that imports the controller: each is named."""
    control = tmp_path / "mindspeed_ha" / "control"
    for room in ROOMS:
        (control / room).mkdir(parents=True)
        (control / room / "__init__.py").write_text("")
    (control / "__init__.py").write_text("")
    (tmp_path / "mindspeed_ha" / "__init__.py").write_text("")
    (tmp_path / "mindspeed_ha" / "launcher").mkdir()
    (tmp_path / "mindspeed_ha" / "rank" / "processor").mkdir(parents=True)
    (control / "policy" / "rules.py").write_text("from ..wire import protocol\n")
    (tmp_path / "mindspeed_ha" / "rank" / "processor" / "client.py").write_text(
        "from ...control.wire import link\nfrom ...control.policy import ranks\n"
        "def make():\n    from mindspeed_ha.control.controller import Controller\n")
    (control / "wire" / "link.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from ..policy.ranks import Rank\n")
    (control / "controller" / "main.py").write_text("from ..policy import states\nfrom ..wire import router\n"
                                                    "from ..strategies import retry\n")
    (control / "strategies" / "retry.py").write_text("from ..policy import rounds\nfrom ..controller import main\n")
    (tmp_path / "mindspeed_ha" / "launcher" / "agent.py").write_text("from ..control.controller import main\n"
                                                                      "from ..control.wire import link\n")
    assert violations(str(tmp_path)) == [
        "mindspeed_ha.control.policy.rules imports mindspeed_ha.control.wire",
        "mindspeed_ha.control.policy.rules imports mindspeed_ha.control.wire.protocol",
        "mindspeed_ha.control.strategies.retry imports mindspeed_ha.control.controller",
        "mindspeed_ha.control.strategies.retry imports mindspeed_ha.control.controller.main",
        "mindspeed_ha.control.wire.link imports mindspeed_ha.control.policy.ranks",
        "mindspeed_ha.control.wire.link imports mindspeed_ha.control.policy.ranks.Rank",
        "mindspeed_ha.launcher.agent imports mindspeed_ha.control.controller",
        "mindspeed_ha.launcher.agent imports mindspeed_ha.control.controller.main",
        "mindspeed_ha.rank.processor.client imports mindspeed_ha.control.controller",
        "mindspeed_ha.rank.processor.client imports mindspeed_ha.control.controller.Controller",
        "mindspeed_ha.rank.processor.client imports mindspeed_ha.control.policy",
        "mindspeed_ha.rank.processor.client imports mindspeed_ha.control.policy.ranks",
    ]
