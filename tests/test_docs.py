"""What the documentation cites exists, so that a rename cannot leave it stale.

Every ``gpipe.X.Y`` in README.md, docs/*.md, examples/ and benchmarks/, and in the strings
and comments of src/gpipe (docstrings, error messages), imports: a module of the package or
an attribute of one. Every path into the repository (``tests/...``, ``src/...``,
``benchmarks/...``, ``examples/...``, ``docs/...``), every relative link of a Markdown
file and every source file or folder a Markdown file names in backticks (``pipe/pipe.py``,
``parallel/group.py``: of the package, or of the repository) exists.
"""

from __future__ import annotations

import importlib
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gpipe"
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = sorted(
    [*(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"), *PACKAGE.rglob("*.py")]
)

# Not part of a longer word, path or attribute chain ("timeline-gpipe.png", "out.gpipe").
NAME = re.compile(r"(?<![\w./-])gpipe(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./-])(?:tests|src|benchmarks|examples|docs)/[\w./<>{}*-]*")
LINK = re.compile(r"\]\(([^)\s#]+)")
SOURCE = re.compile(r"(?<=`)[A-Za-z_][\w/]*(?:\.py|/)(?=`)")  # `parallel/group.py`, `planner/`


@cache  # three patterns read each file: tokenized once (every test worker collects this)
def prose(path: Path) -> str:
    """A Markdown file whole; of a Python file, its strings and comments (not its code,
    whose names the tests that run it check)."""
    text = path.read_text()
    if path.suffix == ".md":
        return text
    kinds = (tokenize.STRING, tokenize.COMMENT)
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return "\n".join(t.string for t in tokens if t.type in kinds)


def cited(pattern: re.Pattern, paths: list[Path]) -> list[tuple[str, str]]:
    return sorted(
        {(m.group(0), str(p.relative_to(ROOT))) for p in paths for m in pattern.finditer(prose(p))}
    )


@cache
def resolves(dotted: str) -> bool:
    """``dotted`` is a module, or an attribute (chain) of the longest module it starts with."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            value = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if not f"{module}.".startswith(f"{error.name}."):
                raise  # the module exists but needs something missing: a real failure
            continue
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


@pytest.mark.parametrize(("name", "where"), cited(NAME, MARKDOWN + PYTHON))
def test_every_gpipe_name_imports(name, where):
    assert resolves(name), f"{where} cites {name}, which does not import"


@pytest.mark.parametrize(("path", "where"), cited(PATH, MARKDOWN + PYTHON))
def test_every_cited_path_exists(path, where):
    if any(c in path for c in "<>{}*"):  # a pattern ("docs/img/timeline-<schedule>.png")
        return
    assert (ROOT / path.rstrip("./")).exists(), f"{where} cites {path}, which does not exist"


@pytest.mark.parametrize("markdown", MARKDOWN, ids=lambda p: p.name)
def test_every_relative_link_exists(markdown):
    links = [m.group(1) for m in LINK.finditer(markdown.read_text())]
    missing = [
        link
        for link in links
        if "://" not in link and not link.startswith("mailto:")
        if not (markdown.parent / link).exists()
    ]
    assert not missing, f"{markdown.name} links to missing files: {missing}"


@pytest.mark.parametrize(("path", "where"), cited(SOURCE, MARKDOWN))
def test_every_source_file_in_backticks_exists(path, where):
    """``parallel/group.py``, ``planner/`` (most are in docs/architecture.md's table): a
    module of the package, or a file of the repository."""
    assert (PACKAGE / path).exists() or (ROOT / path).exists(), f"{where} cites {path!r}"
