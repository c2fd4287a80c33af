"""Weights load whole or not at all, under the names from_pretrained gives them.

References: ``from_pretrained`` of the same directory (its state, and the keys it reports
missing or unexpected) and plain training of that model; tiny models saved here.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import gpipe
from captured_models import BUILDERS, CASES, reference_gradients, transformers, worst_error
from gpipe.frontend import CheckpointError, WeightsError
from gpipe.parallel.launch import launch

pytestmark = pytest.mark.skipif(transformers is None, reason="needs gpipe[hf] (transformers)")

LLAMA = CASES["hf-llama"]


def _mixtral_config():
    return transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip


def _mixtral():
    return transformers.MixtralForCausalLM(_mixtral_config())


def _on_meta(build):
    with torch.device("meta"):
        return build()


def _saved(build, path, **options):
    torch.manual_seed(0)
    build().save_pretrained(path, **options)
    return path


def _llama(layers: int = 3):
    config = BUILDERS["hf-llama"](0.0).config
    config.num_hidden_layers = layers
    return transformers.LlamaForCausalLM(config)


def _pretrained(cls, path, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(path, **options)


def _assert_state_is(pipe, reference):
    state, expected = pipe.state_dict(), reference.state_dict()
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def _assert_trains_as(pipe, reference, case=LLAMA):
    inputs, targets = case.batch(dtype=torch.float32)
    loss = pipe.step(inputs, targets, case.loss)
    expected, grads, _ = reference_gradients(case, reference.train(), inputs, targets, pipe.chunks)
    error, where = worst_error(pipe.named_parameters(remove_duplicate=False), grads)
    assert error <= 1e-5, (where, error)
    assert float(loss) == pytest.approx(expected, rel=1e-5)


def _rewrite(path, drop: str):
    """``path``'s single-file checkpoint without the tensor ``drop``."""
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    del state[drop]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


# -- whole: every tensor loaded, as from_pretrained loads it ------------------------------------


def test_mixtral_saved_per_expert_loads_its_fused_experts_as_from_pretrained(tmp_path):
    """transformers 5 saves Mixtral's experts one by one (experts.0.w1.weight) and fuses them
    at load (mlp.experts.gate_up_proj): the router and experts were silently random before."""
    _saved(_mixtral, tmp_path)
    with open(tmp_path / "model.safetensors", "rb") as f:
        assert b"block_sparse_moe.experts.0.w1.weight" in f.read(4096)
    pipe = gpipe.Pipe.from_model(
        _on_meta(_mixtral), LLAMA.example(), weights=tmp_path, balance=[2, 2], chunks=2
    )
    reference = _pretrained(transformers.MixtralForCausalLM, tmp_path)
    _assert_state_is(pipe, reference)
    _assert_trains_as(pipe, reference)  # on the CPU, though captured without values


def test_a_function_with_weights_loads_them(tmp_path):
    """It failed for every model, dense too ("cannot reproduce ... made on meta outside
    factory()"); a function building an MoE failed at its first step on the CPU."""
    _saved(_mixtral, tmp_path, max_shard_size="20KB")
    pipe = gpipe.Pipe.from_model(
        _mixtral, LLAMA.example(), weights=tmp_path, balance=[2, 2], chunks=2
    )
    reference = _pretrained(transformers.MixtralForCausalLM, tmp_path)
    _assert_state_is(pipe, reference)
    _assert_trains_as(pipe, reference)


# -- or not at all: the build stops, naming what from_pretrained reports ------------------------


def _refused(model, path) -> WeightsError:
    with pytest.raises(WeightsError) as caught:
        gpipe.Pipe.from_model(model, LLAMA.example(), weights=path, balance=[2, 3], chunks=2)
    return caught.value


def _loading_info(cls, path, **options):
    _, info = _pretrained(cls, path, output_loading_info=True, **options)
    return info


def test_a_missing_tensor_stops_the_build_naming_it(tmp_path):
    _saved(_llama, tmp_path)
    _rewrite(tmp_path, "model.layers.1.mlp.up_proj.weight")
    info = _loading_info(transformers.LlamaForCausalLM, tmp_path)
    error = _refused(_on_meta(_llama), tmp_path)
    assert (
        set(error.report.missing)
        == set(info["missing_keys"])
        == {"model.layers.1.mlp.up_proj.weight"}
    )
    assert "1 tensor of the model not in it: model.layers.1.mlp.up_proj.weight" in str(error)
    assert "strict=False" in str(error)


def test_another_models_checkpoint_is_refused(tmp_path):
    """A GPT-2 directory for a Llama: before, 23 of its 30 tensors were silently random."""
    _saved(lambda: BUILDERS["hf-gpt2"](0.0), tmp_path)
    info = _loading_info(transformers.LlamaForCausalLM, tmp_path, config=_llama().config)
    error = _refused(_on_meta(_llama), tmp_path)
    assert set(error.report.missing) == set(info["missing_keys"])
    assert set(error.report.unexpected) == set(info["unexpected_keys"])
    assert len(error.report.missing) > 20 and len(error.report.unexpected) > 20
    assert "another model or configuration" in str(error)


def test_a_checkpoint_with_fewer_layers_is_refused(tmp_path):
    _saved(lambda: _llama(2), tmp_path)
    info = _loading_info(transformers.LlamaForCausalLM, tmp_path, config=_llama(3).config)
    error = _refused(_on_meta(_llama), tmp_path)
    assert set(error.report.missing) == set(info["missing_keys"])
    assert error.report.missing and all(
        n.startswith("model.layers.2.") for n in error.report.missing
    )


def test_tensors_of_another_shape_are_refused(tmp_path):
    def wider():
        config = _llama().config
        config.intermediate_size = 48
        return transformers.LlamaForCausalLM(config)

    _saved(wider, tmp_path)
    info = _loading_info(
        transformers.LlamaForCausalLM, tmp_path, config=_llama().config,
        ignore_mismatched_sizes=True,
    )  # fmt: skip
    error = _refused(_on_meta(_llama), tmp_path)
    assert {n for n, _, _ in error.report.mismatched} == {n for n, *_ in info["mismatched_keys"]}
    assert "(16, 48) in it, (16, 32) in the model" in str(error)


def test_strict_false_initializes_what_is_missing_and_says_so(tmp_path):
    _saved(_llama, tmp_path)
    missing = "model.layers.1.mlp.up_proj.weight"
    _rewrite(tmp_path, missing)
    with pytest.warns(UserWarning, match=rf"1 tensor of the model not in it: {missing}"):
        pipe = gpipe.Pipe.from_model(
            _on_meta(_llama), LLAMA.example(), weights=tmp_path, strict=False,
            balance=[2, 3], chunks=2,
        )  # fmt: skip
    reference = _pretrained(transformers.LlamaForCausalLM, tmp_path)
    state = pipe.state_dict()
    for key, value in reference.state_dict().items():
        if key != missing:
            assert torch.equal(state[key], value), key
    assert state[missing].isfinite().all() and state[missing].std() > 0  # initialized
    reference.load_state_dict(state)  # the initialized tensor too: then plain training
    _assert_trains_as(pipe, reference)


# -- damaged files: named with their path -------------------------------------------------------


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (_truncate, r"is truncated: \d+ bytes, but its header describes \d+"),
        (lambda p: p.write_bytes(b"\x00\xff" * 300), "is not a safetensors file"),
        (lambda p: p.write_bytes(b""), r"is empty \(0 bytes\)"),
    ],
    ids=["truncated", "garbage", "empty"],
)
def test_a_damaged_file_is_named_with_what_is_wrong(damage, said, tmp_path):
    _saved(_llama, tmp_path)
    file = tmp_path / "model.safetensors"
    damage(file)
    with pytest.raises(Exception):  # noqa: B017 (the reference fails too, without the path)
        _pretrained(transformers.LlamaForCausalLM, tmp_path)
    with pytest.raises(CheckpointError, match=rf"{file} {said}.*save it again"):
        gpipe.Pipe.from_model(
            _on_meta(_llama), LLAMA.example(), weights=tmp_path, balance=[2, 3], chunks=2
        )


def test_an_index_that_lists_a_missing_shard_is_named(tmp_path):
    _saved(_llama, tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"lists shards that do not exist: .*{shard}"):
        gpipe.Pipe.from_model(
            _on_meta(_llama), LLAMA.example(), weights=tmp_path, balance=[2, 3], chunks=2
        )


# -- every rank stops, none waits ---------------------------------------------------------------


SKIPS = CASES["skips"]  # a plain model: quick to capture in each process


def _skips():
    return SKIPS.build(torch.float32)


def _build_from(rank: int, paths: list[str]) -> list[dict]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcomes = []
    for path in paths:
        try:
            gpipe.Pipe.from_model(
                _on_meta(_skips), SKIPS.example(torch.float32), split=SKIPS.split,
                weights=path, chunks=2, group=dist.group.WORLD, timeout=20,
            )  # fmt: skip
            outcomes.append({"type": None, "message": ""})
        except Exception as error:
            outcomes.append({"type": type(error).__name__, "message": str(error)})
    return outcomes


def _save_in_two_shards(state: dict, path, second: tuple[str, ...]):
    """``state`` as two shards and an index, the names starting with ``second`` in the
    second shard; returns that shard."""
    from safetensors.torch import save_file

    path.mkdir()
    shards = {"a.safetensors": {}, "b.safetensors": {}}
    for name, value in state.items():
        shards["b.safetensors" if name.startswith(second) else "a.safetensors"][name] = value
    for file, tensors in shards.items():
        save_file(tensors, path / file, metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path / "b.safetensors"


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_problem_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1 holds the last units (no balance: 5 units split [3, 2] over the 2 ranks, dec2
    and dec1) and alone reads the shard that holds them: a tensor of another shape in it, or
    its damage, stops rank 0 too, at once."""
    rank1 = ("dec2.", "dec1.")
    state = _skips().state_dict()
    reshaped = dict(state, **{"dec1.weight": torch.zeros(4, 15)})  # (4, 16) in the model
    _save_in_two_shards(reshaped, tmp_path / "reshaped", rank1)
    broken = _save_in_two_shards(state, tmp_path / "damaged", rank1)
    _truncate(broken)

    by_rank = launch(
        _build_from, 2, args=([str(tmp_path / "reshaped"), str(broken.parent)],), timeout=30
    )
    (shape0, damage0), (shape1, damage1) = by_rank
    assert shape0 == shape1 and shape0["type"] == "WeightsError"
    assert "dec1.weight (4, 15) in it, (4, 16) in the model" in shape0["message"]
    assert [damage0["type"], damage1["type"]] == ["PipelineError", "CheckpointError"]
    assert "rank 1 could not build its stages" in damage0["message"]
    for outcome in (damage0, damage1):
        assert f"{broken} is truncated" in outcome["message"]


def test_a_plain_models_state_dict_file_loads_whole_or_not_at_all(tmp_path):
    """Not a Hugging Face model: the checkpoint's keys are the model's state_dict names."""
    from safetensors.torch import save_file

    case = CASES["skips"]
    plain = case.build(torch.float32)
    save_file(plain.state_dict(), tmp_path / "skips.safetensors")
    pipe = gpipe.Pipe.from_model(
        _on_meta(lambda: case.build(torch.float32)), case.example(torch.float32),
        split=case.split, weights=tmp_path / "skips.safetensors", balance=[2, 3], chunks=2,
    )  # fmt: skip
    _assert_state_is(pipe, plain)
    _assert_trains_as(pipe, plain, case)
    state = plain.state_dict()
    del state["mid.bias"]
    save_file(state, tmp_path / "partial.safetensors")
    with pytest.raises(WeightsError, match=r"1 tensor of the model not in it: mid\.bias"):
        gpipe.Pipe.from_model(
            _on_meta(lambda: case.build(torch.float32)), case.example(torch.float32),
            split=case.split, weights=tmp_path / "partial.safetensors", balance=[2, 3],
            chunks=2,
        )  # fmt: skip
