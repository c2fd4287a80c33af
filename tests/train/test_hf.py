"""gpipe.train.hf: ``gpipe train`` on what the user brings, one process: a Hugging Face
folder or config.json (fine-tuned from its weights, or from scratch at a size the user sets),
data from the user's files tokenized by the folder's tokenizer (or bytes), packed or padded,
each against a plain reference: ``from_pretrained``, the tokenizer called by hand, the plain
model's loss and gradients. Two processes, end to end: ``test_your_model_runs.py``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from gpipe.train import ConfigError, resolve
from gpipe.train.tokenizers import BYTES
from train.saved_models import TEXT, bert, llama, mixtral, model_folder, save, transformers

pytestmark = pytest.mark.timeout(120)
SEQ, BATCH, CHUNKS = 16, 6, 3


def configure(tmp_path, **options):
    return resolve({"stages": 2, "chunks": CHUNKS, "batch": BATCH, "seq": SEQ, "dtype": "float64",
                    "out": str(tmp_path / "run"), **options})  # fmt: skip


def one_process_pipe(config):
    """The run's model as the trainer builds it, every stage in this process."""
    task = config.task
    units = task.units()
    return task.pipe(balance=[units // 2, units - units // 2], chunks=CHUNKS,
                     init_seed=config.seed)  # fmt: skip


def assert_same_gradients(pipe, model):
    """float64: each parameter's gradient within 1e-10 of the plain model's (relative to the
    largest of the model's gradients: a key bias's is 0 but for rounding, as softmax ignores
    it)."""
    grads = dict(model.named_parameters(remove_duplicate=False))  # tied: under each name
    scale = max(float(p.grad.abs().max()) for p in grads.values() if p.grad is not None)
    for name, p in pipe.named_parameters():
        error = float((p.grad - grads[name].grad).abs().max()) / scale
        assert error <= 1e-10, (name, error)


def token_mean(logits, targets):
    """The plain loss: cross-entropy averaged over every real target of the mini-batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def test_fine_tuning_starts_from_the_folders_weights_and_steps_as_the_plain_model(tmp_path):
    folder = model_folder(tmp_path / "my-llama", llama())
    (tmp_path / "train.txt").write_text(TEXT[:6000])
    (tmp_path / "val.txt").write_text(TEXT[6000:8000])
    config = configure(tmp_path, model=str(folder), data=str(tmp_path / "train.txt"),
                       val_data=str(tmp_path / "val.txt"))  # fmt: skip
    assert (config.init, config.tokenizer) == ("pretrained", str(folder))  # the folder's own
    task = config.task
    data = task.data(batch=BATCH, eval_batches=2, prepared=None)

    # The data: the folder's tokenizer, called by hand, on the file; windows of seq + 1.
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    reference = tokenizer(TEXT[:6000])["input_ids"]
    assert len(data.train) == (len(reference) - 1) // SEQ
    tokens, real = data.train[torch.tensor([0, 3])]
    assert tokens[0].tolist() == reference[: SEQ + 1] and real.all()
    assert tokens[1].tolist() == reference[3 * SEQ : 4 * SEQ + 1]

    pipe = one_process_pipe(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    state = model.state_dict()
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, state[name]), name  # every rank read its own tensors

    x, y = task.batch(data.train, torch.arange(BATCH), seed=0)
    loss = pipe.step(x, y, task.loss, count=task.count)
    expected = token_mean(model(x).logits, y)
    expected.backward()
    assert abs(float(loss) - expected.item()) <= 1e-12
    assert_same_gradients(pipe, model)


def test_padded_documents_give_the_mean_over_their_real_tokens(tmp_path):
    """JSONL records of unequal length, each cut on its own and padded: micro-batches with
    unequal counts of real tokens, weighted by those counts (``count=``)."""
    folder = model_folder(tmp_path / "m", llama())
    lines = [line for line in TEXT.splitlines() if len(line) > 20][:40]
    records = [{"body": f"{i}: " + " ".join(lines[i : i + 1 + i % 4]), "id": i}
               for i in range(0, 40, 2)]  # fmt: skip
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = configure(tmp_path, model=str(folder), data=str(tmp_path / "data.jsonl"),
                       text_field="body", packing="pad", val_fraction=0.2)  # fmt: skip
    task = config.task
    data = task.data(batch=BATCH, eval_batches=2, prepared=None)

    # Reference windows, written out: each record's tokens cut into seq + 1, seq apart.
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer(r["body"])["input_ids"] for r in records]
    train_rows, val_rows = (_rows(samples) for samples in (data.train, data.val))
    held = {i for i in range(len(records)) if tuple(ids[i][: SEQ + 1]) not in train_rows}
    assert len(held) == 4  # 20 % of 20 records held out for validation, whole
    assert all(tuple(ids[i][: SEQ + 1]) in val_rows for i in held)
    expected = []
    for i in range(len(records)):
        if i not in held:
            expected += [ids[i][s : s + SEQ + 1] for s in range(0, len(ids[i]) - 1, SEQ)]
    tokens, real = data.train[torch.arange(len(data.train))]
    assert len(data.train) == len(expected)
    for row, window in enumerate(expected):
        assert tokens[row, : len(window)].tolist() == window
        assert real[row].sum() == len(window)

    pipe = one_process_pipe(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    short = torch.argsort(real.sum(1))[:BATCH].flip(0)  # padded samples, unequal counts
    x, y = task.batch(data.train, short, seed=0)
    counts = [int((part != -100).sum()) for part in torch.tensor_split(y, CHUNKS)]
    assert len(set(counts)) > 1 and (y == -100).any()
    loss = pipe.step(x, y, task.loss, count=task.count)
    reference = token_mean(model(x).logits, y)
    reference.backward()
    assert abs(float(loss) - reference.item()) <= 1e-12
    assert_same_gradients(pipe, model)
    # ... which a mean of the micro-batches' means would miss:
    means = [
        token_mean(model(a).logits, b)
        for a, b in zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS), strict=True)
    ]
    assert abs((sum(means) / CHUNKS).item() - reference.item()) > 1e-6


def _rows(samples) -> set[tuple[int, ...]]:
    """Each sample's real tokens."""
    tokens, real = samples[torch.arange(len(samples))]
    return {tuple(t[r].tolist()) for t, r in zip(tokens, real, strict=True)}


def test_from_scratch_at_a_size_the_user_sets(tmp_path):
    (tmp_path / "config.json").write_text(llama().to_json_string())
    (tmp_path / "notes.txt").write_text(TEXT[:3000])
    config = configure(
        tmp_path,
        model=str(tmp_path / "config.json"),
        seed=3,
        data=str(tmp_path / "notes.txt"),
        model_config="num_hidden_layers=2,hidden_size=48,intermediate_size=64",
    )
    assert (config.init, config.tokenizer) == ("random", BYTES)  # no weights, no tokenizer
    pipe = one_process_pipe(config)
    # Exactly what the plain model gives from the same seed, at the size asked for (fields
    # derived from those, as the head size, derived anew).
    resized = llama(num_hidden_layers=2, hidden_size=48, intermediate_size=64)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(resized, dtype=torch.float64)
    state = model.state_dict()
    assert set(pipe.state_dict()) == set(state)
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert state["model.embed_tokens.weight"].shape == (320, 48)

    # bytes: the file's own bytes are the tokens
    data = config.task.data(batch=BATCH, eval_batches=2, prepared=None)
    tokens, _ = data.train[torch.tensor([1])]
    assert bytes(tokens[0].tolist()) == TEXT.encode()[SEQ : 2 * SEQ + 1]

    cut = configure(tmp_path, model=str(tmp_path / "config.json"), split="model.layers.1")
    # units: the work before model.layers.1 (embedding, layer 0), layer 1, the head
    assert cut.model_args["split"] == ["model.layers.1"] and cut.task.units() == 3

    with pytest.raises(ConfigError, match="num_hiden_layers: not a field of LlamaConfig; "
                                          "close: num_hidden_layers"):  # fmt: skip
        configure(tmp_path, model=str(tmp_path / "config.json"), model_config="num_hiden_layers=2")
    small = llama(vocab_size=100)
    (tmp_path / "small.json").write_text(small.to_json_string())
    with pytest.raises(ConfigError, match="the tokenizer has 256 tokens, the model's vocab_size"):
        configure(tmp_path, model=str(tmp_path / "small.json"), data=str(tmp_path / "notes.txt"))


def test_a_masked_lm_masks_per_step_alike_everywhere_and_learns_as_the_plain_model(tmp_path):
    folder = model_folder(tmp_path / "bert", bert(), family="AutoModelForMaskedLM")
    (tmp_path / "t.txt").write_text(TEXT[:8000])
    config = configure(tmp_path, model=str(folder), data=str(tmp_path / "t.txt"))
    task = config.task
    assert config.model_args["family"] == "masked-lm"
    data = task.data(batch=BATCH, eval_batches=2, prepared=None)
    indices = torch.arange(BATCH)
    x, y = task.batch(data.train, indices, seed=5)
    again, same = task.batch(data.train, indices, seed=5)
    other, _ = task.batch(data.train, indices, seed=6)
    assert torch.equal(again["input_ids"], x["input_ids"]) and torch.equal(same, y)
    assert not torch.equal(other["input_ids"], x["input_ids"])  # a step's own masks
    tokens, _ = data.train[indices]
    chosen = y != -100
    assert torch.equal(y[chosen], tokens[chosen]) and 0.05 < chosen.float().mean() < 0.3
    assert (x["input_ids"][chosen] == task.tokenizer.mask).float().mean() > 0.5
    assert torch.equal(x["input_ids"][~chosen], tokens[~chosen])  # the rest as they were

    pipe = one_process_pipe(config)
    model = transformers.AutoModelForMaskedLM.from_pretrained(folder, dtype=torch.float64)
    loss = pipe.step(x, y, task.loss, count=task.count)
    expected = model(**x, labels=y).loss  # the model's own masked-LM loss
    expected.backward()
    assert abs(float(loss) - expected.item()) <= 1e-12
    assert_same_gradients(pipe, model)


def test_what_cannot_run_is_named_before_any_process_starts(tmp_path):
    folder = tmp_path / "no-weights"
    save(transformers.AutoModelForCausalLM.from_config(llama()), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ConfigError) as caught:
        configure(tmp_path, model=str(folder), init="pretrained", data=str(tmp_path / "nothing"),
                  packing="pad", family="masked-lm")  # fmt: skip
    text = str(caught.value)
    assert "--init pretrained: " in text and "holds no model.safetensors" in text
    assert f"--data {tmp_path / 'nothing'}: no such file or folder" in text
    assert "--family masked-lm: transformers builds model type llama as causal-lm" in text
    with pytest.raises(ConfigError, match=r"not a built-in model .* nor a folder"):
        configure(tmp_path, model=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="--split applies to a Hugging Face folder"):
        configure(tmp_path, model="gpt", split="blocks.0")
    with pytest.raises(ConfigError, match=r"--data applies to language models"):
        configure(tmp_path, model="resnet", data=str(tmp_path))


def test_built_in_models_take_your_data_and_size_the_same_way(tmp_path):
    (tmp_path / "notes.txt").write_text(TEXT[:4000])
    config = configure(tmp_path, model="gpt", data=str(tmp_path / "notes.txt"),
                       model_config="n_layers=3,d_model=48")  # fmt: skip
    assert config.model_args["n_layers"] == 3 and config.task.units() == 5
    data = config.task.data(batch=BATCH, eval_batches=2, prepared=None)
    assert "1 document, 4,000 bytes" in data.description
    tokens, _ = data.train[torch.tensor([0])]
    assert bytes(tokens[0].tolist()) == TEXT.encode()[: SEQ + 1]
    with pytest.raises(ConfigError, match="--model-config width: not a field of --model gpt"):
        configure(tmp_path, model="gpt", model_config="width=3")


def test_a_mixtral_saved_by_save_pretrained_starts_from_its_own_experts(tmp_path):
    folder = model_folder(tmp_path / "mixtral", mixtral())
    (tmp_path / "t.txt").write_text(TEXT[:4000])
    config = configure(tmp_path, model=str(folder), data=str(tmp_path / "t.txt"))
    pipe = one_process_pipe(config)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, experts_implementation="eager"
    )
    state = model.state_dict()
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_a_checkpoint_exports_to_a_folder_from_pretrained_loads_strictly(tmp_path):
    """gpipe export of a Hugging Face model's checkpoint: save_pretrained's folder
    (safetensors), which from_pretrained loads with no key missing or unexpected."""
    import gpipe.train.checkpoint as ckpt
    from gpipe.cli.export import export
    from gpipe.train.hf import HFModel

    spec = {"kind": "hf", "args": {"config": llama().to_dict(), "family": "causal-lm"}}
    torch.manual_seed(0)
    model = HFModel(spec["args"]).build()
    root = tmp_path / "run" / "checkpoints"
    staging = ckpt.begin(root, 7)
    ckpt.write(staging, model=model.state_dict())  # the names Pipe.from_model gives
    ckpt.commit(root, staging, ckpt.Manifest(step=7, model=spec, config={"tokenizer": None}))

    folder = export(tmp_path / "run")
    assert folder == tmp_path / "run" / "model-step-000007"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    assert not any(info.values()), info  # missing, unexpected, mismatched, error messages
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_mixtral_trains_with_its_load_balancing_loss(tmp_path):
    """``output_router_logits=True``: the run's loss is the model's own, its auxiliary loss
    included with its coefficient (exact with one micro-batch; several: warned)."""
    mixture = mixtral()
    mixture.output_router_logits, mixture.router_aux_loss_coef = True, 0.3
    folder = model_folder(tmp_path / "mixtral", mixture)
    (tmp_path / "t.txt").write_text(TEXT[:4000])
    task = configure(tmp_path, model=str(folder), data=str(tmp_path / "t.txt")).task
    units = task.units()
    balance = [units // 2, units - units // 2]
    # The warning comes from the pipe's chunks and the model's coefficient: a stand-in for the
    # capture (an export of the mixture per mode, most of this test's time) gives the chunks.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(task.model, "pipe", lambda *_, chunks, **__: SimpleNamespace(chunks=chunks))
        with pytest.warns(UserWarning, match=r"chunks=3 the auxiliary loss \(aux_loss_coef=0.3"):
            task.pipe(balance=balance, chunks=3)
    pipe = task.pipe(balance=balance, chunks=1)
    data = task.data(batch=BATCH, eval_batches=2, prepared=None)
    x, y = task.batch(data.train, torch.arange(BATCH), seed=0)
    loss = pipe.step(x, y, task.loss, count=task.count)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, experts_implementation="batched_mm"
    )
    out = model(x)
    expected = token_mean(out.logits, y) + 0.3 * out.aux_loss
    expected.backward()
    assert abs(float(loss) - expected.item()) <= 1e-12
    assert_same_gradients(pipe, model)


def test_a_tokenizer_too_large_for_the_folders_weights_names_a_remedy_that_works(tmp_path):
    folder = model_folder(tmp_path / "small", llama(vocab_size=100))
    (tmp_path / "t.txt").write_text(TEXT[:4000])
    options = {"model": str(folder), "data": str(tmp_path / "t.txt"), "tokenizer": "bytes",
               "seq": 32, "out": str(tmp_path / "run")}  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        resolve(options)
    (problem,) = refused.value.problems
    assert problem.endswith("or --init random --model-config vocab_size=256 (from scratch)")
    # what it proposes runs: the folder's shape, 256 rows of embedding, random weights
    config = resolve({**options, "init": "random", "model_config": "vocab_size=256"})
    assert config.model_args["config"]["vocab_size"] == 256
