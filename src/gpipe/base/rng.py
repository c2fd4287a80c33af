"""Random numbers that do not depend on how the model is cut or scheduled.

Dropout draws from the generator of the device it runs on. In a pipeline the order in
which (layer, micro-batch) pairs run depends on K, the schedule and the process layout,
so drawing from one shared stream would give different masks for every configuration,
and a recomputed forward would draw new ones. gpipe instead seeds the device generator
before every layer of every micro-batch with :func:`layer_seed` of (step seed, layer
index, micro-batch) — every layer that may draw: :func:`draws_nothing` spares the torch.nn
layers known not to — so masks are the same for any cut and schedule, and re-running a
forward (re-materialization) replays them exactly. The caller's generator state is
restored afterwards: a step consumes one draw of the global generator (its seed), on every
rank alike when multi-process (rank 0's draw is the seed), so that what a script draws next
(a shuffled ``DataLoader``'s order) is the same on every rank.

What this does not give: the masks change with the number of micro-batches, and they are
not the masks a plain ``model(x)`` would draw from the global stream; a plain run matches
only when it seeds each layer the same way, as the reference below does.

A non-pipelined reference reproduces the same masks with :func:`seeded`::

    for m, (x_m, y_m) in enumerate(zip(xs, ys)):
        for i, layer in enumerate(model):
            with gpipe.base.rng.seeded(gpipe.base.rng.layer_seed(seed, i, m), x_m.device):
                x_m = layer(x_m)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["device_generator", "draw_step_seed", "draws_nothing", "layer_seed", "seeded"]

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    # A well-mixed 64-bit hash so that neighbouring (layer, micro-batch) pairs get
    # unrelated seeds.
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_seed(step_seed: int, layer: int, microbatch: int) -> int:
    """The seed for one layer (index in the whole model) on one micro-batch."""
    mixed = _splitmix64(_splitmix64(_splitmix64(step_seed) ^ layer) ^ microbatch)
    return mixed >> 1  # torch seeds must fit a signed 64-bit integer


# Layers whose forward never draws a random number, by exact type: a subclass may
# override forward, and a module not listed (any custom one) is assumed to draw. Seeding
# a layer costs a few microseconds, which is most of a tiny layer's time.
# fmt: off
_DRAW_NOTHING = frozenset({
    nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.Linear, nn.Bilinear, nn.LazyLinear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d,
    nn.ConvTranspose2d, nn.ConvTranspose3d, nn.Embedding, nn.EmbeddingBag, nn.LayerNorm,
    nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.BatchNorm1d, nn.BatchNorm2d,
    nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
    nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Hardshrink,
    nn.Softshrink, nn.Tanhshrink, nn.Softplus, nn.Softsign, nn.LogSigmoid, nn.Threshold, nn.GLU,
    nn.Softmax, nn.Softmax2d, nn.LogSoftmax, nn.Softmin, nn.MaxPool1d, nn.MaxPool2d,
    nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d, nn.LPPool1d, nn.LPPool2d, nn.Upsample, nn.UpsamplingNearest2d,
    nn.UpsamplingBilinear2d, nn.PixelShuffle, nn.PixelUnshuffle, nn.ZeroPad1d, nn.ZeroPad2d,
    nn.ZeroPad3d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ReflectionPad1d,
    nn.ReflectionPad2d, nn.ReplicationPad1d, nn.ReplicationPad2d, nn.ReplicationPad3d,
    nn.CosineSimilarity, nn.PairwiseDistance, nn.ChannelShuffle,
})
# fmt: on


def draws_nothing(module: nn.Module) -> bool:
    """Whether ``module``'s forward surely draws no random numbers: it and everything in
    it are torch.nn layers known not to (dropout, ``RReLU`` and any other module may)."""
    return all(type(m) in _DRAW_NOTHING for m in module.modules())


def draw_step_seed() -> int:
    """One draw from torch's global CPU generator: the seed of a training step."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def device_generator(device: torch.device) -> torch.Generator:
    """The default generator that random ops on ``device`` draw from."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


@contextmanager
def preserved(device: torch.device) -> Iterator[torch.Generator]:
    """Restore ``device``'s generator state on exit; yields the generator."""
    generator = device_generator(device)
    state = generator.get_state()
    try:
        yield generator
    finally:
        generator.set_state(state)


@contextmanager
def seeded(seed: int, device: torch.device | str) -> Iterator[None]:
    """Run the enclosed code with ``device``'s generator seeded by ``seed``, then restore it."""
    with preserved(torch.device(device)) as generator:
        generator.manual_seed(seed)
        yield
