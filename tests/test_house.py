"""The house rules of docs/design.md, checked on the source: imports run one way, rooms stay small and are listed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dynmo_lightning"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every package module and the package modules it imports (anywhere in the file, function bodies included)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parents, base]).strip(".")
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def test_no_import_circle_in_the_package():
    graph = _imports()
    # Importing a package runs its __init__: an edge to a package module also reaches the package itself.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                # A package __init__ re-exporting its own submodules is not a circle of rooms.
                if not all(m == cycle[0] or m.startswith(cycle[0] + ".") for m in cycle):
                    pytest.fail(f"import circle: {' -> '.join(cycle)}")
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


@pytest.mark.parametrize(
    ("room", "forbidden"),
    [
        # The planning core and the simulator are pure: no torch.distributed, no Lightning, no runtime.
        ("dynmo_lightning.balance", ("torch", "lightning", "dynmo_lightning.pipeline", "dynmo_lightning.strategy")),
        ("dynmo_lightning.sim", ("torch", "lightning", "dynmo_lightning.pipeline", "dynmo_lightning.strategy")),
        # Callbacks talk to the strategy through the PipelineControl protocol, never the class.
        ("dynmo_lightning.callbacks", ("dynmo_lightning.strategy",)),
        # Models know nothing of the pipeline.
        (
            "dynmo_lightning.models",
            ("dynmo_lightning.pipeline", "dynmo_lightning.strategy", "dynmo_lightning.callbacks"),
        ),
        # The runtime never reaches up to the strategy or the callbacks.
        ("dynmo_lightning.pipeline", ("dynmo_lightning.strategy", "dynmo_lightning.callbacks")),
    ],
)
def test_lower_rooms_never_import_higher_ones(room, forbidden):
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        if name != room and not name.startswith(room + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                targets = [node.module or ""]
            else:
                continue
            for target in targets:
                assert not any(_within(target, f) for f in forbidden), f"{name} imports {target}"


def test_the_runtime_never_imports_the_package_top_level_rooms():
    # pipeline/ is below the entry points (launch, cli, strategy): an arrow up from it is a circle waiting to happen
    top = {"dynmo_lightning.launch", "dynmo_lightning.cli", "dynmo_lightning.report", "dynmo_lightning.strategy"}
    for name, targets in _imports().items():
        if name.startswith("dynmo_lightning.pipeline"):
            assert not targets & top, (name, targets & top)


def test_core_is_the_lowest_layer_and_protocol_only_gathers_it():
    # core/ (one idea per module) imports nothing of the package but itself; protocol re-exports core for users
    graph = _imports()
    for name, targets in graph.items():
        if name.startswith("dynmo_lightning.core"):
            assert all(t.startswith("dynmo_lightning.core") for t in targets), (name, targets)
    assert all(t.startswith("dynmo_lightning.core") for t in graph["dynmo_lightning.protocol"])
    # inside the package every room imports core itself: protocol is the users' door, not a room's
    users = sorted(name for name, targets in graph.items() if "dynmo_lightning.protocol" in targets)
    assert users == [], users


def _within(module: str, room: str) -> bool:
    """Whether ``module`` is ``room`` or inside it (a room ending with "." means anything below it)."""
    if room.endswith("."):
        return module.startswith(room)
    return module == room or module.startswith(room + ".")


def _methods(path: Path, name: str) -> list[str]:
    """The methods (properties included) a class of ``path`` defines in its own body."""
    (cls,) = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name]
    return [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_strategy_is_the_lightning_face_only():
    # 69 methods before the house issue; Lightning's richest strategies have 33-36 (FSDP 33, DeepSpeed 36)
    methods = _methods(PACKAGE / "strategy" / "dynmo.py", "DynMoStrategy")
    assert len(methods) <= 35, f"DynMoStrategy has {len(methods)} methods: hand a job to a part ({methods})"


def test_no_module_over_500_lines():
    # runtime.py, layout.py, policy.py, memory.py, page.py, moe.py were longer: each held two ideas
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := p.read_text().count("\n")) > 500}
    assert not long, f"modules over 500 lines (split them into rooms): {long}"


#: pipeline/'s parts and their level: a part imports only parts of a lower level (and itself).
PIPELINE_PARTS = {"topology": 0, "parallel": 1, "stage": 2, "elastic": 3, "checkpoint": 3}


def _part_violations(graph: dict[str, set[str]], root: str, levels: dict[str, int]) -> list[str]:
    """``module -> target`` edges inside ``root`` from a part to a part of the same or a higher level."""
    depth = root.count(".") + 1
    wrong = []
    for name, targets in graph.items():
        if not _within(name, root) or name == root:
            continue
        part = name.split(".")[depth]
        for target in targets:
            if not _within(target, root) or target == root:
                continue
            other = target.split(".")[depth]
            if other != part and levels[other] >= levels[part]:
                wrong.append(f"{name} -> {target}")
    return wrong


def test_each_pipeline_part_imports_only_the_parts_below_it():
    wrong = _part_violations(_imports(), "dynmo_lightning.pipeline", PIPELINE_PARTS)
    assert not wrong, f"imports running up (or sideways) between pipeline/'s parts: {wrong}"


def test_the_part_check_sees_an_import_running_up_or_sideways():
    graph = {
        "p.topology.a": {"p.stage.b"},  # up
        "p.elastic.c": {"p.checkpoint.d", "p.stage.b"},  # sideways, then down (fine)
        "p.stage.b": {"p.topology.a", "p.stage.e"},  # down, and within its part (fine)
    }
    assert _part_violations(graph, "p", PIPELINE_PARTS) == [
        "p.topology.a -> p.stage.b",
        "p.elastic.c -> p.checkpoint.d",
    ]


#: ``Callable[[], ...]`` parameters and fields of pipeline/ that do not read the strategy's world, and why.
NOT_THE_WORLD = {
    ("topology/heartbeats.py", "step"): "the trainer's step now, for failure messages",
    ("stage/migration.py", "transfer"): "the two-phase commit's own action (move the layers)",
    ("stage/migration.py", "release"): "the two-phase commit's own action (free the old copies)",
    ("stage/reduce.py", "names"): "the stages' parameter names, which change with migration",
    ("topology/world.py", "step"): "the trainer's step now, handed to the heartbeats",
}


def _thunks(source: str) -> set[str]:
    """Parameters and annotated fields typed ``Callable[[], ...]``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.annotation is not None:
            name, annotation = node.arg, node.annotation
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name, annotation = node.target.id, node.annotation
        else:
            continue
        if ast.unparse(annotation).replace(" ", "").startswith("Callable[[],"):
            found.add(name)
    return found


def test_the_pipeline_holds_the_world_not_thunks_of_it():
    # twelve `Callable[[], X]` parameters read the strategy's mesh, layout or pipeline back before the house issue
    found = {
        (str(p.relative_to(PACKAGE / "pipeline")), name)
        for p in (PACKAGE / "pipeline").rglob("*.py")
        for name in _thunks(p.read_text())
    }
    assert found <= set(NOT_THE_WORLD), f"hold the World instead: {sorted(found - set(NOT_THE_WORLD))}"


def test_the_thunk_check_sees_parameters_and_fields():
    source = "def f(a: Callable[[], int], b: Callable[[int], int]): ...\nclass C:\n    pipe: Callable[[], Any]\n"
    assert _thunks(source) == {"a", "pipe"}


def _drawn(text: str) -> set[str]:
    """The paths the design page's drawing lists: ``name.py`` and ``name/`` lines, nested by indentation."""
    block = text.split("```\ndynmo_lightning/\n", 1)[1].split("```", 1)[0]
    stack, found = [], set()
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+(?:\.py|/))(?: {2,}|$)", line)
        if not match or len(match.group(1)) >= 20:  # descriptions continue from column 30
            continue
        depth = len(match.group(1)) // 2 - 1
        stack[depth:] = [match.group(2).rstrip("/")]
        found.add("/".join(stack))
    return found


def test_the_design_page_draws_the_house():
    listed = {
        str(p.relative_to(PACKAGE).with_suffix("") if p.suffix else p.relative_to(PACKAGE))
        for p in [*PACKAGE.rglob("*.py"), *(d for d in PACKAGE.rglob("*") if (d / "__init__.py").exists())]
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    } | {"conf"}
    drawn = {d.removesuffix(".py") for d in _drawn((PACKAGE.parent / "docs" / "design.md").read_text())}
    assert drawn == listed, f"not drawn: {sorted(listed - drawn)}; drawn but gone: {sorted(drawn - listed)}"


def test_no_function_longer_than_80_lines():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - start + 1
                if length > 80:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({length})")
    assert not long, long


def _complexities(source: str) -> list[tuple[str, int, int]]:
    """``(name, line, complexity)`` of every function, method and nested function, as radon counts them."""
    from radon.complexity import cc_visit

    found, blocks = [], [b for b in cc_visit(source) if not hasattr(b, "methods")]  # methods come as functions too
    while blocks:
        block = blocks.pop()
        name = f"{block.classname}.{block.name}" if block.classname else block.name
        found.append((name, block.lineno, block.complexity))
        blocks += block.closures
    return found


def test_no_function_more_complex_than_15():
    # Length is not the only measure of a function one can read: radon's cyclomatic complexity (branches, boolean
    # operators and comprehension conditions) stays at most 15; a bigger function is split into named steps.
    complex_ = [
        f"{path.relative_to(PACKAGE)}:{line} {name} ({value})"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line, value in _complexities(path.read_text())
        if value > 15
    ]
    assert not complex_, complex_


def test_the_complexity_count_sees_methods_closures_and_boolean_operators():
    source = """
class A:
    def f(self, x):
        def g(y):
            return y and x or 1
        return g
"""
    assert sorted(_complexities(source)) == [("A.f", 3, 1), ("g", 4, 3)]


def _strategy_private_names() -> set[str]:
    """``DynMoStrategy``'s private attributes and methods: assigned as ``self._x`` or defined as ``def _x`` in it."""
    tree = ast.parse((PACKAGE / "strategy" / "dynmo.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DynMoStrategy"]
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _own_private_names(cls: ast.ClassDef) -> set[str]:
    """What a class defines privately itself: ``def _x``, ``self._x = ...``, class-level ``_x = ...``."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
    for stmt in cls.body:  # fields (dataclasses) and class attributes with a value; a bare annotation declares none
        if isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and _is_dataclass(cls):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return names


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any("dataclass" in ast.unparse(d) for d in cls.decorator_list)


def _private_reads(tree: ast.Module, private: set[str]) -> list[tuple[int, str]]:
    """Every ``<expr>._name`` (or ``getattr(<expr>, "_name")``) with ``_name`` one of ``private``, except a class's
    ``self._name`` where that class defines ``_name`` itself (its own state, which may share a name)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, own: set[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own = _own_private_names(node)
        if isinstance(node, ast.Attribute) and node.attr in private:
            mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and node.attr in own
            if not mine:
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in private:
                    target = node.args[0]
                    if not (isinstance(target, ast.Name) and target.id == "self" and name.value in own):
                        found.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(tree, set())
    return found


def test_no_module_outside_the_strategy_reads_its_private_attributes():
    # Collaborators (the resize room, the launcher, callbacks, examples) get a typed view of the strategy: its public
    # members (PipelineControl, ResizeHost) and what it hands them; its private state stays in strategy/dynmo.py.
    private = _strategy_private_names()
    assert {"_world", "_pipeline", "_eval_step", "_shard_data"} <= private  # the collection itself works
    examples = PACKAGE.parent / "examples"
    reads = []
    for path in sorted([*PACKAGE.rglob("*.py"), *examples.rglob("*.py")]):
        if path == PACKAGE / "strategy" / "dynmo.py":
            continue
        for line, text in _private_reads(ast.parse(path.read_text()), private):
            reads.append(f"{path.relative_to(PACKAGE.parent)}:{line} {text}")
    assert not reads, reads


def test_the_private_attribute_check_tells_a_class_own_state_from_the_strategys():
    private = {"_stages", "_pipe", "_timeout"}
    source = """
class Room:
    def __init__(self, pipe, strategy):
        self._pipe = pipe
        self._strategy = strategy

    def run(self):
        return self._pipe, self._strategy._stages, getattr(self._strategy, "_timeout")


class Mixin:
    _timeout: float

    def shrink(self):
        return self._timeout
"""
    reads = [text for _, text in _private_reads(ast.parse(source), private)]
    assert reads == ["self._strategy._stages", "getattr(self._strategy, '_timeout')", "self._timeout"]


@pytest.mark.parametrize("package", ["pipeline", *(f"pipeline/{part}" for part in PIPELINE_PARTS), "strategy"])
def test_each_package_lists_its_rooms(package):
    folder = PACKAGE / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    listed = re.findall(r"^\* ``(\w+)`` - ", doc, flags=re.MULTILINE)
    rooms = sorted(p.stem for p in folder.glob("*.py") if p.name != "__init__.py")
    rooms += sorted(p.name for p in folder.iterdir() if (p / "__init__.py").exists())
    assert sorted(listed) == sorted(rooms), f"{package}/__init__.py lists {sorted(listed)}, the rooms are {rooms}"


def test_results_files_live_under_docs_bench():
    # docs/ holds the prose pages; every results file a page cites lives in docs/bench/
    stray = sorted(p.name for p in (PACKAGE.parent / "docs").glob("*.json"))
    assert not stray, f"results files among the pages (move them to docs/bench/): {stray}"


def _host_uses(tree: ast.AST) -> tuple[set[str], list[str]]:
    """The members of ``host`` / ``self._host`` a module reads, and the ones it assigns."""

    def is_host(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "host") or (
            isinstance(node, ast.Attribute) and node.attr == "_host"
        )

    reads, writes = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_host(node.value):
            (writes.append if isinstance(node.ctx, ast.Store) else reads.add)(node.attr)
    return reads, writes


def test_resize_reads_only_its_host_protocol_and_never_writes_into_the_strategy():
    # The resize room sees the strategy through ResizeHost, listing exactly what it reads; a world change is the
    # World's own (World.adopt) and the partition history is the handle's to append.
    tree = ast.parse((PACKAGE / "pipeline" / "elastic" / "resize.py").read_text())
    (protocol,) = (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ResizeHost")
    declared = {n.target.id for n in protocol.body if isinstance(n, ast.AnnAssign)}
    declared |= {n.name for n in protocol.body if isinstance(n, ast.FunctionDef)}
    assert all(isinstance(b, ast.Name) and b.id == "Protocol" for b in protocol.bases), "only Protocol"
    reads, writes = _host_uses(tree)
    assert reads == declared, f"declared but unused: {declared - reads}; used but undeclared: {reads - declared}"
    assert not writes, f"resize.py writes into the strategy: {writes}"
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "rank_zero_only" not in imported, "the rank logging reads is the World's to set"


def test_the_host_use_check_sees_reads_and_writes():
    reads, writes = _host_uses(ast.parse("host.a = host.b + self._host.c\nhost.d.e = 1"))
    assert (reads, writes) == ({"b", "c", "d"}, ["a"])


#: balance/'s parts, lowest first: each sub-package imports only those before it (and itself).
BALANCE_PARTS = ("split", "diffusion", "partitioning", "steptime", "decision")


@pytest.mark.parametrize(("package", "expected"), [("balance", BALANCE_PARTS), ("pipeline", PIPELINE_PARTS)])
def test_a_package_of_parts_is_its_parts(package, expected):
    # every module of balance/ and pipeline/ lives in a part (the package __init__ only gathers them for users)
    folder = PACKAGE / package
    loose = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"{package}/ modules outside its parts {sorted(expected)}: {loose}"
    parts = sorted(p.name for p in folder.iterdir() if (p / "__init__.py").exists())
    assert parts == sorted(expected), parts


@pytest.mark.parametrize("part", BALANCE_PARTS)
def test_each_balance_part_imports_only_the_parts_below_it(part):
    allowed = BALANCE_PARTS[: BALANCE_PARTS.index(part) + 1]
    room = f"dynmo_lightning.balance.{part}"
    for name, targets in _imports().items():
        if not _within(name, room):
            continue
        for target in targets:
            if _within(target, "dynmo_lightning.balance"):
                assert target != "dynmo_lightning.balance", f"{name} imports the balance package: import the room"
                assert target.split(".")[2] in allowed, f"{name} imports {target}: {part} may import {allowed}"


#: Names whose tests branch on how a job is parallel (issue 45: parallelism as parts, not flags).
PARALLEL_FLAGS = {"data_parallel", "tensor_parallel", "tensor_parallel_size", "tp_size", "compile", "compile_options",
                  "units", "sharded"}  # fmt: skip
#: Branch sites on them today (37 before issue 45's composition work, 31 after: the refusals are one table,
#: core/composition.py): may only go down.
MAX_PARALLEL_BRANCHES = 31


def _parallel_branches(source: str) -> int:
    """``if``/``while``/conditional expressions whose test reads one of :data:`PARALLEL_FLAGS`."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            read = {x.attr if isinstance(x, ast.Attribute) else x.id for x in ast.walk(node.test)
                    if isinstance(x, (ast.Attribute, ast.Name))}  # fmt: skip
            count += bool(read & PARALLEL_FLAGS)
    return count


def test_branches_on_the_parallel_mode_do_not_grow():
    total = sum(_parallel_branches(p.read_text()) for p in PACKAGE.rglob("*.py"))
    assert total <= MAX_PARALLEL_BRANCHES, f"{total} branch sites on the parallel mode (> {MAX_PARALLEL_BRANCHES})"


def test_the_branch_count_sees_conditions_and_expressions():
    source = "if s.data_parallel == 'fsdp':\n    x = 1 if tp_size > 1 else 2\nwhile not self.units:\n    pass\nif y: z"
    assert _parallel_branches(source) == 3
