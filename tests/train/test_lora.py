"""``gpipe train --model DIR --lora`` in 2 processes against ``peft`` on the un-split model
(float64, SGD): every rank drew the adapters peft draws from the same seed, the adapters take
the un-split peft model's gradient step exactly, the base never moves; ``gpipe export`` writes
the merged model (``merge_and_unload``'s) and an adapter folder ``PeftModel`` loads."""

from __future__ import annotations

import pytest
import torch

import gpipe.train.checkpoint as ckpt
from gpipe.train import ConfigError, lora, resolve
from gpipe.train.data import EpochSampler, hash_seed
from train.saved_models import TEXT, llama, model_folder, transformers

LR = 0.5
SPEC = "r=4,alpha=8,targets=q_proj,v_proj"


def test_the_spec_reads_as_peft_s_arguments():
    assert lora.parse(SPEC) == {"r": 4, "alpha": 8.0, "dropout": 0.0,
                                "targets": ["q_proj", "v_proj"]}  # fmt: skip
    assert lora.parse("r=2") == {"r": 2, "alpha": 4.0, "dropout": 0.0, "targets": None}
    for bad, words in [("rank=4", "not KEY=VALUE"), ("r=x", "r=x is not a number"),
                       ("r=0", "r must be >= 1")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            lora.parse(bad)


def test_lora_is_refused_on_a_built_in_model(tmp_path):
    with pytest.raises(ConfigError, match="--lora applies to a Hugging Face folder"):
        resolve({"size": "tiny", "lora": SPEC, "out": str(tmp_path / "run")})


def _peft():
    """peft, imported by the one test that uses it: at every worker's collection it cost 2 s."""
    return pytest.importorskip("peft")


def _peft_model(folder, state=None):
    """peft's own model of the folder's weights: get_peft_model, the adapters of ``state``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    config = _peft().LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = _peft().get_peft_model(model, config)
    if state is not None:
        mine = {"base_model.model." + k: v for k, v in state.items()}
        missing = model.load_state_dict(mine, strict=True)
        assert not missing.missing_keys
    return model


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_lora_through_the_pipeline_is_peft_on_the_unsplit_model(in_process, tmp_path):
    _peft()  # without peft: skipped before the run
    folder = model_folder(tmp_path / "llama", llama())
    data = tmp_path / "train.txt"
    data.write_text(TEXT[:8000])
    run = tmp_path / "run"
    done = in_process(
        "train", "--model", str(folder), "--data", str(data), "--lora", SPEC, "-K", "2",
        "--chunks", "2", "--batch", "4", "--seq", "16", "--steps", "2", "--dtype", "float64",
        "--optimizer", "sgd", "--lr", str(LR), "--lr-schedule", "constant", "--warmup", "0",
        "--grad-clip", "0", "--weight-decay", "0", "--save-every", "1", "--keep", "0",
        "--eval-every", "0", "--sample-tokens", "0", "--progress", "lines",
        "--report-to", "none", "--out", str(run),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second = (ckpt.read_manifest(run / "checkpoints" / f"step-00000{s}") for s in (1, 2))
    before, after = (ckpt.export_state_dict(m.path) for m in (first, second))

    # lora_B starts at zero, so step 1 left lora_A as drawn: on every rank, the draw that
    # gpipe.train.lora.inject makes on the un-split model.
    torch.set_default_dtype(torch.float64)  # as the ranks built it (--dtype float64)
    try:
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
        drawn = lora.inject(base, lora.parse(SPEC), seed=0)
    finally:
        torch.set_default_dtype(torch.float32)
    for name, value in drawn.state_dict().items():
        if ".lora_A." in name:
            assert torch.equal(before[name], value), name

    # Step 2 from checkpoint 1 is peft's un-split model's SGD step on the same batch.
    config = resolve({"resume": str(first.path), "steps": 3})
    task = config.task
    batches = task.data(batch=config.batch, eval_batches=1, prepared=None, chunks=2)
    sampler = EpochSampler(len(batches.train), seed=config.seed)
    sampler.load_state_dict(first.data)
    x, y = task.batch(batches.train, sampler.take(config.batch), seed=hash_seed(config.seed, 2, -1))
    model = _peft_model(folder, before)
    task.loss(model(input_ids=x), y).backward()
    trained = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters()
               if p.requires_grad}  # fmt: skip
    assert trained and all(".lora_" in n for n in trained)
    assert {n for n in before if ".lora_" in n} == set(trained)
    worst = 0.0
    for name, value in before.items():
        if name in trained:
            expected = value - LR * trained[name].grad
            error = float((after[name] - expected).abs().max() / expected.abs().max())
            assert error <= 1e-10, (name, error)
            worst = max(worst, error)
        else:
            assert torch.equal(after[name], value), name  # the base: bitwise untouched
    print(f"{len(trained)} adapters: worst relative error {worst:.1e} against peft's step")
    assert any(not torch.equal(after[n], before[n]) for n in trained)

    # gpipe export: the merged model is merge_and_unload's; its adapter folder loads in peft.
    from gpipe.cli.export import export

    exported = export(run)
    merged = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64)
    reference = _peft_model(folder, after).merge_and_unload()
    for name, value in reference.state_dict().items():
        assert torch.equal(merged.state_dict()[name], value), name
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    adapted = _peft().PeftModel.from_pretrained(base, exported / "adapter")
    with torch.no_grad():
        ours = adapted(input_ids=x).logits
        theirs = _peft_model(folder, after)(input_ids=x).logits
    assert torch.equal(ours, theirs)
