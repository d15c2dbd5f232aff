"""The server's imports: no circle among its own modules (every import counts, at the top of a module,
under TYPE_CHECKING or inside a function, so each module can be read after the ones it imports), and
service/ reaches backend through the engine contract alone (backend and backend.constraints, their
__all__ pinned as httpx's test_exported_members pins its own)."""

from __future__ import annotations

import ast
import pathlib
import types

import pytest

import backend
import backend.constraints
import backend.tools
from backend.lazy import homes
from tests.harness.servers import ROOT

PACKAGES = ("backend", "service")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports, by any import statement anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    paths = [path for package in PACKAGES for path in (ROOT / package).rglob("*.py")]
    modules = {module_name(path) for path in paths}
    return {module_name(path): imports_of(path, modules) for path in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "backend.constraints" in graph["backend.types"]  # at the top of a module
    assert "backend.exllamav2.engine" in graph["backend.registry"]  # inside a function


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_a_circle_would_be_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- the engine contract ---------------------------------------------------------------------------------------

CONTRACT = {"backend": backend, "backend.constraints": backend.constraints, "backend.tools": backend.tools}
"""The only backend modules service/ may import from, and only the names in their __all__."""


def public_names(module: types.ModuleType) -> set[str]:
    """What a package's __init__ defines or imports for its callers (not its submodules); a lazy package's
    imports are those its type checkers read (backend.lazy)."""
    defined = {name for name, value in vars(module).items() if not name.startswith("_")
               and not isinstance(value, types.ModuleType) and name not in ("annotations", "TYPE_CHECKING", "exports")}
    return defined | set(homes(module.__file__ or ""))


@pytest.mark.parametrize("module", CONTRACT.values(), ids=CONTRACT.keys())
def test_the_contract_exports_what_it_imports_and_nothing_else(module):
    """As httpx's test_exported_members: __all__ is the package's public names, sorted."""
    assert module.__all__ == sorted(public_names(module), key=str.casefold)


def backend_imports(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every import of a backend module in `path` (name "" for `import backend.x`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names if alias.name.split(".")[0] == "backend"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "backend":
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return found


def reaches_inside(path: pathlib.Path) -> list[str]:
    """The imports in `path` of anything but a contract module's exported names."""
    return [
        f"{path.name}:{line}: {module} {name}".rstrip()
        for line, module, name in backend_imports(path)
        if module not in CONTRACT or name not in CONTRACT[module].__all__
    ]


def test_service_imports_the_contract_only():
    """service/ sees backend through `backend`, `backend.constraints` and `backend.tools` (their __all__), never the
    engines, the shared parts behind them, or a module's own names."""
    assert [problem for path in sorted((ROOT / "service").rglob("*.py")) for problem in reaches_inside(path)] == []


def test_the_contract_check_sees_every_reach_inside(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from backend import Engine, FairnessPolicy\n"
        "from backend.constraints import ConstraintSpec\n"
        "import backend.types\n"
        "def f():\n"
        "    from backend.common.fairness import CallerTally\n"
        "    from backend.constraints.compiler import source_chars\n"
    )
    assert sorted(reaches_inside(module)) == [
        "m.py:1: backend FairnessPolicy", "m.py:3: backend.types", "m.py:5: backend.common.fairness CallerTally",
        "m.py:6: backend.constraints.compiler source_chars",
    ]


def test_the_benchmarks_reach_engines_through_the_contract_only():
    """bench/ measures engines as the service uses them, so renaming an engine's internals never breaks a benchmark
    that no test runs. bench/gpu/ is exempt: its baseline is exllamav2 driven directly, on a GPU machine."""
    paths = [path for path in sorted((ROOT / "bench").rglob("*.py")) if "gpu" not in path.relative_to(ROOT / "bench").parts]
    # The engine process's wire protocol is the cross-process contract (docs/engines.md): bench.suite.protocol_codec times it.
    wire = "backend.process.protocol"
    assert [problem for path in paths for problem in reaches_inside(path) if problem.split()[1] != wire] == []
