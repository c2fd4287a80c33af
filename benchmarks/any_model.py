"""Any model, as it is: gpipe's frontend side by side with ``torch.distributed.pipelining``'s.

    python benchmarks/any_model.py --out docs/any-model.md
    python benchmarks/any_model.py --quick          # fewer models and timing rounds

Part 1, one process, float64. Each model (tiny random configs of Hugging Face families, a
torchvision-style ResNet and a model whose skips jump cuts; ``tests/captured_models.py``) is
cut into 2 stages at the same block by both libraries: gpipe with ``Pipe.from_model`` (a 1F1B
step of 3 micro-batches), the peer with ``pipeline(model, mb_args, split_spec)`` run by its
local runner micro-batch by micro-batch (what its schedules run). Each parameter's gradient is
compared with the plain model's, accumulated over the same micro-batches; then both run a
batch of another size and sequence length (the peer traces static shapes). Cells give the
error text where a library failed.

Part 2, 2 processes (gloo, float32): step time of gpipe (``Pipe.from_model``, 1F1B, M=4) and
of the peer (``pipeline`` + ``build_stage`` + ``Schedule1F1B``, M=4) on GPT-2 and Llama, in
alternating rounds; medians, and the median of each round's peer / gpipe ratio with its 95 %
bootstrap interval.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the test models, as they are

import transformers as T
from pipeline_throughput import median_interval

import gpipe
from captured_models import CASES, reference_gradients
from gpipe.frontend import capture
from gpipe.parallel.launch import launch

VOCAB = 64
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip
# name -> (config class, model class, config arguments, the blocks' ModuleList)
FAMILIES = {
    "Qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, _COMMON, "model.layers"),
    "Qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {**_COMMON, "head_dim": 8}, "model.layers"),
    "Mistral": (T.MistralConfig, T.MistralForCausalLM, _COMMON, "model.layers"),
    "Gemma": (T.GemmaConfig, T.GemmaForCausalLM, {**_COMMON, "head_dim": 8}, "model.layers"),
    "Gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {**_COMMON, "head_dim": 8}, "model.layers"),
    "Phi3": (T.Phi3Config, T.Phi3ForCausalLM, {**_COMMON, "pad_token_id": 0}, "model.layers"),
    "GPT-NeoX": (
        T.GPTNeoXConfig, T.GPTNeoXForCausalLM,
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=64),
        "gpt_neox.layers",
    ),
    "OPT": (
        T.OPTConfig, T.OPTForCausalLM,
        dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
             num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32),
        "model.decoder.layers",
    ),
    "Falcon": (
        T.FalconConfig, T.FalconForCausalLM,
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4),
        "transformer.h",
    ),
    "GPT-J": (
        T.GPTJConfig, T.GPTJForCausalLM,
        dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=64),
        "transformer.h",
    ),
    "BLOOM": (
        T.BloomConfig, T.BloomForCausalLM,
        dict(vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4), "transformer.h",
    ),
    "RoBERTa (masked LM)": (
        T.RobertaConfig, T.RobertaForMaskedLM,
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             intermediate_size=64, max_position_embeddings=80),
        "roberta.encoder.layer",
    ),
}  # fmt: skip
_DROPOUTS = (
    "hidden_dropout", "attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout",
)  # fmt: skip


@dataclass
class Model:
    name: str
    build: Any  # () -> nn.Module, float64
    batch: Any  # (size, length) -> (inputs, targets)
    loss: Any
    blocks: list[str]  # the split modules, in order


def _family(name: str) -> Model:
    config_class, model_class, arguments, blocks = FAMILIES[name]

    def build() -> nn.Module:
        torch.manual_seed(0)
        config = config_class(**arguments)
        for key in _DROPOUTS:
            if hasattr(config, key):
                setattr(config, key, 0.0)
        return model_class(config).double()

    def batch(size: int, length: int):
        g = torch.Generator().manual_seed(size * 100 + length)
        ids = torch.randint(0, VOCAB, (size, length), generator=g)
        return ids, torch.randint(0, VOCAB, (size, length), generator=g)

    count = arguments.get("num_hidden_layers", arguments.get("n_layer"))
    return Model(name, build, batch, CASES["hf-gpt2"].loss, [f"{blocks}.{i}" for i in range(count)])


def _case(name: str, label: str) -> Model:
    case = CASES[name]
    split = case.split if isinstance(case.split, list) else None

    def build() -> nn.Module:
        return case.build()

    def batch(size: int, length: int):
        return case.batch(size=size, length=length)

    if split is None:
        count = len(dict(case.build().named_modules())[case.split])
        split = [f"{case.split}.{i}" for i in range(count)]
    return Model(label, build, batch, case.loss, split)


def models(quick: bool) -> list[Model]:
    found = [
        _case("hf-gpt2", "GPT-2 (tied head)"),
        _case("hf-llama", "Llama"),
        _case("hf-bert", "BERT (padding mask)"),
        _case("resnet", "torchvision-style ResNet (batch norm)"),
        _case("skips", "skips across cuts (U-Net-like)"),
    ]
    names = list(FAMILIES)[:3] if quick else list(FAMILIES)
    return found + [_family(n) for n in names]


# -- part 1: fidelity ----------------------------------------------------------------------


def _error_text(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text.replace("|", "/")[:110]


def _worst(named: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor]):
    """(worst relative gradient error, the parameter where it is), over the model's tensors
    (a tensor with several names is found under any of them)."""
    worst = (0.0, "")
    aliases: dict[int, list[str]] = {}
    for name, grad in expected.items():
        aliases.setdefault(id(grad), []).append(name)
    for names in aliases.values():
        name, grad = names[0], expected[names[0]]
        if grad is None:
            continue
        got = next((named[n] for n in names if named.get(n) is not None), None)
        if got is None:
            return float("inf"), f"{name}: no gradient"
        worst = max(worst, (((got - grad).norm() / grad.norm().clamp_min(1e-300)).item(), name))
    return worst


def _gpipe(model: Model, cut: int) -> dict[str, Any]:
    plain = model.build()
    inputs, targets = model.batch(6, 8)
    example = {k: v[:2] for k, v in inputs.items()} if isinstance(inputs, dict) else (inputs[:2],)
    units = capture(copy.deepcopy(plain), example, split=model.blocks)
    first = [u.unit_name for u in units].index(model.blocks[cut])  # the same cut as the peer's
    pipe = gpipe.Pipe(
        units, balance=[first, len(units) - first], chunks=3, schedule="1f1b", tied=units.tied
    )
    result: dict[str, Any] = {"captured": True}
    pipe.step(inputs, targets, model.loss)
    _, grads, _ = reference_gradients_of(model, plain, inputs, targets)
    ours = {n: p.grad for n, p in pipe.named_parameters(remove_duplicate=False)}
    result["error"], result["where"] = _worst(ours, grads)
    # Another batch size and sequence length, without capturing again.
    inputs, targets = model.batch(5, 6)
    pipe.zero_grad()
    pipe.step(inputs, targets, model.loss)
    _, grads, _ = reference_gradients_of(model, plain, inputs, targets)
    ours = {n: p.grad for n, p in pipe.named_parameters(remove_duplicate=False)}
    result["other_shapes"] = _worst(ours, grads)[0]
    return result


def reference_gradients_of(model: Model, plain: nn.Module, inputs, targets):
    """The plain model's gradients over the same 3 micro-batches (tests/captured_models.py
    reads only ``.loss`` of what it is given)."""
    return reference_gradients(model, plain, inputs, targets, 3)


def _peer(model: Model, cut: int) -> dict[str, Any]:
    from torch.distributed.pipelining import SplitPoint, pipeline

    plain = model.build()
    if hasattr(plain, "config"):  # the peer cannot trace a key-value cache; gpipe drops it
        plain.config.use_cache = False
    inputs, targets = model.batch(6, 8)
    kwargs = inputs if isinstance(inputs, dict) else {}
    args = () if kwargs else (inputs,)
    mb_args = tuple(a[:2] for a in args)
    mb_kwargs = {k: v[:2] for k, v in kwargs.items()}
    result: dict[str, Any] = {}
    ir = pipeline(
        copy.deepcopy(plain), mb_args=mb_args, mb_kwargs=mb_kwargs or None,
        split_spec={model.blocks[cut]: SplitPoint.BEGINNING},
    )  # fmt: skip
    result["captured"] = True
    # The stages in order, as its schedules run them (its local runner, ``ir(...)``, detaches
    # between stages: it is for inference).
    names = [n.name for n in ir.split_gm.graph.nodes if n.op == "placeholder"]
    for m in range(3):
        sl = slice(2 * m, 2 * m + 2)
        values = {n: a[sl] for n, a in zip(names[: len(args)], args, strict=True)}
        values |= {k: v[sl] for k, v in kwargs.items()}
        out = torch.fx.Interpreter(ir.split_gm).run(*(values[n] for n in names))
        loss = model.loss(_as_output(out, plain), targets[sl]) / 3
        loss.backward()
    _, grads, _ = reference_gradients_of(model, plain, inputs, targets)
    theirs = {n.split(".", 2)[2]: p.grad for n, p in ir.named_parameters()}
    result["error"], result["where"] = _worst(theirs, grads)
    try:
        inputs, _ = model.batch(5, 6)
        ir(inputs) if not isinstance(inputs, dict) else ir(**inputs)
        result["other_shapes"] = "ran"
    except Exception as error:  # the peer traces static shapes
        result["other_shapes"] = _error_text(error)
    return result


def _as_output(out, plain: nn.Module):
    """The peer returns its last stage's values flat: give the loss the model's structure."""
    if isinstance(out, tuple) and hasattr(plain, "config"):
        return T.modeling_outputs.CausalLMOutput(logits=out[0])
    return out[0] if isinstance(out, tuple) and len(out) == 1 else out


def fidelity(model: Model) -> dict[str, Any]:
    cut = len(model.blocks) // 2
    row: dict[str, Any] = {"model": model.name}
    for library, run_ in (("gpipe", _gpipe), ("peer", _peer)):
        try:
            row[library] = run_(model, cut)
        except Exception as error:
            row[library] = {"failure": _error_text(error)}
            print(traceback.format_exc(), file=sys.stderr)
    return row


# -- part 3: every schedule x remat, in K processes --------------------------------------------

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]
REMAT = ["always", "except_last", "never"]
MATRIX_MODELS = ["hf-gpt2", "hf-llama", "hf-bert", "resnet", "skips"]


def _matrix_worker(rank: int, stages: int) -> dict[tuple, dict[str, torch.Tensor]]:
    """In each of K processes: capture each test model once, then one step per schedule x
    remat; returns this rank's gradients under the model's names."""
    import torch.distributed as dist

    from gpipe.layout import even_balance

    torch.set_num_threads(1)
    grads = {}
    for name in MATRIX_MODELS:
        case = CASES[name]
        units = capture(case.build(), case.example(), split=case.split)
        inputs, targets = case.batch()
        for schedule in SCHEDULES:
            virtual = 2 if schedule == "interleaved-1f1b" else 1
            if len(units) < stages * virtual:
                continue
            for remat in REMAT:
                pipe = gpipe.Pipe(
                    copy.deepcopy(units), balance=even_balance(len(units), stages * virtual),
                    chunks=stages * 2, schedule=schedule, checkpoint=remat, tied=units.tied,
                    virtual_stages=virtual, group=dist.group.WORLD, timeout=120,
                )  # fmt: skip
                pipe.step(inputs, targets, case.loss)
                grads[name, schedule, remat] = {
                    n: p.grad.clone() for n, p in pipe.named_parameters(remove_duplicate=False)
                }
    return grads


def matrix(counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for stages in counts:
        per_rank = launch(_matrix_worker, stages, args=(stages,), timeout=900)
        for name in MATRIX_MODELS:
            case = CASES[name]
            inputs, targets = case.batch()
            for schedule in SCHEDULES:
                for remat in REMAT:
                    key = (name, schedule, remat)
                    if key not in per_rank[0]:
                        rows.append({"model": name, "K": stages, "schedule": schedule,
                                     "remat": remat, "error": None})  # fmt: skip
                        continue
                    seen = {}
                    for grads in per_rank:
                        seen.update(grads[key])
                    _, expected, _ = reference_gradients(
                        case, case.build(), inputs, targets, stages * 2
                    )
                    error, where = _worst(seen, expected)
                    rows.append({"model": name, "K": stages, "schedule": schedule,
                                 "remat": remat, "error": error, "where": where})  # fmt: skip
    return rows


# -- part 2: step time ---------------------------------------------------------------------

TIMED = {"GPT-2": "hf-gpt2", "Llama": "hf-llama"}


def _timing_worker(rank: int, name: str, rounds: int, steps: int) -> dict[str, list[float]]:
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, SplitPoint, pipeline

    torch.set_num_threads(1)
    case = CASES[name]
    plain = case.build(torch.float32)
    plain.config.use_cache = False  # the peer cannot trace a key-value cache
    inputs, targets = case.batch(size=16, length=32, dtype=torch.float32)
    split = case.split if isinstance(case.split, list) else None
    blocks = split or [f"{case.split}.{i}" for i in range(3)]
    ours = gpipe.Pipe.from_model(
        copy.deepcopy(plain), (inputs[:4],), split=blocks, balance=[2, 3], chunks=4,
        schedule="1f1b", group=dist.group.WORLD,
    )  # fmt: skip
    ir = pipeline(
        copy.deepcopy(plain), mb_args=(inputs[:4],), split_spec={blocks[1]: SplitPoint.BEGINNING}
    )
    stage = ir.build_stage(rank, torch.device("cpu"), group=dist.group.WORLD)

    def peer_loss(out, target):
        return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())

    theirs = Schedule1F1B(stage, n_microbatches=4, loss_fn=peer_loss)

    def gpipe_step():
        ours.step(inputs, targets, case.loss)
        ours.zero_grad()

    def peer_step():
        if rank == 0:
            theirs.step(inputs)
        else:
            theirs.step(target=targets, losses=[])
        stage.submod.zero_grad()

    times: dict[str, list[float]] = {"gpipe": [], "peer": []}
    for _ in range(2):  # warm up
        gpipe_step()
        peer_step()
    for _ in range(rounds):
        for label, step in (("gpipe", gpipe_step), ("peer", peer_step)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            dist.barrier()
            times[label].append((time.perf_counter() - start) / steps)
    return times


def timing(rounds: int, steps: int) -> list[dict[str, Any]]:
    rows = []
    for label, name in TIMED.items():
        try:
            times = launch(_timing_worker, 2, args=(name, rounds, steps), timeout=300)[0]
        except Exception as error:
            rows.append({"model": label, "failure": _error_text(error)})
            continue
        ratios = [b / a for a, b in zip(times["gpipe"], times["peer"], strict=True)]
        rows.append(
            {
                "model": label,
                "gpipe": statistics.median(times["gpipe"]),
                "peer": statistics.median(times["peer"]),
                "ratio": statistics.median(ratios),
                "interval": median_interval(ratios),
                "rounds": rounds,
            }
        )
    return rows


# -- the report ----------------------------------------------------------------------------


def _cell(result: dict[str, Any], key: str) -> str:
    if "failure" in result:
        return "—"
    value = result.get(key)
    if isinstance(value, float):
        return "equal" if value <= 1e-10 else f"**{value:.1e}**"
    return str(value)


def _matrix_table(rows: list[dict]) -> list[str]:
    out = [
        "## Every schedule × remat mode, in K processes (float64, M = 2K, batch 12)",
        "",
        "The five models of the tests (`tests/captured_models.py`), captured once per process and",
        "cut evenly into K stages (2K with `interleaved-1f1b`, which needs at least 2K units: "
        "“n/a” otherwise); each cell is the worst relative gradient error over the model's "
        "parameters against the plain model on the same micro-batches.",
        "",
        "| model | K | " + " | ".join(f"{s} / {r}" for s in SCHEDULES for r in REMAT) + " |",
        "|---|---|" + "---|" * (len(SCHEDULES) * len(REMAT)),
    ]
    keyed = {(r["model"], r["K"], r["schedule"], r["remat"]): r["error"] for r in rows}
    for model, stages in dict.fromkeys((r["model"], r["K"]) for r in rows):
        cells = []
        for schedule in SCHEDULES:
            for remat in REMAT:
                error = keyed[model, stages, schedule, remat]
                cells.append("n/a" if error is None else f"{error:.0e}")
        out.append(f"| {model} | {stages} | " + " | ".join(cells) + " |")
    done = [r["error"] for r in rows if r["error"] is not None]
    out += ["", f"Worst over all {len(done)} runs: {max(done):.1e}.", ""]
    return out


def markdown(
    fidelity_rows: list[dict], matrix_rows: list[dict], timing_rows: list[dict], command: str
) -> str:
    out = [
        "# Any model, as it is: gpipe and torch.distributed.pipelining side by side",
        "",
        f"Regenerate: `{command}` (the method is in the script's docstring). Machine: 2 CPU "
        f"cores, torch {torch.__version__}, transformers {T.__version__}.",
        "",
        "## Capture, training and gradients (one process, float64, 2 stages, 3 micro-batches)",
        "",
        "Gradient columns: the worst relative error over the model's parameters against the "
        'plain model on the same micro-batches ("equal": ≤ 1e-10). *Other shapes*: a batch of '
        "5 × 6 tokens after capturing on 2 × 8.",
        "",
        "| model | gpipe: gradients | gpipe: other shapes | peer: gradients | peer: other "
        "shapes | where the peer's gradient is worst | failure |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in fidelity_rows:
        ours, peer = row["gpipe"], row["peer"]
        failures = "; ".join(
            f"{lib}: {row[lib]['failure']}" for lib in ("gpipe", "peer") if "failure" in row[lib]
        )
        out.append(
            f"| {row['model']} | {_cell(ours, 'error')} | {_cell(ours, 'other_shapes')} | "
            f"{_cell(peer, 'error')} | {_cell(peer, 'other_shapes')} | "
            f"{peer.get('where', '') if peer.get('error', 0) > 1e-10 else ''} | {failures} |"
        )
    held = sum(
        1 for r in fidelity_rows if "failure" not in r["gpipe"] and r["gpipe"]["error"] <= 1e-10
    )
    out += [
        "",
        f"gpipe: {held} of {len(fidelity_rows)} models captured and trained with the model's "
        "gradients, also at other shapes. The peer: a bold gradient cell is a model whose "
        "embedding is also its output head; `pipeline()` turns the one tensor into two "
        "parameters, each of which receives only its own stage's part of the gradient. It "
        "traces static shapes, so another batch size or sequence length fails, and it needs "
        "`config.use_cache = False` set by hand (gpipe drops the cache while capturing).",
        "",
        *_matrix_table(matrix_rows),
        "## Step time (2 processes, gloo, float32, 1F1B, M = 4, batch 16 × 32 tokens)",
        "",
        "Both libraries run the same model cut at the same block; a ratio above 1 means gpipe's "
        "step is the shorter one (an interval that excludes 1: beyond this machine's noise).",
        "",
        "| model | gpipe step (s) | peer step (s) | peer / gpipe (median of rounds) | 95 % "
        "interval | rounds |",
        "|---|---|---|---|---|---|",
    ]
    for row in timing_rows:
        if "failure" in row:
            out.append(f"| {row['model']} | — | — | {row['failure']} | | |")
            continue
        low, high = row["interval"]
        out.append(
            f"| {row['model']} | {row['gpipe']:.4f} | {row['peer']:.4f} | {row['ratio']:.3f} | "
            f"{low:.3f} – {high:.3f} | {row['rounds']} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for model in models(args.quick):
        rows.append(fidelity(model))
        print(f"{model.name}: gpipe {rows[-1]['gpipe']}, peer {rows[-1]['peer']}", flush=True)
    grid = matrix([2] if args.quick else [2, 3])
    rounds = 3 if args.quick else args.rounds
    times = timing(rounds, args.steps)
    print(times)
    command = "python benchmarks/any_model.py" + (f" --out {args.out}" if args.out else "")
    report = markdown(rows, grid, times, command)
    if args.out:
        args.out.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
