"""``import gpipe``: the front end at once, every other module of the package on first use."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpipe

MODULES = sorted(m.name for m in pkgutil.iter_modules(gpipe.__path__) if not m.name.startswith("_"))
# What the README names as gpipe.NAME and ``import gpipe`` leaves unloaded (they are slow
# to import, or need optional packages).
LAZY = ["models", "train"]


@pytest.mark.slow
def test_the_lazy_modules_are_not_imported_by_import_gpipe():
    # A fresh interpreter: this one has imported them already through the other tests.
    script = f"import gpipe, sys; print([m for m in {LAZY} if 'gpipe.' + m in sys.modules])"
    command = [sys.executable, "-c", script]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = run.stdout.strip()
    assert loaded == "[]"


@pytest.mark.parametrize("name", MODULES)
def test_every_module_is_an_attribute(name):
    module = getattr(gpipe, name)
    assert module is sys.modules[f"gpipe.{name}"]
    assert name in dir(gpipe)


def test_the_readme_names_work():
    assert set(LAZY) <= set(MODULES)
    assert callable(gpipe.train.run) and callable(gpipe.train.resolve)
    assert callable(gpipe.models.gpt) and callable(gpipe.train.data.stdlib_bytes)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'gpipe' has no attribute 'nothing_here'"):
        gpipe.nothing_here  # noqa: B018
    assert not hasattr(gpipe, "_private_thing")
    assert not hasattr(gpipe, "__wrapped__")  # asked by inspect and doctest: no import attempted


# -- tests mirror the code -------------------------------------------------------------------

SRC = Path(gpipe.__file__).parent
TESTS = Path(__file__).parent
# Modules with no behaviour of their own to test (exception classes).
PURE_DATA = {"base/errors"}


def _unmirrored() -> set[str]:
    """src/gpipe/PACKAGE/MODULE.py without a tests/PACKAGE/test_MODULE.py."""
    found = set()
    for path in SRC.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        module = path.relative_to(SRC).with_suffix("")
        if not (TESTS / module.parent / f"test_{module.name.lstrip('_')}.py").exists():
            found.add(module.as_posix())
    return found


def test_each_module_with_behaviour_has_its_own_test_module():
    missing = sorted(_unmirrored() - PURE_DATA)
    assert not missing, f"{missing}: no tests/<package>/test_<module>.py; write or move one"
