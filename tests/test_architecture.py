"""The house rules of docs/ARCHITECTURE.md, read from the source: who may import whom, no import cycles (type-only
imports included), and every module described there."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "geotrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every geotrain module and the geotrain modules it imports anywhere (top level, functions, TYPE_CHECKING)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from geotrain.scheduler import placement` names a module; `from x import Class` names x.
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


SUBSYSTEMS = {"protocol", "compression", "scheduler", "node"}


def _package(module: str) -> str:
    """The subsystem a module belongs to, or the module itself for the top-level ones (config, cli, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBSYSTEMS else module


# Top-level modules both sides may import (and the package itself).
_SHARED = {"geotrain", "geotrain.config", "geotrain.lifetime", "geotrain.dataset", "geotrain.durable", "geotrain.memory"}


def test_layering_holds():
    """protocol and compression import nothing of ours; scheduler and node never import each other."""
    allowed = {
        "protocol": {"protocol"},
        "compression": {"compression"},
        "scheduler": {"scheduler", "protocol", *_SHARED},
        "node": {"node", "protocol", "compression", *_SHARED},
    }
    broken = [
        f"{module} imports {target}"
        for module, targets in _imports().items()
        if _package(module) in allowed
        for target in targets
        if _package(target) not in allowed[_package(module)]
    ]
    assert not broken, broken


def test_no_import_cycles():
    """No module reaches itself through imports, not even type-only ones (a module's own packages excepted: it
    always loads them first)."""
    graph = {m: {t for t in ts if not m.startswith(f"{t}.")} for m, ts in _imports().items()}
    cycles = []
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target] if target in path else [module, target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_every_module_is_described_in_the_architecture_notes():
    notes = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        str(p.relative_to(REPO))
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "__init__.py" and not p.name.endswith("_pb2.py") and not p.name.endswith("_pb2_grpc.py")
        and f"`{p.relative_to(PACKAGE)}`" not in notes
    ]
    assert not missing, f"add a line for each to docs/ARCHITECTURE.md: {missing}"
