"""What each action of a schedule costs, per stage, from a profile: the one rule the
balancer (``gpipe.estimate.balance``) and the planner (``gpipe.planner``) simulate with.

Per micro-batch, for the layers of each stage:

* F: their forwards;
* B: with a split backward (zero-bubble schedules), the input-gradient parts; otherwise
  the whole backward. Re-materialization adds one more forward to B (the share of
  micro-batches that recompute);
* W: the weight-gradient parts (0 without a split backward).

The first stage computes no input gradient: under a split backward its B is only the
recomputation and its W the whole backward (``gpipe.engine.split_backward``). The loss is
in the last stage's costs when the profile was taken with one (``profile(..., target=,
loss_fn=)``). The profiled times are multiplied by ``slowdown`` (how much slower the
target runs them, e.g. with several processes sharing its cores) and ``overhead``
(seconds) is added to every action: the runtime's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpipe.base.remat import recompute_fraction
from gpipe.estimate.profile import Profile
from gpipe.estimate.ranges import spans
from gpipe.schedule.ir import Schedule
from gpipe.schedule.simulate import Costs

__all__ = ["layer_times", "stage_costs"]


def stage_costs(
    prof: Profile,
    balance: Sequence[int],
    schedule: Schedule,
    checkpoint: str,
    *,
    overhead: float = 0.0,
    slowdown: float = 1.0,
) -> Costs:
    """F, B and W of one micro-batch on each stage of ``balance`` under ``schedule``."""
    again = recompute_fraction(checkpoint, schedule.num_microbatches)
    split = any(
        schedule.splits_backward(s, m)
        for s in range(schedule.num_stages)
        for m in range(schedule.num_microbatches)
    )
    forward, backward, weight = [], [], []
    for s, (i, j) in enumerate(spans(balance)):
        layers = prof.layers[i:j]
        f = sum(lay.forward for lay in layers)
        whole = sum(lay.backward for lay in layers)
        if not split:
            b, w = whole + f * again, 0.0
        elif s == 0:  # no input gradient: B only recomputes, W is the whole backward
            b, w = f * again, whole
        else:
            b = sum(lay.backward_input for lay in layers) + f * again
            w = sum(lay.backward_weight for lay in layers)
        forward.append(f * slowdown + overhead)
        backward.append(b * slowdown + overhead)
        weight.append(w * slowdown + overhead if split else 0.0)
    return Costs(forward=forward, backward=backward, weight=weight)


def layer_times(
    prof: Profile, *, checkpoint: str = "never", chunks: int = 1, split: bool = False
) -> list[float]:
    """Seconds per micro-batch of each layer: forward (+ its share of recomputation) +
    backward (``split``: input-gradient and weight-gradient parts timed apart)."""
    again = recompute_fraction(checkpoint, chunks)
    return [
        lay.forward * (1.0 + again)
        + (lay.backward_input + lay.backward_weight if split else lay.backward)
        for lay in prof.layers
    ]
