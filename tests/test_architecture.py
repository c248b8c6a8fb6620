"""The package's layout, read from its source with ``ast`` (nothing imported): imports run down
the layers (no module outside ``svflow_jax/cli/`` imports the command line, no foundation
imports a command's package), no import cycle (imports under ``TYPE_CHECKING`` and inside
functions count), at most nine top-level modules, and the removed alias modules stay removed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "svflow_jax"
PACKAGE = "svflow_jax"

#: at most this many modules at the top of the package, besides __init__.py and __main__.py
MAX_TOP_LEVEL = 9

#: the study packages of the commands (verify, inspect, diagnose, train) and the command line
COMMANDS = ("cli", "claims", "inspection", "diagnose", "training")

#: the lower layers: geometry, the flow, the solvers, the Transformer, the checkpoints, the bridge
LOWER_PACKAGES = ("flow", "solvers", "transformer", "checkpoints", "bridge", "data")

#: modules that were moved or were aliases of a new home, gone for good
REMOVED = ("packaged", "tables", "training.cli", "diagnose.cli", "solvers.registry", "verify",
           "report", "inspection_report", "alpha_sweep", "correspondence", "cli_types")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source: ``from pkg import
    mod`` is the module ``pkg.mod``, ``from mod import obj`` the module ``mod``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target.split(".")[0] == PACKAGE and target != name:
                out.add(target)
    return out


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def _in(name: str, package: str) -> bool:
    full = f"{PACKAGE}.{package}"
    return name == full or name.startswith(full + ".")


def test_the_walk_sees_the_package():
    assert len(MODULES) > 60 and sum(map(len, GRAPH.values())) > 150
    assert "svflow_jax.claims.core" in GRAPH["svflow_jax.claims.run"]  # relative imports


def test_only_the_command_line_imports_the_command_line():
    wrong = {name: sorted(t for t in targets if _in(t, "cli"))
             for name, targets in GRAPH.items()
             if not _in(name, "cli") and name != f"{PACKAGE}.__main__"}
    assert not {k: v for k, v in wrong.items() if v}


def test_no_lower_layer_imports_a_command():
    lower = [name for name in GRAPH
             if name.count(".") == 1 and name.split(".")[1] not in (*COMMANDS, "__main__")
             and not (ROOT / name.split(".")[1]).is_dir()]  # the top-level modules
    lower += [name for name in GRAPH if any(_in(name, p) for p in LOWER_PACKAGES)]
    assert len(lower) > 20
    wrong = {name: sorted(t for t in GRAPH[name] if any(_in(t, c) for c in COMMANDS))
             for name in lower}
    assert not {k: v for k, v in wrong.items() if v}


def _cycles() -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert _cycles() == []


def test_the_cycle_check_finds_a_cycle(monkeypatch):
    monkeypatch.setitem(GRAPH, "svflow_jax.sphere", GRAPH["svflow_jax.sphere"] | {
        "svflow_jax.vmf"})
    monkeypatch.setitem(GRAPH, "svflow_jax.vmf", GRAPH["svflow_jax.vmf"] | {"svflow_jax.sphere"})
    assert ["svflow_jax.sphere", "svflow_jax.vmf"] in _cycles()


def test_the_top_of_the_package_holds_only_foundations():
    top = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= MAX_TOP_LEVEL, top


@pytest.mark.parametrize("name", REMOVED)
def test_removed_modules_stay_removed(name):
    parts = name.split(".")
    assert not ROOT.joinpath(*parts[:-1], parts[-1] + ".py").exists()
    assert not ROOT.joinpath(*parts).is_dir()
