"""Models as people arrive with them (not ``nn.Sequential``), for the frontend's tests.

Tiny random Hugging Face GPT-2 (tied head), Llama (RoPE, causal mask) and BERT (padding mask),
a torchvision-style ResNet with batch norm (written here: torchvision's wheel would pull
another torch), and a model whose skips jump cuts. Each ``Case`` knows how to build the model,
a batch, the loss and where to cut. Spawned processes import this module too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from gpipe.frontend import CapturedModel, capture

try:
    import transformers
except ImportError:  # the hf extra is not installed: the Hugging Face cases are skipped
    transformers = None

VOCAB, LENGTH, BATCH = 64, 8, 12


@dataclass(frozen=True)
class Case:
    name: str
    split: Any
    units: int  # what capture gives: balance sums to this

    def build(self, dtype: torch.dtype = torch.float64, *, dropout: float = 0.0) -> nn.Module:
        torch.manual_seed(0)
        return BUILDERS[self.name](dropout).to(dtype).train()

    def batch(self, step=0, size=BATCH, length=LENGTH, dtype: torch.dtype = torch.float64):
        g = torch.Generator().manual_seed(1000 + step)
        if self.name == "resnet":
            images = torch.randn(size, 3, 16, 16, generator=g, dtype=dtype)
            return images, torch.randint(0, 10, (size,), generator=g)
        if self.name == "skips":
            return torch.randn(size, 8, generator=g, dtype=dtype), torch.randn(
                size, 4, generator=g, dtype=dtype
            )
        ids = torch.randint(0, VOCAB, (size, length), generator=g)
        targets = torch.randint(0, VOCAB, (size, length), generator=g)
        if self.name == "hf-bert":
            mask = torch.ones(size, length, dtype=torch.long)
            mask[::2, length // 2 :] = 0  # padded samples
            return {"input_ids": ids, "attention_mask": mask}, targets
        return ids, targets

    def example(self, dtype: torch.dtype = torch.float64):
        inputs, _ = self.batch(size=2, dtype=dtype)
        return inputs if isinstance(inputs, dict) else (inputs,)

    def loss(self, output, target):
        if self.name == "resnet":
            return F.cross_entropy(output, target)
        if self.name == "skips":
            return F.mse_loss(output, target)
        return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def run(model: nn.Module, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def reference_gradients(case: Case, model: nn.Module, inputs, targets, chunks: int):
    """The plain model's gradients, accumulated over the same micro-batches (batch norm
    normalizes each micro-batch by its own statistics, as in GPipe)."""
    model = copy.deepcopy(model)
    size = targets.shape[0]
    pieces = [torch.tensor_split(t, chunks) for t in _leaves(inputs)]
    total = 0.0
    for m, y in enumerate(torch.tensor_split(targets, chunks)):
        x = _rebuild(inputs, [p[m] for p in pieces])
        loss = case.loss(run(model, x), y) * (len(y) / size)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return total, grads, model


def worst_error(named_parameters, expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    ours = dict(named_parameters)
    assert set(ours) == set(expected), set(ours) ^ set(expected)
    worst = (0.0, "")
    for name, grad in expected.items():
        got = ours[name].grad
        assert got is not None, name
        scale = grad.double().norm().item()
        error = (got.double().cpu() - grad.double()).norm().item() / (scale or 1.0)
        worst = max(worst, (error, name))
    return worst


def _leaves(inputs):
    return list(inputs.values()) if isinstance(inputs, dict) else [inputs]


def _rebuild(inputs, leaves):
    return dict(zip(inputs, leaves, strict=True)) if isinstance(inputs, dict) else leaves[0]


# -- the models -------------------------------------------------------------------------------


def _hf_gpt2(dropout: float) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=3, n_head=2,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _hf_llama(dropout: float) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        attention_dropout=dropout,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _hf_bert(dropout: float) -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


class BasicBlock(nn.Module):
    """torchvision's ResNet block: two 3x3 convolutions with batch norm, and a shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet layout (stem, layer1, layer2, pool, fc), tiny."""

    def __init__(self, dropout: float = 0.0, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(self.dropout(torch.flatten(self.avgpool(x), 1)))


class Skips(nn.Module):
    """A U-Net-like MLP: the first block's output is used again four blocks later."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.enc1, self.enc2, self.mid = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.dec2, self.dec1 = nn.Linear(16, 16), nn.Linear(16, 4)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.enc1(x))
        b = torch.tanh(self.enc2(a))
        c = torch.tanh(self.mid(self.drop(b)))
        d = torch.tanh(self.dec2(c + b))
        return self.dec1(d + a)


BUILDERS = {
    "hf-gpt2": _hf_gpt2,
    "hf-llama": _hf_llama,
    "hf-bert": _hf_bert,
    "resnet": ResNet,
    "skips": Skips,
}
CASES = {
    case.name: case
    for case in [
        Case("hf-gpt2", "transformer.h", 5),
        Case("hf-llama", "model.layers", 5),
        Case("hf-bert", "bert.encoder.layer", 5),
        Case("resnet", ["layer1.0", "layer1.1", "layer2.0", "layer2.1"], 6),
        Case("skips", ["enc1", "enc2", "mid", "dec2", "dec1"], 5),
    ]
}
HF = [name for name in CASES if name.startswith("hf-")]


def captured_steps(rank: int, runs: list[dict]) -> list[dict]:
    """In each process of a pipeline: capture the model, take one step, return gradients."""
    import torch.distributed as dist

    import gpipe

    torch.set_num_threads(1)
    results = []
    for run_ in runs:
        case = CASES[run_["model"]]
        # "factory": each rank builds only its own units, by replaying the construction;
        # "weights": the model on meta, each rank reading its own tensors from a checkpoint.
        model = case.build if run_.get("factory") else case.build()
        if run_.get("weights"):
            with torch.device("meta"):
                model = case.build()
        pipe = gpipe.Pipe.from_model(
            model,
            case.example(),
            weights=run_.get("weights"),
            split=case.split,
            balance=run_["balance"],
            chunks=run_["chunks"],
            schedule=run_["schedule"],
            checkpoint=run_["checkpoint"],
            group=dist.group.WORLD,
            timeout=60,
        )
        inputs, targets = case.batch()
        loss = pipe.step(inputs, targets, case.loss)
        results.append(
            {
                "loss": float(loss),
                "grads": {
                    n: p.grad.clone() for n, p in pipe.named_parameters(remove_duplicate=False)
                },
                "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                "meta_left": sum(t.is_meta for t in pipe.parameters()),
            }
        )
    return results


_CAPTURED: dict[tuple[str, torch.dtype], tuple[nn.Module, CapturedModel]] = {}


def captured(name: str, dtype: torch.dtype = torch.float64) -> tuple[nn.Module, CapturedModel]:
    """The model and its capture, once per test session (capture takes a second or two)."""
    if (name, dtype) not in _CAPTURED:
        case = CASES[name]
        model = case.build(dtype)
        _CAPTURED[name, dtype] = (model, capture(model, case.example(dtype), split=case.split))
    return _CAPTURED[name, dtype]


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.sum(-1)  # work after the last block, none before the first
