"""Per-stage F, B and W costs of a cut (``stage_costs``) and per-layer times."""

from __future__ import annotations

import pytest

from gpipe.estimate.costs import layer_times, stage_costs
from gpipe.estimate.profile import Profile
from gpipe.schedule import build_schedule


def test_stage_costs_give_the_first_stage_an_empty_b_and_the_whole_backward_as_w():
    prof = Profile.from_costs([1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0], weight_fraction=0.25)
    split = build_schedule("zb-h1", num_ranks=2, num_microbatches=4)
    costs = stage_costs(prof, [2, 2], split, "never")
    assert costs.forward == [3.0, 7.0]
    assert costs.backward == [0.0, 14.0 * 0.75]  # stage 0 computes no input gradient
    assert costs.weight == [6.0, 14.0 * 0.25]  # ... so its W is its whole backward
    whole = stage_costs(prof, [2, 2], build_schedule("1f1b", num_ranks=2, num_microbatches=4),
                        "always")  # fmt: skip
    assert whole.backward == [6.0 + 3.0, 14.0 + 7.0] and whole.weight == [0.0, 0.0]


def test_layer_times_add_the_recomputed_share_of_the_forward():
    prof = Profile.from_costs([1.0, 2.0], [4.0, 6.0], weight_fraction=0.25)
    assert layer_times(prof) == [5.0, 8.0]
    # except_last over 4 micro-batches: 3 of 4 forwards run twice
    assert layer_times(prof, checkpoint="except_last", chunks=4) == pytest.approx([5.75, 9.5])
    assert layer_times(prof, split=True) == pytest.approx([5.0, 8.0])  # B + W is the backward
