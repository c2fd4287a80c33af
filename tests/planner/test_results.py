"""A capacity's answer when nothing fits: the stage, its largest term, the shortfall, the fix."""

from __future__ import annotations

import pytest

from gpipe.base._utils import MiB
from gpipe.planner import capacity
from gpipe.planner.families import gpt_family
from gpipe.planner.results import NothingFits


def test_nothing_fits_names_the_stage_the_term_and_the_shortfall():
    family = gpt_family(d_model=32, heads=2, seq=8, vocab=4096, batch=4)
    # the embedding and the head hold 4096 x 32 floats each: 2 MiB each with AdamW
    result = capacity(
        family, memory_budget=3.5 * MiB, processes=1, chunks=[1], checkpoints=["never"]
    )
    with pytest.raises(NothingFits) as caught:
        result.best  # noqa: B018
    text = str(caught.value)
    row = result.rows[0]
    over = max(row.missing)
    assert not row.fits and over > 0
    assert "stage 0" in text and "optimizer" in text  # AdamW's state is the largest term
    assert f"{over / MiB:.1f} MiB over" in text
    assert f"a budget of {(3.5 * MiB + over) / MiB:.1f} MiB" in text
    assert "K >= 2" in text  # the two big layers on two processes fit
    assert "nothing fits" in result.table()
