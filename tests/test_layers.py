"""The architecture, checked: every import points to the same layer or one below, no module
imports another that imports it back, and only the parallel layer and the transports touch
``torch.distributed``. Imports inside functions and under ``TYPE_CHECKING`` count too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import gpipe

ROOT = Path(gpipe.__file__).parent

# Lowest first; a module may import from its own layer and the layers below it.
LAYERS = [
    ["base", "losses"],
    ["schedule"],
    ["layout"],
    ["engine"],
    ["transport"],
    ["parallel"],
    ["materialize", "estimate", "models"],
    ["frontend"],
    ["pipe"],
    ["compat"],
    ["planner"],
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


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split(".")[1:])
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """gpipe modules (dotted, without ``gpipe.``) and ``torch.distributed`` that it imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module == "gpipe":  # from gpipe import layout
                names = [f"gpipe.{alias.name}" for alias in node.names]
            elif node.module.startswith("gpipe."):  # from gpipe.parallel import store: a module
                inner = [f"{node.module}.{alias.name}" for alias in node.names]
                modules = [name for name in inner if _is_module(name)]
                names = modules if len(modules) == len(inner) else [node.module, *modules]
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
        # ``from gpipe import layout`` names a module; ``from gpipe.x import y`` names x.
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


# -- docs/architecture.md, checked against the tree ---------------------------------------

ARCHITECTURE = ROOT.parents[1] / "docs" / "architecture.md"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 60


def _section(title: str) -> str:
    text = ARCHITECTURE.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _rows(title: str) -> list[str]:
    lines = [line for line in _section(title).splitlines() if line.startswith("| `")]
    return [line.split("|")[1].strip().strip("`") for line in lines]


def _documented_modules() -> set[str]:
    """Each module as the table names it: its path below src/gpipe; a package's
    ``__init__.py`` by its folder (``materialize/``), and only where it holds code of its own
    (a function or a class), not just a docstring and re-exports; the package's own
    ``__init__.py`` as itself."""
    found = set()
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and path.parent != ROOT:
            tree = ast.parse(path.read_text())
            defines = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            if not any(isinstance(node, defines) for node in tree.body):
                continue
            relative = path.parent.relative_to(ROOT).as_posix() + "/"
        found.add(relative)
    return found


def test_the_architecture_table_has_one_row_per_module():
    rows = _rows("Who owns what")
    modules = _documented_modules()
    twice = sorted({r for r in rows if rows.count(r) > 1})
    missing = sorted(modules - set(rows))
    stale = sorted(set(rows) - modules)
    assert not (twice or missing or stale), (
        "docs/architecture.md's 'Who owns what' table must have one row per module of "
        f"src/gpipe, its first cell the path in backticks: add rows for {missing}, remove "
        f"or rename the rows of {stale}, keep one of each of {twice}"
    )


def test_the_layer_diagram_names_every_package_and_top_module():
    diagram = ARCHITECTURE.read_text().split("```")[1]
    words = set(re.findall(r"[\w.]+/?", diagram))
    tops = {p.name + "/" for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    tops |= {p.stem for p in ROOT.glob("*.py") if p.name != "__init__.py"}
    unnamed = sorted(t for t in tops if t not in words and f"{t}.py" not in words)
    assert not unnamed, f"docs/architecture.md's layer diagram does not name {unnamed}: add each"
    assert {t.rstrip("/") for t in tops} | {"__init__"} == set(RANK), (
        "the diagram's names and tests/test_layers.py's LAYERS must list the same modules"
    )


def _functions(node: ast.AST, prefix: str = ""):
    """(``Class.function``, node) of every function below ``node``, nested ones included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if not isinstance(child, ast.ClassDef):
                yield prefix + child.name, child
            yield from _functions(child, f"{prefix}{child.name}.")


def _over_the_limits() -> dict[str, str]:
    """What is longer than the limits: ``path`` (a file) or ``path::Class.function``, each
    with its size. A function's lines run from its ``def`` to its last line."""
    over = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_FILE_LINES:
            over[relative] = f"{n} lines > {MAX_FILE_LINES}"
        for name, node in _functions(ast.parse(text)):
            if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                over[f"{relative}::{name}"] = f"{n} lines > {MAX_FUNCTION_LINES}"
    return over


def test_no_file_or_function_over_the_limits_but_the_named_exceptions():
    over = _over_the_limits()
    named = _rows("Sizes")
    unnamed = [f"| `{name}` | why |  ({size})" for name, size in over.items() if name not in named]
    within = [name for name in named if name not in over]
    assert not unnamed, (
        "split these by concept (one concept per module, a function of named steps), or add "
        "each row, with why it stays whole, to the 'Sizes' table of docs/architecture.md:\n"
        + "\n".join(unnamed)
    )
    assert not within, (
        f"docs/architecture.md's 'Sizes' table names {within}, now within the limits (or "
        "gone): remove their rows"
    )
