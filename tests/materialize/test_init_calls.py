"""The ``nn.init`` functions that do nothing on meta, recorded whole and replayed."""

from __future__ import annotations

import torch
from torch import nn

from gpipe.materialize.init_calls import InitCall, init_functions_recorded
from test_materialize import assert_cut_is_eager, eager, nn_init_zoo


class Calls:
    """A recording that only lists the calls handed to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def observe_call(self, call: InitCall, tensor, args, kwargs) -> None:
        self.calls.append((repr(call), tensor.shape, kwargs))


def test_calls_on_meta_go_to_the_recording_and_the_functions_are_put_back():
    original = nn.init.orthogonal_
    recording = Calls()
    with init_functions_recorded(recording):
        assert nn.init.orthogonal_ is not original
        nn.init.orthogonal_(torch.empty(3, 3, device="meta"), gain=2.0)
        real = nn.init.orthogonal_(torch.empty(3, 3))  # a real tensor: initialized as ever
        assert torch.allclose(real @ real.T, torch.eye(3), atol=1e-5)
    assert nn.init.orthogonal_ is original
    assert recording.calls == [("torch.nn.init.orthogonal_", (3, 3), {"gain": 2.0})]


def test_random_draws_and_generator_control_inside_the_factory():
    reference = eager(nn_init_zoo, 1)
    assert torch.equal(reference[2].weight[:, :, 1, 1], torch.eye(8))
    for cut in (range(0, 2), range(2, 5), [1, 4], [3], [5], [6, 7], [8]):
        assert_cut_is_eager(nn_init_zoo, cut, seed=1, reference=reference)
