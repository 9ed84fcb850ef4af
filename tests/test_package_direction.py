"""The package's rooms and the one direction between them, read from the source (every import counts:
inside functions and under TYPE_CHECKING too).

Tiers, top to bottom: a room may import the rooms of the tiers below its own, never one above, never
another room of its own tier. control/'s three rooms keep their own direction too, and the rank's
processor takes only the wire of them (tests/test_control_layout.py); here they are placed among the
others. No module imports itself back through others (no import cycle).
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TIERS = (
    ("patches.targets",),                         # the patches: set into torch and megatron, nothing imports them
    ("cli", "megatron_adaptor"),                  # entry points
    ("megatron_lm",),                             # Megatron-LM's loop, adapted
    ("trainer",),                                 # the built-in trainer (and its main)
    ("launcher",),                                # the node agents, the spare template
    ("adaptor",),                                 # installs the patches
    ("rank.session",),                            # the rank runtime: the trainers' hooks
    ("rank.fault_loop", "rank.replicas"),         # ... a fault's loop; the replica optimizer wired in
    ("rank.recovery",),                           # ... each recovery order, on the engine's calls
    ("rank.state",),                              # ... the rank's state
    ("rank.processor", "control.controller"),     # ... the rank's processor; the control plane's controller
    ("control.strategies",),                      # ... the strategies, one file each, and their registry
    ("control.policy", "control.wire"),           # ... its rules, its wire
    ("trainer_state", "inject"),                  # a trainer's state (checkpoints, RNG); fault drills
    ("replica", "plan", "layout", "report", "process"),
    ("comm",),                                    # stable groups, the stop, interruptible collectives
    ("device",),
    ("compat", "faults"),
    ("events", "options", "exitcodes", "patches"),  # (patches: the registry the adaptor applies them from)
)
TIER = {room: i for i, rooms in enumerate(TIERS) for room in rooms}
SPLIT = {"control", "rank"}  # packages whose subpackages and modules are rooms of their own


def _modules(root: str) -> dict[str, str]:
    """Dotted module name -> path, for the package and its patches (installed as mindspeed_ha.patches)."""
    out = {}
    for top, prefix in (("mindspeed_ha", "mindspeed_ha"), ("patches", "mindspeed_ha.patches")):
        base = os.path.join(root, top)
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                    name = prefix if rel == "__init__" else f"{prefix}.{rel.removesuffix('.__init__')}"
                    out[name] = os.path.join(dirpath, f)
    return out


def room(name: str) -> str | None:
    """The room of a dotted module name (None: the package itself, control/ and rank/ themselves (their
    ``__init__`` imports nothing: ``violations`` says so), or not ours)."""
    parts = name.split(".")
    if parts[0] != "mindspeed_ha" or len(parts) < 2:
        return None
    if parts[1] in SPLIT:
        return f"{parts[1]}.{parts[2]}" if len(parts) > 2 else None
    if parts[1] == "patches" and len(parts) > 2:
        return "patches.targets"
    return parts[1]


def imports(modules: dict[str, str], name: str, path: str) -> set[str]:
    """The package's modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            found.update(subs or [base])
    return {m for m in found if m in modules and m != name}


def violations(root: str) -> list[str]:
    """Every import against the direction, as "module imports name (why)" lines."""
    modules = _modules(root)
    found = []
    for name, path in sorted(modules.items()):
        here = room(name)
        if name.split(".")[-1] in SPLIT and name.count(".") == 1:
            found += [f"{name} imports {target} (a package whose rooms are its parts imports none)"
                      for target in sorted(imports(modules, name, path))]
        if here is None:
            continue
        for target in sorted(imports(modules, name, path)):
            there = room(target)
            if there is None or there == here:
                continue
            if here not in TIER or there not in TIER:
                found.append(f"{name} imports {target} (a room no tier names: {here if here not in TIER else there})")
            elif TIER[there] < TIER[here]:
                found.append(f"{name} imports {target} (upward: {here} -> {there})")
            elif TIER[there] == TIER[here]:
                found.append(f"{name} imports {target} (sideways in one tier: {here} -> {there})")
    return found


def cycles(root: str) -> list[list[str]]:
    """Import cycles between modules (each as the modules around it)."""
    modules = _modules(root)
    graph = {name: imports(modules, name, path) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_room_of_the_package_is_placed():
    rooms = {room(name) for name in _modules(ROOT)} - {None}
    assert sorted(rooms - set(TIER)) == []
    assert sorted(set(TIER) - rooms) == []


def test_imports_go_one_way():
    assert violations(ROOT) == []


def test_no_import_cycle():
    assert cycles(ROOT) == []


def test_the_check_finds_an_import_against_the_direction_and_a_cycle(tmp_path):
    """A copy with one upward import (the rank's state importing its session, which imports it): both
    checks find it."""
    for top in ("mindspeed_ha", "patches"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            rel = os.path.relpath(dirpath, ROOT)
            os.makedirs(tmp_path / rel, exist_ok=True)
            for f in files:
                if f.endswith(".py"):
                    (tmp_path / rel / f).write_text(open(os.path.join(dirpath, f)).read())
    state = tmp_path / "mindspeed_ha" / "rank" / "state.py"
    state.write_text(state.read_text() + "\n\ndef _upward():\n    from mindspeed_ha.rank.session import current\n")
    assert violations(str(tmp_path)) == [
        "mindspeed_ha.rank.state imports mindspeed_ha.rank.session (upward: rank.state -> rank.session)"]
    assert ["mindspeed_ha.rank.session", "mindspeed_ha.rank.state"] in [
        [m for m in c if m.startswith("mindspeed_ha.rank.s")] for c in cycles(str(tmp_path))]


# The rank side (its runtime, the rank's processor, the stop) and the trainers above it: classes small
# enough to read in one sitting, each with one role.
RANK_SIDE = ("mindspeed_ha/rank", "mindspeed_ha/comm/stop.py", "mindspeed_ha/trainer", "mindspeed_ha/megatron_lm")
# ... and the control plane and the devices: the controller, each strategy, each accelerator.
CONTROL_AND_DEVICES = ("mindspeed_ha/control", "mindspeed_ha/device")
MAX_CLASS_LINES = 300


def _classes_over(limit: int, places) -> list[str]:
    found = []
    for place in places:
        path = os.path.join(ROOT, place)
        files = [path] if path.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(path)
                                                     for f in fs if f.endswith(".py")]
        for f in files:
            for node in ast.walk(ast.parse(open(f).read(), f)):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit:
                    found.append(f"{os.path.relpath(f, ROOT)}:{node.name} {node.end_lineno - node.lineno + 1} lines")
    return found


def test_no_class_of_the_rank_side_or_the_trainers_is_over_300_lines():
    assert _classes_over(MAX_CLASS_LINES, RANK_SIDE) == []


def test_no_class_of_the_control_plane_or_the_devices_is_over_300_lines():
    assert _classes_over(MAX_CLASS_LINES, CONTROL_AND_DEVICES) == []
    assert _classes_over(200, ("mindspeed_ha/control/controller/controller.py",))  # (it finds one: Controller)
    assert _classes_over(100, ("mindspeed_ha/comm/stop.py",))  # (the check finds a class: Stop is over 100)
