"""Imports flow one way: the module graph has no cycle, each layer imports only what is below it,
and the planner, the scheduler, the fake backend and the schedule commands run without torch.

The graph is read from the source (the AST), not from a running interpreter, so it sees every
module whether or not a test imports it. An edge is an import that runs when the module loads: a
top-level statement, one inside a top-level ``if``/``try``/``with`` or a class body, and the
imports under ``if TYPE_CHECKING:`` (they name a dependency of the module's types, and a cycle
through them is a cycle in the design even if Python never runs it). Imports inside functions are
deferred: they are left out of the cycle check, and the layer contracts list each one that points
upward by name, with its reason. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and
``a.b``; those implied edges are not drawn (the package ``__init__`` files only re-export), as
import-linter does not draw them either. docs/design.md, "Import layers", states the layers.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "roundpipe"


@dataclass(frozen=True)
class Import:
    target: str  # the module it loads: a roundpipe module, or the top-level name of a library
    deferred: bool  # inside a function: runs only when the function does
    line: int


def _module_names() -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = _module_names()


def _resolve(name: str) -> str:
    """The roundpipe module ``name`` loads (its longest known prefix), or its top-level library."""
    if not name.startswith("roundpipe"):
        return name.split(".")[0]
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [_resolve(alias.name) for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: count up from the module's package
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    # ``from pkg import sub`` loads the submodule ``pkg.sub`` when there is one.
    return [_resolve(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base) for a in node.names]


def _imports(module: str) -> list[Import]:
    found: list[Import] = []

    def visit(nodes: list[ast.stmt], deferred: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.extend(Import(t, deferred, node.lineno) for t in _targets(module, node))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(node.body, True)
            else:  # if / try / with / class bodies: their imports run when the module loads
                children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
                for handler in getattr(node, "handlers", []):
                    children.extend(handler.body)
                visit(children, deferred)

    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    visit(tree.body, False)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _graph() -> dict[str, set[str]]:
    """Module-level edges between roundpipe modules (self-edges of a package's own name dropped)."""
    return {
        module: {i.target for i in found if not i.deferred and i.target in MODULES and i.target != module}
        for module, found in IMPORTS.items()
    }


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_sees_the_package() -> None:
    graph = _graph()
    assert (
        "roundpipe.planning.simulate" in graph
        and "roundpipe.sched.engine" in graph["roundpipe.planning.simulate"]
    )
    assert "roundpipe.backends.fake" in graph["roundpipe.planning.simulate"]
    # TYPE_CHECKING imports are edges: the facade is one, behind the lazy __getattr__.
    assert "roundpipe.pipe" in graph["roundpipe"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


# Deferred imports that close a loop or point up a layer, each on purpose: the lazy forwarding of
# simulation (with `Trace.replay`, which the package reaches the same way). `Trace` itself imports
# none of its readers (rules, export, replay): they import it, and the package attaches them.
# Anything else deferred must keep the whole graph acyclic and respect the layers too.
DEFERRED_BY_DESIGN = {
    ("roundpipe.sched", "roundpipe.planning.simulate"),  # roundpipe.sched.simulate & co. (PEP 562)
}


def test_deferred_imports_close_no_other_cycle() -> None:
    graph = {
        module: {
            i.target
            for i in found
            if i.target in MODULES and i.target != module and (module, i.target) not in DEFERRED_BY_DESIGN
        }
        for module, found in IMPORTS.items()
    }
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle through a deferred import: " + " -> ".join(cycle or [])
    for module, target in DEFERRED_BY_DESIGN:  # the list stays true: each edge still exists, deferred
        assert any(i.target == target and i.deferred for i in IMPORTS[module]), (module, target)


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_trace_imports_none_of_its_readers() -> None:
    """`Trace` keeps data and queries; the engine, rule checking, export and replay import it. With
    every import counted (deferred and type-checking ones too, nothing excused), the trace module
    reaches none of them, so no cycle can run through it."""
    every = {
        module: {i.target for i in found if i.target in MODULES and i.target != module}
        for module, found in IMPORTS.items()
    }
    readers = (
        "roundpipe.sched.engine",
        "roundpipe.sched.rules",
        "roundpipe.sched.export",
        "roundpipe.planning.simulate",
    )
    for reader in readers:
        assert _reaches(every, reader, "roundpipe.sched.trace"), reader
        assert not _reaches(every, "roundpipe.sched.trace", reader), reader


def test_a_deferred_import_that_closes_a_cycle_fails() -> None:
    """The check above catches what a function-level import hides: an edge back from the trace
    to the simulation closes trace -> simulate -> engine -> trace."""
    graph = {
        module: {i.target for i in found if i.target in MODULES} - {module}
        for module, found in IMPORTS.items()
    }
    graph["roundpipe.sched.trace"] = graph["roundpipe.sched.trace"] | {"roundpipe.planning.simulate"}
    cycle = _find_cycle(graph)
    assert cycle is not None and "roundpipe.sched.trace" in cycle


def _roundpipe_imports(prefix: str) -> list[tuple[str, str, int]]:
    """(module, imported roundpipe module, line) for every import, deferred too, under ``prefix``."""
    return [
        (module, i.target, i.line)
        for module, found in IMPORTS.items()
        if module == prefix or module.startswith(prefix + ".")
        for i in found
        if i.target.startswith("roundpipe") and (module, i.target) not in DEFERRED_BY_DESIGN
    ]


def _inside(module: str, *layers: str) -> bool:
    return any(module == layer or module.startswith(layer + ".") for layer in layers)


def test_plan_imports_only_errors() -> None:
    bad = [
        x
        for x in _roundpipe_imports("roundpipe.plan")
        if not _inside(x[1], "roundpipe.plan", "roundpipe.errors")
    ]
    assert not bad, f"roundpipe.plan must import nothing of roundpipe but roundpipe.errors: {bad}"


def test_sched_imports_only_plan_and_errors() -> None:
    allowed = ("roundpipe.sched", "roundpipe.plan", "roundpipe.errors")
    bad = [x for x in _roundpipe_imports("roundpipe.sched") if not _inside(x[1], *allowed)]
    assert not bad, f"roundpipe.sched must import only roundpipe.plan and roundpipe.errors: {bad}"


def test_nothing_below_the_facade_imports_planning_or_the_cli() -> None:
    top = ("roundpipe.planning", "roundpipe.pipe", "roundpipe.cli")
    for layer in ("roundpipe.plan", "roundpipe.sched", "roundpipe.backends"):
        bad = [x for x in _roundpipe_imports(layer) if _inside(x[1], *top)]
        assert not bad, f"{layer} imports a module above it: {bad}"


def _closure(start: str) -> set[str]:
    graph, seen, todo = _graph(), {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_fake_backend_and_simulation_import_no_torch() -> None:
    for start in ("roundpipe.backends.fake", "roundpipe.planning.simulate"):
        for module in sorted(_closure(start)):
            torch_lines = [i.line for i in IMPORTS[module] if i.target == "torch"]
            assert not torch_lines, f"{start} loads {module}, which imports torch (line {torch_lines})"


# Run in a fresh interpreter where ``import torch`` fails, as on a machine without it.
_NO_TORCH = r"""
import importlib, json, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test ({name})")
        return None

sys.meta_path.insert(0, NoTorch())
for name in ("roundpipe", "roundpipe.plan", "roundpipe.sched", "roundpipe.backends.fake", "roundpipe.planning.simulate"):
    importlib.import_module(name)
below_cli = sorted(m for m in ("pydantic", "rich", "matplotlib") if m in sys.modules)
for name in ("roundpipe.cli", "roundpipe.cli.plan_commands", "roundpipe.train"):
    importlib.import_module(name)

import roundpipe, roundpipe.sched, roundpipe.planning.simulate
from roundpipe.cli import main

assert roundpipe.sched.simulate is roundpipe.planning.simulate.simulate
trace = sys.argv[1]
codes = [
    main(["plan", "--example", "tiny", "-n", "2", "-m", "4", "--json"]),
    main(["simulate", "--example", "tiny", "-n", "2", "-m", "4", "-k", "2", "--trace", trace, "--json"]),
    main(["trace", "check", trace]),
    main(["trace", "replay", trace]),
]
try:
    roundpipe.RoundPipe
    facade = "loaded"
except ImportError:
    facade = "needs torch"
print(json.dumps({"codes": codes, "facade": facade, "below_cli": below_cli,
                  "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_schedule_commands_run_without_torch(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(tmp_path / "trace.json")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # The planner, the scheduler and simulation need no third-party package at all.
    assert report == {"codes": [0, 0, 0, 0], "facade": "needs torch", "below_cli": [], "torch": []}


def test_lazy_public_names_resolve() -> None:
    import roundpipe
    import roundpipe.planning.simulate
    import roundpipe.sched

    for package in (roundpipe, roundpipe.sched):
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert not missing, f"{package.__name__}.__all__ names that do not resolve: {missing}"
    assert roundpipe.sched.replay is roundpipe.planning.simulate.replay
    assert roundpipe.sched.SimulationResult is roundpipe.planning.simulate.SimulationResult
