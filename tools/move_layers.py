"""Move the loose modules at the top of src/gpipe into two floors: ``gpipe/base/`` (what every
layer uses) and ``gpipe/pipe/`` (the Pipe, how it is put together, the front ends built on it).

    python tools/move_layers.py        # at the repository root of any descendant of main

A one-off migration, safe to run again (what is done already is left as it is):

1. ``git mv`` each module of FLOORS into its floor, and its mirrored tests
   (``tests/test_M.py``) into ``tests/FLOOR/`` (a package, so that ``pipe.test_pipe`` is one
   name for pytest, for the tests and benchmarks that import it, and for launched processes);
2. rewrite every reference: imports and attribute chains of the .py files by their syntax
   (``ast`` for imports, ``tokenize`` for ``gpipe.X`` chains), their strings and comments and
   the Markdown and text files by the rules of ``rewrite_text`` (dotted names, source and test
   paths, ``from gpipe import ...``, ``test_M:attr`` specs);
3. update docs/architecture.md's layer diagram, the README's Layout section,
   tests/test_layers.py's LAYERS and tests/test_package.py's lists;
4. sort the imports and format what it changed (ruff), then list what it could not rewrite
   safely (file:line) and exit 1 if anything.

``gpipe.pipe`` becomes the package; it re-exports ``Pipe``, so ``gpipe.pipe.Pipe`` and
``from gpipe.pipe import Pipe`` keep meaning the class. The names ``gpipe`` exports are unchanged.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

FLOORS = {
    "base": ["_utils", "allocator", "errors", "losses", "remat", "rng", "microbatch"],
    "pipe": ["pipe", "assembly", "stepping", "partition", "through_output", "compat", "exactness"],
}
STAY = {"__init__", "__main__", "layout", "models"}  # top-level modules that keep their place
PIPE_EXPORTS = {"Pipe"}  # what gpipe/pipe/__init__.py re-exports
INIT = {
    "base": '"""The floor of the package: the modules every layer may use (errors, the\n'
    "re-materialization rule, per-layer seeds, micro-batches, token losses, the CPU allocator's\n"
    'policy, small tensor helpers). They import nothing of gpipe above this package."""\n',
    "pipe": '"""``gpipe.Pipe`` (``gpipe.pipe.pipe``) and the modules that cut the model, put the\n'
    "Pipe together in named steps and step it, with the front ends built on it: torchgpipe's\n"
    '``GPipe`` (``gpipe.pipe.compat``) and ``gpipe.check`` (``gpipe.pipe.exactness``)."""\n\n'
    'from gpipe.pipe.pipe import Pipe\n\n__all__ = ["Pipe"]\n',
}
TEST_INIT = '"""Tests of gpipe.{0}, one module per module (a package: one name everywhere)."""\n'
TEXT_FILES = (".md", ".txt", ".toml", ".cfg", ".yml", ".yaml", ".sh", "Makefile", "ci/run")
SELF = Path("tools/move_layers.py")

ROOT = Path.cwd()
SRC = Path("src/gpipe")
problems: list[str] = []
notes: list[str] = []
MOVED: dict[str, str] = {}  # module -> floor, for the modules of this tree
TESTS: dict[str, str] = {}  # test module (test_rng) -> floor
PIPE_SUBMODULES: set[str] = set()
JUST_MOVED: set[Path] = set()  # where this run moved a file


def problem(path: Path | str, line: int, what: str) -> None:
    problems.append(f"{path}:{line}: {what}")


def git(*args: str) -> str:
    run = subprocess.run(["git", *args], capture_output=True, text=True, check=True)
    return run.stdout


# -- 1. the moves ----------------------------------------------------------------------------


def move(old: Path, new: Path) -> bool:
    """``git mv old new`` unless done already; whether ``new`` is there now."""
    if old.exists() and new.exists():
        problem(old, 1, f"both {old} and {new} exist: merge them by hand, then run again")
        return True
    if old.exists():
        new.parent.mkdir(parents=True, exist_ok=True)
        JUST_MOVED.add(new)
        if git("ls-files", str(old)):
            git("mv", str(old), str(new))
        else:  # not tracked: moved all the same, left untracked
            old.rename(new)
        notes.append(f"moved {old} -> {new}")
    return new.exists()


def ensure(path: Path, text: str) -> None:
    if not path.exists():
        path.write_text(text)
        git("add", str(path))
        notes.append(f"created {path}")


def move_modules() -> None:
    for floor, modules in FLOORS.items():
        for module in modules:
            if move(SRC / f"{module}.py", SRC / floor / f"{module}.py"):
                MOVED[module] = floor
            else:
                notes.append(f"WARNING {SRC}/{module}.py is not in this tree: skipped")
        ensure(SRC / floor / "__init__.py", INIT[floor])
        for module in modules:
            test = f"test_{module.lstrip('_')}"
            if move(Path("tests") / f"{test}.py", Path("tests") / floor / f"{test}.py"):
                TESTS[test] = floor
        if any(t for t, f in TESTS.items() if f == floor):
            ensure(Path("tests") / floor / "__init__.py", TEST_INIT.format(floor))
    PIPE_SUBMODULES.update(p.stem for p in (SRC / "pipe").glob("*.py") if p.stem != "__init__")
    left = sorted(p.stem for p in SRC.glob("*.py") if p.stem not in STAY)
    if left:
        notes.append(f"WARNING top-level modules with no floor in FLOORS or STAY: {left}")


# -- 2. the rewrites -------------------------------------------------------------------------


def remap(dotted: str, inside_pipe: bool = False) -> str:
    """``gpipe.rng.x`` -> ``gpipe.base.rng.x``; ``gpipe.pipe.Pipe`` (a name the package
    exports, or a module of it) stays; another ``gpipe.pipe.X`` -> ``gpipe.pipe.pipe.X``."""
    parts = dotted.split(".")
    if len(parts) < 2 or parts[0] != "gpipe" or parts[1] not in MOVED:
        return dotted
    floor = MOVED[parts[1]]
    if parts[1] != floor:
        return ".".join(["gpipe", floor, *parts[1:]])
    exported = PIPE_EXPORTS if not inside_pipe else set()
    if len(parts) == 2 or parts[2] in PIPE_SUBMODULES | exported:
        return dotted
    return ".".join(["gpipe", floor, *parts[1:]])


NAME = re.compile(r"(?<![\w./-])gpipe(?:\.[A-Za-z_]\w*)+")
ESCAPED = re.compile(r"(?<![\w./\\-])gpipe(?:\\\.[A-Za-z_]\w*)+")  # in a regex: gpipe\.rng
FROM_GPIPE = re.compile(r"(?<![\w.])from (gpipe(?:\.pipe)?) import ([\w ,]+\w)")


def _from_statements(module: str, names: list[str], inside_pipe: bool) -> list[str]:
    """``from MODULE import NAMES`` as the statements of the new tree, in order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        bare = name.split(" as ")[0].strip()
        target = module
        if module == "gpipe" and bare in MOVED:
            target = f"gpipe.{MOVED[bare]}"
        elif module != "gpipe":
            target = remap(f"{module}.{bare}", inside_pipe).rpartition(".")[0]
        groups.setdefault(target, []).append(name.strip())
    return [f"from {target} import {', '.join(group)}" for target, group in groups.items()]


def rewrite_text(text: str, where: Path, first_line: int = 1) -> str:
    """Prose and code in prose (Markdown, strings, comments): ``from gpipe import rng``,
    dotted names, src and tests paths, ``test_M:attr`` specs."""

    def from_gpipe(match: re.Match) -> str:
        statements = _from_statements(match[1], match[2].split(","), inside_pipe=False)
        if len(statements) == 1:
            return statements[0]
        start = text.rfind("\n", 0, match.start()) + 1
        indent = text[start : match.start()]
        if indent.strip():
            line = first_line + text.count("\n", 0, match.start())
            problem(where, line, f"'{match[0]}' must become {statements}: split it by hand")
            return match[0]
        return f"\n{indent}".join(statements)

    text = FROM_GPIPE.sub(from_gpipe, text)
    text = NAME.sub(lambda m: remap(m[0]), text)
    text = ESCAPED.sub(lambda m: remap(m[0].replace("\\.", ".")).replace(".", "\\."), text)
    if MOVED:
        names = "|".join(sorted(MOVED, key=len, reverse=True))
        source = re.compile(rf"(?<![\w./-])((?:src/)?gpipe/)?({names})\.py\b")
        text = source.sub(lambda m: f"{m[1] or ''}{MOVED[m[2]]}/{m[2]}.py", text)
    if TESTS:
        tests = "|".join(sorted(TESTS, key=len, reverse=True))
        path = re.compile(rf"(?<![\w./-])tests/({tests})\.py\b")
        text = path.sub(lambda m: f"tests/{TESTS[m[1]]}/{m[1]}.py", text)
        spec = re.compile(rf"(?<![\w./-])({tests})(?=:[A-Za-z_])")
        text = spec.sub(lambda m: f"{TESTS[m[1]]}.{m[1]}", text)
    return text


def _offsets(text: str) -> list[int]:
    """Where each line starts, lines as ast and tokenize count them (not ``splitlines``'s,
    which also breaks at form feeds and other separators inside strings)."""
    return [0, *(m.end() for m in re.finditer("\n", text))]


def _char_col(line: str, byte_col: int) -> int:
    return len(line.encode()[:byte_col].decode())


def _import_text(node: ast.stmt, inside_pipe: bool, where: Path) -> str | None:
    """The statement(s) ``node`` becomes, or None where it stays as it is."""
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        names = [a.name + (f" as {a.asname}" if a.asname else "") for a in node.names]
        if module in TESTS:
            return f"from {TESTS[module]}.{module} import {', '.join(names)}"
        if module != "gpipe" and remap(module) == module and module != "gpipe.pipe":
            return None
        if module not in ("gpipe", "gpipe.pipe"):
            return f"from {remap(module)} import {', '.join(names)}"
        statements = _from_statements(module, names, inside_pipe)
        return None if statements == [f"from {module} import {', '.join(names)}"] else statements
    rewritten, changed = [], False
    for alias in node.names:
        name = alias.name
        if name in TESTS:
            if len(node.names) > 1:
                problem(where, node.lineno, f"'import {name}' with others: split it by hand")
                return None
            asname = f" as {alias.asname}" if alias.asname else ""
            return f"from {TESTS[name]} import {name}{asname}"
        new = remap(name)
        if name == "gpipe.pipe" and alias.asname:  # the module, as it was
            new = "gpipe.pipe.pipe"
        changed |= new != name
        rewritten.append(new + (f" as {alias.asname}" if alias.asname else ""))
    return f"import {', '.join(rewritten)}" if changed else None


HERE = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?)\.parent(?:s\[(\d+)\]|\b)")


def deeper(path: Path, text: str) -> str:
    """A file moved by this run: its paths from ``Path(__file__)``, one folder deeper."""
    if path not in JUST_MOVED:
        return text
    for number, line in enumerate(text.split("\n"), 1):
        if re.search(r"(?<![\w.])__file__", line) and not HERE.search(line):
            problem(path, number, "a path from __file__ in a moved file: one folder deeper now")
    return HERE.sub(lambda m: f"{m[1]}.parents[{int(m[2] or 0) + 1}]", text)


def rewrite_python(path: Path, text: str) -> str:
    inside_pipe = path.parent == SRC / "pipe"
    text = deeper(path, text)
    tree = ast.parse(text)
    lines, starts = text.split("\n"), _offsets(text)

    def at(line: int, col: int) -> int:
        return starts[line - 1] + _char_col(lines[line - 1], col)

    edits, spans, aliases = [], [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or getattr(node, "level", 0):
            continue
        start, end = at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)
        spans.append((start, end))
        aliases |= {a.asname for a in node.names if a.name == "gpipe" and a.asname}
        new = _import_text(node, inside_pipe, path)
        if new is None:
            continue
        if isinstance(new, list):
            before = text[starts[node.lineno - 1] : start]
            new = (f"\n{before}" if not before.strip() else "; ").join(new)
        if "#" in text[start:end]:
            problem(path, node.lineno, "a comment inside an import that changes: edit it by hand")
            continue
        edits.append((start, end, new))

    def in_import(offset: int) -> bool:
        return any(s <= offset < e for s, e in spans)

    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)]
    significant = [t for t in tokens if t.type not in (tokenize.NL, tokenize.NEWLINE)]
    for i, tok in enumerate(significant):
        start = at_char(starts, tok.start)
        if in_import(start):
            continue
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            new = rewrite_text(tok.string, path, tok.start[0])
            if new != tok.string:
                edits.append((start, at_char(starts, tok.end), new))
        elif tok.type == tokenize.NAME and (tok.string == "gpipe" or tok.string in aliases):
            if i and significant[i - 1].string == ".":
                continue
            j = i
            while j + 2 < len(significant) and significant[j + 1].string == ".":
                if significant[j + 2].type != tokenize.NAME:
                    break
                j += 2
            chain = "".join(t.string for t in significant[i : j + 1])
            if tok.string != "gpipe":
                if remap("gpipe" + chain[len(tok.string) :]) != "gpipe" + chain[len(tok.string) :]:
                    problem(path, tok.start[0], f"'{chain}': an alias of gpipe; edit it by hand")
                continue
            new = remap(chain)
            if new != chain:
                edits.append((start, at_char(starts, significant[j].end), new))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def at_char(starts: list[int], position: tuple[int, int]) -> int:
    return starts[position[0] - 1] + position[1]


# -- 3. the files that list the layers -------------------------------------------------------

DESCRIPTIONS = {  # what a diagram entry said of a module that moved, dropped with it
    "exactness": re.compile(r";?\s*gpipe\.check: your model, plain vs piped"),
}
ENTRY = re.compile(r"^(\s*\d+(?:\.\d+)?\s\s)(\S.*?)(?:(\s{3,})(\S.*))?$")


def diagram_entry(floor: str) -> list[str]:
    if floor == "base":
        names = "  ".join(m for m in FLOORS["base"] if MOVED.get(m) == "base")
        return [f"  0  base/                    {names}:", " " * 30 + "what every layer uses"]
    return [
        "  6  pipe/                    Pipe: step, forward, state, from_model; assembly",
        " " * 30 + "(configure, place, tie, wire) of partition's cut; stepping (one step),",
        " " * 30 + "through_output (pipe(x) in training); compat: torchgpipe's GPipe;",
        " " * 30 + "exactness: gpipe.check",
    ]


def rewrite_diagram(text: str, where: Path) -> str:
    head, fence, rest = text.partition("```\n")
    body, fence2, tail = rest.partition("```")
    entries: list[list[str]] = []
    for line in body.splitlines():
        if ENTRY.match(line) or not entries:
            entries.append([line])
        else:
            entries[-1].append(line)
    out: list[str] = []
    for entry in entries:
        match = ENTRY.match(entry[0])
        if not match:
            out += entry
            continue
        names = match[2].split()
        moved = [n for n in names if n.removesuffix(".py") in MOVED]
        if not moved:
            out += entry
            continue
        kept = [n for n in names if n not in moved]
        floors = {MOVED[n.removesuffix(".py")] for n in moved}
        if not kept:
            if "pipe.py" in moved or floors == {"base"}:
                out += diagram_entry("pipe" if "pipe.py" in moved else "base")
            continue  # a moved module's own entry: told by its floor's
        description = "\n".join([match[4] or "", *entry[1:]])
        for name in moved:
            pattern = DESCRIPTIONS.get(name.removesuffix(".py"))
            if pattern and pattern.search(description):
                description = pattern.sub("", description)
            elif name.removesuffix(".py") in description:
                problem(where, 1, f"the diagram entry of {kept} describes {name}: edit it")
        first = match[1] + "  ".join(kept)
        lines = description.split("\n")
        out.append(first.ljust(30) + lines[0] if lines[0] else first)
        out += lines[1:]
    return head + fence + "\n".join(out) + "\n" + fence2 + tail


README_EDITS = [  # (old, new, the mark of it done), in the README's Layout section
    (
        r"lowest first: `_utils`, `errors`, `remat`, `rng`, `microbatch`;",
        "lowest first: `base/` (`_utils`, `allocator`,\n`errors`, `losses`, `remat`, `rng`, "
        "`microbatch`);",
        "lowest first: `base/`",
    ),
    (r"`partition`, (`materialize`)", r"\1", None),
    (
        r"\(any model:\s+capture, cut, weights\); `pipe`;",
        "(any model:\ncapture, cut, weights); `pipe/` (`Pipe`, the cut, its assembly and step;\n"
        "torchgpipe's `GPipe` in `compat`, `gpipe.check` in `exactness`);",
        "; `pipe/` (",
    ),
    (
        r"(`any-model.md`, `sharded-replicas.md`, `capacity.md`, `checkpoints.md`\)\.)\n",
        r"\1" + "\n\nWhat moved: the modules that sat at the top of the package live in their "
        "floor,\n`gpipe.base` (`gpipe.base.errors`, `gpipe.base.losses`, `gpipe.base.rng`, ...) "
        "or `gpipe.pipe`\n(`gpipe.pipe.assembly`, `gpipe.pipe.compat`, `gpipe.pipe.exactness`, "
        "...), and an import names\nthe floor: `from gpipe.base.losses import causal_lm`, "
        "`from gpipe.pipe.compat import GPipe`.\nWhat `gpipe` exports is where it was "
        "(`gpipe.Pipe`, `gpipe.PipelineError`, `gpipe.check`, ...).\n",
        "What moved: the modules",
    ),
]


def rewrite_readme(text: str, where: Path) -> str:
    for old, new, done in README_EDITS:
        if done and done in text:
            continue
        found = len(re.findall(old, text))
        if found != 1:
            if done is not None or found > 1:
                problem(where, 1, f"README Layout: {found} matches of {old!r}: edit it by hand")
            continue
        text = re.sub(old, new.replace("\\1", "\\g<1>") if "\\1" in new else new, text)
    return text


def _replace_node(text: str, node: ast.AST, new: str) -> str:
    starts, lines = _offsets(text), text.split("\n")
    start = starts[node.lineno - 1] + _char_col(lines[node.lineno - 1], node.col_offset)
    end = starts[node.end_lineno - 1] + _char_col(lines[node.end_lineno - 1], node.end_col_offset)
    return text[:start] + new + text[end:]


def _assigned(text: str, name: str) -> ast.expr | None:
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == name for t in node.targets):
            return node.value
    return None


def rewrite_layers(text: str, where: Path) -> str:
    node = _assigned(text, "LAYERS")
    if node is None:
        problem(where, 1, "no LAYERS list: update the layer table by hand")
        return text
    layers = ast.literal_eval(node)
    anchors = {
        "pipe": "pipe",
        "base": next((n for g in layers for n in g if n in FLOORS["base"]), None),
    }
    new = []
    for group in layers:
        kept = []
        for name in group:
            floor = MOVED.get(name)
            if floor is None:
                kept.append(name)
            elif anchors[floor] == name:
                kept.append(floor)
        if kept:
            new.append(kept)
    if new == layers:
        return text
    rows = "".join(f"    [{', '.join(repr(n) for n in g)}],\n" for g in new).replace("'", '"')
    return _replace_node(text, node, f"[\n{rows}]")


def rewrite_mirror_lists(text: str, where: Path) -> str:
    for name in ("NOT_YET_MIRRORED", "PURE_DATA"):
        node = _assigned(text, name)
        if node is None:
            problem(where, 1, f"no {name}: update it by hand")
            continue
        items = [e.value for e in node.elts]
        renamed = [f"{MOVED[i]}/{i}" if i in MOVED else i for i in items]
        if renamed == items:
            continue
        quoted, rows, row = [f'"{i}",' for i in renamed], [], "   "
        for item in quoted:
            if len(row) + 1 + len(item) > 99:
                rows.append(row)
                row = "   "
            row += " " + item
        rows.append(row)
        new = (
            "{" + renamed[0].join(['"', '"']) + "}"
            if len(renamed) == 1
            else "{\n" + "\n".join(rows) + "\n}"
        )
        text = _replace_node(text, node, new)
    return text


SPECIAL = {
    Path("docs/architecture.md"): rewrite_diagram,
    Path("README.md"): rewrite_readme,
    Path("tests/test_layers.py"): rewrite_layers,
    Path("tests/test_package.py"): rewrite_mirror_lists,
}


# -- 4. run ----------------------------------------------------------------------------------


def files() -> list[Path]:
    listed = git("ls-files", "-co", "--exclude-standard").splitlines()
    return [Path(f) for f in listed if Path(f).is_file() and Path(f) != SELF]


def check_base() -> None:
    """base imports nothing of gpipe above it."""
    for path in sorted((SRC / "base").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = (
                    [node.module]
                    if node.module != "gpipe"
                    else [f"gpipe.{a.name}" for a in node.names]
                )
            for name in names:
                if name.startswith("gpipe") and not name.startswith("gpipe.base"):
                    problem(path, node.lineno, f"imports {name}: base imports nothing above it")


LEFT = re.compile(r"(?<![\w.])from gpipe import \(?([\w ,\n]*)")


def check_left(path: Path, text: str) -> None:
    """What the rules could not reach: ``from gpipe import`` of a moved module in a form they
    do not parse (prose around it, a parenthesized list in Markdown)."""
    for match in LEFT.finditer(text):
        names = re.sub(r"\bas \w+", "", match[1]).replace(",", " ").split()
        if set(names) & set(MOVED):
            line = text.count("\n", 0, match.start()) + 1
            problem(path, line, f"'{match[0].strip()}' names a module that moved: edit it")


def main() -> int:
    if not (SRC / "__init__.py").exists():
        print("run me at the repository root of gpipe", file=sys.stderr)
        return 2
    move_modules()
    changed = []
    for path in files():
        if path.suffix != ".py" and not str(path).endswith(TEXT_FILES):
            continue
        text = path.read_text()
        new = SPECIAL.get(path, lambda t, w: t)(text, path)
        new = rewrite_python(path, new) if path.suffix == ".py" else rewrite_text(new, path)
        if new != text:
            path.write_text(new)
            changed.append(path)
    check_base()
    for path in files():
        if path.suffix == ".py" or str(path).endswith(TEXT_FILES):
            check_left(path, path.read_text())
    python = [str(p) for p in changed if p.suffix == ".py"]
    if python:
        ruff = [sys.executable, "-m", "ruff"]
        try:
            subprocess.run([*ruff, "check", "-q", "--select", "I", "--fix", *python], check=False)
            subprocess.run([*ruff, "format", "-q", *python], check=True)
            long = [*ruff, "check", "-q", "--select", "E501", "--output-format", "concise"]
            report = subprocess.run([*long, *python], capture_output=True, text=True).stdout
            for line in (
                x for x in report.splitlines() if " E501 " in x
            ):  # path:line:col: E501 ...
                where, _, what = line.partition(": ")
                problems.append(f"{where.rsplit(':', 1)[0]}: {what}, after the rewrite: wrap it")
        except (OSError, subprocess.CalledProcessError) as error:
            problem("ruff", 0, f"{error}: run `ruff check --select I --fix` and `ruff format`")
    print("\n".join([*notes, f"rewrote {len(changed)} files"]))
    if problems:
        print("\nCOULD NOT REWRITE SAFELY (fix by hand, then run again):", file=sys.stderr)
        print("\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
