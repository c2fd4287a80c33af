"""The seam between the front end and its ranks: ``PipelineGroup`` (one process), whose every
method ``MultiProcess`` overrides, and which is all that ``gpipe.pipe`` asks of them. (What
each method does is tested through Pipes: tests/pipe/test_pipe.py in one process,
test_distributed.py in many.)"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

import gpipe.pipe
import gpipe.pipe.assembly
from gpipe.base.errors import PartitionError
from gpipe.parallel.group import MultiProcess, PipelineGroup, pipeline_group

# Written once for both, through ``gather`` (which a process group overrides).
SHARED = {"check_same", "decide"}
METHODS = {
    name: member
    for name, member in vars(PipelineGroup).items()
    if inspect.isfunction(member) and not name.startswith("_")
}
ATTRIBUTES = set(PipelineGroup.__annotations__)


def test_a_process_group_overrides_every_method_of_one_process():
    """Nothing of one process's behaviour is inherited by the ranks of a group unawares."""
    for name, method in METHODS.items():
        if name in SHARED:
            assert name not in vars(MultiProcess), f"{name} is written once: drop SHARED's"
            continue
        theirs = getattr(MultiProcess, name)
        assert theirs is not method, f"MultiProcess does not override {name}()"
        wanted = inspect.signature(method).parameters
        given = inspect.signature(theirs).parameters
        assert [(p.name, p.kind) for p in given.values()] == [
            (p.name, p.kind) for p in wanted.values()
        ], f"MultiProcess.{name} takes {list(given)}, PipelineGroup's {list(wanted)}"
    missing = ATTRIBUTES - set(MultiProcess.__annotations__)
    assert not missing, f"MultiProcess does not declare {sorted(missing)}"


def test_the_front_end_asks_only_what_the_protocol_offers():
    """Every attribute ``gpipe.pipe`` reads from the object ``pipeline_group`` gave it, and
    ``gpipe.pipe.assembly`` from the ``ranks`` it is handed."""
    tree = ast.parse(Path(gpipe.pipe.pipe.__file__).read_text())
    holders = {
        ast.unparse(target)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and ast.unparse(node.value.func) == "pipeline_group"
        for target in node.targets
    }
    assert holders, "gpipe.pipe no longer calls pipeline_group: update this test"
    asked = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in holders
    }
    assert asked, holders
    steps = ast.parse(Path(gpipe.pipe.assembly.__file__).read_text())
    by_steps = {
        node.attr
        for node in ast.walk(steps)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "ranks"
    }
    assert by_steps, "gpipe.pipe.assembly no longer takes ranks: update this test"
    asked |= by_steps
    assert asked <= set(METHODS) | ATTRIBUTES, sorted(asked - set(METHODS) - ATTRIBUTES)


def test_one_process_exchange_gathers_on_the_last_holder():
    group = pipeline_group(None, timeout=1.0)
    assert type(group) is PipelineGroup and group.rank is None and group.broken is None
    mine = {0: torch.ones(2), 2: torch.full((2,), 3.0)}
    exchanged = group.exchange([0, 2], mine)
    assert set(exchanged) == {0, 2} and torch.equal(exchanged[2], mine[2])
    assert torch.equal(exchanged[0], mine[0])


def test_ranks_built_differently_are_refused_naming_each_value_as_written():
    """A configuration holds each value's repr (``gpipe.pipe.partition.fingerprint``): the
    refusal shows it once, as the user wrote it ('auto', not "'auto'")."""

    class TwoRanks(PipelineGroup):
        def gather(self, value, what):
            return [value, {**value, "transport": repr("auto"), "chunks": repr(2)}]

    settings = {"transport": repr("group"), "chunks": repr(4), "model": "3fa9"}
    said = "- transport: rank 1 has 'auto', rank 0 has 'group'\n- chunks: rank 1 has 2, rank 0 "
    with pytest.raises(PartitionError, match=said):
        TwoRanks().check_same(settings)
