"""Big models: captured on meta; each process gives values to its own units only.

References: the model built eagerly in one process (``torch.manual_seed(s); factory()``), and
the checkpoint directory ``save_pretrained`` writes from it (tiny random models, saved here).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gpipe
from captured_models import BUILDERS, CASES, reference_gradients, transformers, worst_error
from gpipe.base.errors import PartitionError
from gpipe.frontend import capture, materialize_units, origin_of

pytestmark = pytest.mark.skipif(transformers is None, reason="needs gpipe[hf] (transformers)")


def _eager(name: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[name](0.0)


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return BUILDERS[name](0.0)


def _assert_same(state: dict, expected: dict) -> None:
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("name", ["hf-llama", "hf-gpt2", "resnet"])
def test_a_function_is_replayed_bit_for_bit_for_any_cut(name):
    """Hugging Face's own _init_weights, torch's reset_parameters, rotary inv_freq: as one
    process builds them, whatever the cut. Cut after each of the first two units: a stage
    from the start, one that begins after the draws it skips, and one of several units (a
    cut [2, ...] makes no stage of another kind, and costs a capture per model)."""
    balance = [1, 1, CASES[name].units - 2]
    pipe = gpipe.Pipe.from_model(
        lambda: BUILDERS[name](0.0),
        CASES[name].example(torch.float32),
        split=CASES[name].split,
        balance=balance,
        chunks=2,
    )
    eager = _eager(name)
    _assert_same(pipe.state_dict(), eager.state_dict())
    # Captured on meta, it runs on the CPU: the graph's devices follow the tensors.
    case = CASES[name]
    inputs, targets = case.batch(dtype=torch.float32)
    loss = pipe.step(inputs, targets, case.loss)
    _, grads, _ = reference_gradients(case, eager, inputs, targets, chunks=2)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= 1e-5, (where, error)
    assert loss.isfinite()


@pytest.mark.parametrize("name", ["hf-llama", "hf-gpt2"])
def test_meta_model_filled_from_a_sharded_checkpoint(name, tmp_path):
    eager = _eager(name)
    eager.save_pretrained(tmp_path, max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    pipe = gpipe.Pipe.from_model(
        _meta(name), CASES[name].example(), split=CASES[name].split, weights=str(tmp_path),
        balance=[2, 3], chunks=2,
    )  # fmt: skip
    # GPT-2's checkpoint holds wte but not the tied lm_head: found by its other name.
    _assert_same(pipe.state_dict(), eager.state_dict())
    # Non-persistent buffers (Llama's rotary inv_freq) are recomputed, not read.
    buffers, expected = dict(pipe.named_buffers()), dict(eager.named_buffers())
    assert name != "hf-llama" or "model.rotary_emb.inv_freq" in buffers
    for key, value in buffers.items():
        assert torch.equal(value, expected[key]), key


def test_a_rank_reads_only_its_own_tensors(tmp_path, monkeypatch):
    eager = _eager("hf-llama")
    eager.save_pretrained(tmp_path, max_shard_size="20KB")
    model, origin = origin_of(_meta("hf-llama"), str(tmp_path), 0)
    units = capture(model, CASES["hf-llama"].example(), split="model.layers")
    read = []
    import safetensors

    real = safetensors.safe_open

    class Slice:  # reads when indexed, as transformers' loading does
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            read.append(self.name)
            return self.inner[index]

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_slice(self, name):
            return Slice(name, self.inner.get_slice(name))

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

        def keys(self):
            return self.inner.keys()

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    materialize_units(units, [2, 3], origin)  # the blocks model.layers.1 and .2
    assert read and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in read)
    assert any(t.is_meta for t in units[0].parameters())
    assert not any(t.is_meta for u in units[2:4] for t in u.parameters())


def test_meta_model_without_weights_uses_its_own_initialization_for_any_cut():
    # What from_model does, with the one capture (most of the time here) copied for each cut.
    model, origin = origin_of(_meta("hf-llama"), None, 0)
    units = capture(model, CASES["hf-llama"].example(), split="model.layers")
    units.origin = origin
    states = []
    for balance in ([2, 3], [1, 4]):
        pipe = gpipe.Pipe(copy.deepcopy(units), tied=units.tied, balance=balance, chunks=2)
        states.append(pipe.state_dict())
    _assert_same(states[1], states[0])
    eager = _eager("hf-llama").state_dict()
    for key, value in states[0].items():
        assert not value.is_meta
        if key.endswith("norm.weight"):
            assert torch.equal(value, eager[key])  # ones, as Hugging Face initializes them
        elif key.endswith("proj.weight"):
            assert abs(value.std().item() - 0.02) < 0.01  # initializer_range


def test_bad_weights_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors"):
        gpipe.Pipe.from_model(
            _meta("hf-llama"), CASES["hf-llama"].example(), split="model.layers",
            weights=str(tmp_path), balance=[2, 3], chunks=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="has values already"):
        gpipe.Pipe.from_model(
            _eager("hf-llama"), CASES["hf-llama"].example(), split="model.layers",
            weights=str(tmp_path), balance=[2, 3], chunks=2,
        )  # fmt: skip
    with pytest.raises(PartitionError, match="balance='auto' profiles the model"):
        gpipe.Pipe.from_model(
            _meta("hf-llama"), CASES["hf-llama"].example(), split="model.layers",
            balance="auto", chunks=2,
        )  # fmt: skip
    config = _eager("hf-llama").config
    config.intermediate_size = 48
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"9 tensors of another shape: .*\(16, 48\) in it"):
        gpipe.Pipe.from_model(
            _meta("hf-llama"), CASES["hf-llama"].example(), split="model.layers",
            weights=str(tmp_path), balance=[2, 3], chunks=2,
        )  # fmt: skip
