"""The architecture, checked: every import points to the same layer or one below, no module
imports another that imports it back, and only the parallel layer and the transports touch
``torch.distributed``. Imports inside functions and under ``TYPE_CHECKING`` count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpipe

ROOT = Path(gpipe.__file__).parent

# Lowest first; a module may import from its own layer and the layers below it.
LAYERS = [
    ["_utils", "allocator", "errors", "losses", "remat", "rng", "microbatch"],
    ["schedule"],
    ["layout"],
    ["engine"],
    ["transport"],
    ["parallel"],
    ["partition", "materialize", "estimate", "models"],
    ["frontend"],
    ["assembly", "stepping", "through_output"],
    ["pipe"],
    ["compat"],
    ["planner", "exactness"],
    ["train"],
    ["cli", "__main__"],
    ["__init__"],
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
DISTRIBUTED_OK = {"parallel", "transport"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def _top(module: str) -> str:
    return module.split(".")[0]


def _imports(path: Path) -> set[str]:
    """gpipe modules (dotted, without ``gpipe.``) and ``torch.distributed`` that it imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "gpipe":  # from gpipe import rng
                names = [f"gpipe.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("torch.distributed"):
                found.add("torch.distributed")
            elif name == "gpipe":
                found.add("__init__")
            elif name.startswith("gpipe."):
                found.add(name.removeprefix("gpipe."))
    return found


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if _top(m) not in RANK)
    assert not missing, f"modules without a layer in LAYERS: {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    wrong = []
    for target in _imports(MODULES[module]):
        if target == "torch.distributed":
            if _top(module) not in DISTRIBUTED_OK:
                wrong.append("torch.distributed (only gpipe.parallel and gpipe.transport)")
            continue
        # ``from gpipe import rng`` names a module; ``from gpipe.x import y`` names x.
        target_top = _top(target)
        if target_top in RANK and RANK[target_top] > RANK[_top(module)]:
            wrong.append(f"{target} (layer {RANK[target_top]} > {RANK[_top(module)]})")
    assert not wrong, f"gpipe.{module} imports upward: {wrong}"


def test_no_import_cycles():
    graph = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target in _imports(path):
            # the module itself, or the package whose __init__ holds it
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, path: list[str]) -> bool:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle.extend([*path[path.index(nxt) :], nxt] if nxt in path else [node, nxt])
                return True
            if nxt not in state and visit(nxt, [*path, nxt]):
                return True
        state[node] = 2
        return False

    for module in sorted(graph):
        if module not in state and visit(module, [module]):
            break
    assert not cycle, "import cycle: " + " -> ".join(cycle)
