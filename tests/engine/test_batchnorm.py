"""Tests for gpipe.batchnorm: every check has a plain nn.BatchNorm reference.

The reference for running statistics is one nn.BatchNorm training forward on the whole mini-batch;
the reference for outputs and gradients is nn.BatchNorm in training mode on each micro-batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gpipe.base.remat import recomputing
from gpipe.engine.batchnorm import DeferredBatchNorm, commit_all, reset_all

SIZES = [3, 3, 2, 2]  # a batch of 10 in 4 uneven micro-batches
C = 4

# (plain class, input shape for a batch of 10)
KINDS = {
    "1d-2D": (nn.BatchNorm1d, (10, C)),
    "1d-3D": (nn.BatchNorm1d, (10, C, 5)),
    "2d": (nn.BatchNorm2d, (10, C, 3, 3)),
    "3d": (nn.BatchNorm3d, (10, C, 2, 3, 2)),
}
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def make_pair(kind: str, dtype: torch.dtype, **kwargs) -> tuple[nn.Module, DeferredBatchNorm]:
    """A plain batch norm with non-trivial state, and its deferred conversion of a deep copy."""
    cls, _ = KINDS[kind]
    plain = cls(C, dtype=dtype, **kwargs)
    with torch.no_grad():
        if plain.affine:
            plain.weight.uniform_(0.5, 1.5)
            plain.bias.uniform_(-0.5, 0.5)
        if plain.track_running_stats:
            plain.running_mean.uniform_(-1, 1)
            plain.running_var.uniform_(0.5, 2)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    assert isinstance(deferred, DeferredBatchNorm)
    return plain, deferred


def make_input(kind: str, dtype: torch.dtype, shift: float = 0.0) -> torch.Tensor:
    shape = KINDS[kind][1]
    # Channels differ in mean and scale, so a mix-up between channels would show.
    channel = torch.arange(C, dtype=dtype).view(1, C, *[1] * (len(shape) - 2))
    return shift + channel + torch.randn(shape, dtype=dtype) * (1 + channel)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    err = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert err <= rtol, f"relative error {err:.3g} > {rtol:g}"


def assert_same_running_stats(deferred: nn.Module, plain: nn.Module, dtype: torch.dtype) -> None:
    assert deferred.num_batches_tracked.item() == plain.num_batches_tracked.item()
    assert deferred.running_mean.dtype == plain.running_mean.dtype
    assert_rel_close(deferred.running_mean, plain.running_mean, RTOL[dtype])
    assert_rel_close(deferred.running_var, plain.running_var, RTOL[dtype])


def run_microbatches(layer: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [layer(mb) for mb in x.split(SIZES)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cma"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_running_stats_match_whole_batch(kind, momentum, dtype):
    torch.manual_seed(0)
    plain, deferred = make_pair(kind, dtype, momentum=momentum)
    for step in range(2):  # two mini-batches: the second starts from committed buffers
        x = make_input(kind, dtype)
        before = deferred.running_mean.clone()
        run_microbatches(deferred, x)
        assert torch.equal(deferred.running_mean, before)  # untouched until commit
        assert deferred.num_batches_tracked.item() == step
        deferred.commit()
        plain(x)
        assert_same_running_stats(deferred, plain, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_outputs_and_gradients_match_plain_per_microbatch(kind, dtype):
    torch.manual_seed(1)
    plain, deferred = make_pair(kind, dtype)
    x = make_input(kind, dtype)
    grad_out = torch.randn_like(x)
    inputs = {}
    for name, layer in (("plain", plain), ("deferred", deferred)):
        xs = [mb.clone().requires_grad_() for mb in x.split(SIZES)]
        for mb, g in zip(xs, grad_out.split(SIZES), strict=True):
            out = layer(mb)
            out.backward(g)
            inputs.setdefault(name, []).append((out.detach(), mb.grad))
    for (out_p, gx_p), (out_d, gx_d) in zip(inputs["plain"], inputs["deferred"], strict=True):
        torch.testing.assert_close(out_d, out_p, rtol=0, atol=0)
        torch.testing.assert_close(gx_d, gx_p, rtol=0, atol=0)
    torch.testing.assert_close(deferred.weight.grad, plain.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(deferred.bias.grad, plain.bias.grad, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_large_mean_keeps_variance(dtype):
    # With mean 1e4 and unit variance, E[x^2] - E[x]^2 loses ~8 digits to cancellation.
    torch.manual_seed(2)
    plain, deferred = make_pair("2d", dtype)
    x = make_input("2d", dtype, shift=1e4)
    run_microbatches(deferred, x)
    deferred.commit()
    plain(x)
    assert_same_running_stats(deferred, plain, dtype)


def test_recomputation_does_not_accumulate():
    torch.manual_seed(3)
    plain, deferred = make_pair("2d", torch.float64)
    x = make_input("2d", torch.float64)
    with recomputing():
        out_recomputed = run_microbatches(deferred, x)
    deferred.commit()
    assert deferred.num_batches_tracked.item() == 0
    assert torch.equal(deferred.running_mean, plain.running_mean)
    assert torch.equal(deferred.running_var, plain.running_var)

    # A step whose micro-batches are each computed once and recomputed once counts them once.
    outputs = []
    for mb in x.split(SIZES):
        outputs.append(deferred(mb))
        with recomputing():
            deferred(mb)
    deferred.commit()
    plain(x)
    assert_same_running_stats(deferred, plain, torch.float64)
    for a, b in zip(outputs, out_recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # recomputation gives the same output


def test_eval_matches_plain_eval():
    torch.manual_seed(4)
    plain, deferred = make_pair("1d-3D", torch.float32)
    x = make_input("1d-3D", torch.float32)
    run_microbatches(deferred, x)
    deferred.commit()
    plain(x)
    plain.eval()
    deferred.eval()
    y = make_input("1d-3D", torch.float32)
    torch.testing.assert_close(deferred(y), plain(y))
    run_microbatches(deferred, y)  # eval forwards accumulate nothing
    deferred.commit()
    assert deferred.num_batches_tracked.item() == 1


def test_commit_without_forward_is_noop():
    _, deferred = make_pair("2d", torch.float32)
    state = copy.deepcopy(deferred.state_dict())
    deferred.commit()
    for key, value in deferred.state_dict().items():
        assert torch.equal(value, state[key])


def test_reset_accumulators_drops_partial_statistics():
    torch.manual_seed(5)
    plain, deferred = make_pair("2d", torch.float64)
    run_microbatches(deferred, make_input("2d", torch.float64, shift=3.0))  # a failed step
    deferred.reset_accumulators()
    x = make_input("2d", torch.float64)
    run_microbatches(deferred, x)
    deferred.commit()
    plain(x)
    assert_same_running_stats(deferred, plain, torch.float64)


def test_without_running_stats_is_plain_batch_norm():
    torch.manual_seed(6)
    plain, deferred = make_pair("2d", torch.float32, track_running_stats=False)
    assert deferred.running_mean is None and deferred.num_batches_tracked is None
    x = make_input("2d", torch.float32)
    for mb in x.split(SIZES):
        torch.testing.assert_close(deferred(mb), plain(mb), rtol=0, atol=0)
    deferred.commit()  # nothing to commit
    deferred.eval()
    plain.eval()
    torch.testing.assert_close(deferred(x), plain(x), rtol=0, atol=0)  # batch stats in eval too


def test_without_affine():
    torch.manual_seed(7)
    plain, deferred = make_pair("1d-2D", torch.float64, affine=False)
    assert deferred.weight is None and deferred.bias is None
    per_microbatch = copy.deepcopy(plain)  # keeps `plain` for the whole-batch reference
    x = make_input("1d-2D", torch.float64)
    for mb, out in zip(x.split(SIZES), run_microbatches(deferred, x), strict=True):
        torch.testing.assert_close(out, per_microbatch(mb), rtol=0, atol=0)
    deferred.commit()
    plain(x)
    assert_same_running_stats(deferred, plain, torch.float64)


def test_convert_nested_model_keeps_state_dict_and_parameters():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8, momentum=None, eps=1e-3),
        nn.ReLU(),
        nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4, 6), nn.BatchNorm1d(6, affine=False)),
    )
    model[1].running_mean.fill_(0.5)
    model.eval()
    before = model.state_dict()
    params = dict(model.named_parameters())

    converted = DeferredBatchNorm.convert(model)
    assert converted is model
    bn2d, bn1d = model[1], model[3][2]
    assert isinstance(bn2d, DeferredBatchNorm) and isinstance(bn1d, DeferredBatchNorm)
    assert bn2d.momentum is None and bn2d.eps == 1e-3 and not bn2d.training
    assert not bn1d.affine
    after = model.state_dict()
    assert list(after) == list(before)
    for key in before:
        assert after[key] is before[key] or after[key].data_ptr() == before[key].data_ptr()
        assert torch.equal(after[key], before[key])
    for name, p in model.named_parameters():
        assert p is params[name]  # shared: an optimizer built before conversion still works

    # Loads into, and from, the plain model.
    plain = nn.BatchNorm2d(8, momentum=None, eps=1e-3)
    plain.load_state_dict({k[2:]: v for k, v in after.items() if k.startswith("1.")})
    bn2d.load_state_dict(plain.state_dict())


def test_convert_root_batch_norm_and_input_checks():
    for cls, good, bad, message in [
        (nn.BatchNorm1d, (4, 3), (4, 3, 2, 2), "expected 2D or 3D input (got 4D input)"),
        (nn.BatchNorm2d, (4, 3, 2, 2), (4, 3, 2), "expected 4D input (got 3D input)"),
        (nn.BatchNorm3d, (4, 3, 2, 2, 2), (4, 3, 2, 2), "expected 5D input (got 4D input)"),
    ]:
        bn = DeferredBatchNorm.convert(cls(3))
        assert isinstance(bn, DeferredBatchNorm)
        bn(torch.randn(good))
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            bn(torch.randn(bad))
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 1D input\)"):
        DeferredBatchNorm(3)(torch.randn(3))


def test_convert_leaves_other_layers_alone():
    class MyBatchNorm(nn.BatchNorm2d):
        pass

    model = nn.Sequential(nn.SyncBatchNorm(4), MyBatchNorm(4), nn.LayerNorm(4))
    DeferredBatchNorm.convert(model)
    assert [type(m) for m in model] == [nn.SyncBatchNorm, MyBatchNorm, nn.LayerNorm]
    already = DeferredBatchNorm(4)
    assert DeferredBatchNorm.convert(already) is already


def test_convert_rejects_uninitialized_lazy_batch_norm():
    with pytest.raises(ValueError, match=r"LazyBatchNorm2d.*run one forward pass"):
        DeferredBatchNorm.convert(nn.Sequential(nn.LazyBatchNorm2d()))
    lazy = nn.LazyBatchNorm2d()
    lazy(torch.randn(2, 3, 2, 2))  # now a BatchNorm2d
    assert isinstance(DeferredBatchNorm.convert(lazy), DeferredBatchNorm)


def test_commit_all_and_reset_all_on_nested_model():
    torch.manual_seed(8)
    model = nn.Sequential(
        nn.Linear(5, C), nn.BatchNorm1d(C), nn.Sequential(nn.ReLU(), nn.BatchNorm1d(C))
    )
    references = {name: copy.deepcopy(model.get_submodule(name)) for name in ("1", "2.1")}
    DeferredBatchNorm.convert(model)
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in references}
    for name in references:
        model.get_submodule(name).register_forward_pre_hook(
            lambda _, args, name=name: seen[name].append(args[0].detach())
        )
    run_microbatches(model, torch.randn(10, 5))  # a failed step
    reset_all(model)
    for inputs in seen.values():
        inputs.clear()
    run_microbatches(model, torch.randn(10, 5))
    commit_all(model)
    for name, plain in references.items():
        # Each layer's reference: one plain forward on everything that layer saw this step (the
        # second layer sees per-micro-batch normalized inputs, not a whole-batch normalization).
        plain(torch.cat(seen[name]))
        assert_same_running_stats(model.get_submodule(name), plain, torch.float32)
