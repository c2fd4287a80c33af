"""The memory model: how many micro-batches each stage holds, and what a stage needs."""

from __future__ import annotations

from gpipe.estimate.memory_model import Held, held_microbatches
from gpipe.schedule import build_schedule


def test_held_microbatches_follow_the_schedule():
    def held(name, mode, k=4, m=8):
        schedule = build_schedule(name, num_ranks=k, num_microbatches=m)
        return [(h.boundary, h.inner) for h in held_microbatches(schedule, mode)]

    assert held("gpipe", "never") == [(8, 8)] * 4
    assert held("gpipe", "always") == [(8, 1)] * 4
    assert held("1f1b", "always") == [(4, 1), (3, 1), (2, 1), (1, 1)]
    assert held("1f1b", "except_last") == [(4, 2), (3, 2), (2, 2), (1, 1)]
    # zero bubble keeps a recomputed graph until its deferred W
    assert held("zb-h1", "always") == [(4, 1), (4, 2), (4, 3), (4, 4)]
    assert Held(2, 1) == Held(boundary=2, inner=1)
    # ... of which all but one wait for W past their B (they hold less: see test_profile)
    schedule = build_schedule("zb-h1", num_ranks=4, num_microbatches=8)
    assert [h.after_input_grad for h in held_microbatches(schedule, "always")] == [0, 1, 2, 3]
    one_f_one_b = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    assert all(h.after_input_grad == 0 for h in held_microbatches(one_f_one_b, "never"))
