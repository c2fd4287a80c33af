"""The main job's configuration: :class:`TrainConfig`, one field per option of ``gpipe
train`` (its flag, help and choices in the field's :class:`Option`). How a run's options, the
checkpoint it resumes and the task's presets make one is ``gpipe.train.options.resolve``."""

from __future__ import annotations

import typing
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from gpipe.base.allocator import POLICIES
from gpipe.base.remat import REMAT_MODES
from gpipe.layout import SHARD_MODES, Layout
from gpipe.schedule import SCHEDULES
from gpipe.train.hf import FAMILIES
from gpipe.train.lr_schedule import LR_SCHEDULES
from gpipe.train.objectives import PACKINGS
from gpipe.train.optimizers import OPTIMIZERS
from gpipe.train.tasks import HF_FOLDER, RECIPES, Task, source_of, task_of
from gpipe.transport.choice import TRANSPORTS

__all__ = [
    "SIZES",
    "ConfigError",
    "Option",
    "TrainConfig",
    "flag",
    "model_spec",
    "num_layers",
    "option",
    "preset_fields",
]

SIZES = ("tiny", "small", "base")
DTYPES = ("float32", "bfloat16", "float16", "float64")
INITS = ("auto", "pretrained", "random")
PROGRESS = ("auto", "bar", "lines")


@dataclass(frozen=True)
class Option:
    """How a field of :class:`TrainConfig` reads as an option of ``gpipe train`` (its flag
    is ``--field-name``; the command line is generated from these, see ``gpipe.cli.train``)."""

    help: str
    group: str  # the heading it is listed under in --help
    flags: tuple[str, ...] = ()  # short spellings beside --field-name, e.g. ("-K",)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    default_text: str | None = None  # the default in words, where its value says too little


def _option(default: Any, help: str, group: str, **how: Any) -> Any:
    return field(default=default, metadata={"option": Option(help, group, **how)})


def option(f: Field) -> Option | None:
    """The command-line option of a field of :class:`TrainConfig` (None: not an option)."""
    return f.metadata.get("option")


def flag(name: str) -> str:
    """The command-line flag of field ``name``: ``--virtual-stages`` for ``virtual_stages``."""
    return "--" + name.replace("_", "-")


def option_kinds(of: type | None = None) -> dict[str, type]:
    """Each option's type (of :class:`TrainConfig`, or the config dataclass ``of``), by field
    name: bool, int, float, str or list (``X | None`` as X)."""
    hints = typing.get_type_hints(of or TrainConfig)
    kinds = {}
    for f in fields(of or TrainConfig):
        if option(f) is not None:
            hint = hints[f.name]
            kind = next(k for k in (*typing.get_args(hint), hint) if k is not type(None))
            kinds[f.name] = typing.get_origin(kind) or kind
    return kinds


def preset_fields() -> set[str]:
    """The fields a task's presets set: their default depends on --model and --size."""
    return {
        key
        for recipe in (*RECIPES.values(), HF_FOLDER)
        for preset in recipe.presets.values()
        for key in preset
        if key not in recipe.model_keys
    }


_MODEL, _DATA, _PIPELINE, _OPTIMIZATION = "model", "data", "pipeline", "optimization"
_CHECKPOINTS, _OUTPUT, _PROCESSES = "checkpoints and resuming", "output", "processes"
_MULTI_STAGE = ", ".join(n for n, s in SCHEDULES.items() if s.default_virtual_stages > 1)


@dataclass
class TrainConfig:
    """Everything a run depends on; stored in ``config.json`` and every checkpoint.

    Each field but ``model_args`` is also an option of ``gpipe train`` (:func:`option`).
    """

    model: str = _option(
        "gpt", f"a built-in model ({', '.join(RECIPES)}), or a Hugging Face model: a folder "
        "that save_pretrained wrote (fine-tuned from its weights, see --init) or a config.json "
        "(trained from scratch); a causal LM, masked LM or sequence-to-sequence model",
        _MODEL, metavar="NAME|DIR",
    )  # fmt: skip
    size: str = _option(
        "small", "preset: a built-in model's shape; for every model, the training's length, "
        "batch and learning rate", _MODEL, choices=SIZES,
    )  # fmt: skip
    init: str = _option(
        "auto", "the initial weights: the --model folder's (pretrained), or random; auto: its "
        "weights where it has them", _MODEL, choices=INITS,
    )  # fmt: skip
    model_config: str | None = _option(
        None, "fields of the model's configuration to override, e.g. num_hidden_layers=4,"
        "hidden_size=256 (a built-in's: n_layers=6,d_model=192): the size, from scratch",
        _MODEL, metavar="FIELD=VALUE,...", default_text="the folder's, or the preset's",
    )  # fmt: skip
    family: str = _option(
        "auto", "what a Hugging Face model learns (auto: by its configuration's architectures)",
        _MODEL, choices=("auto", *FAMILIES),
    )  # fmt: skip
    split: str | None = _option(
        None, "module paths to cut the model before, comma-separated", _MODEL,
        metavar="PATH,...", default_text="every block of its lists of blocks",
    )  # fmt: skip
    data: str | None = _option(
        None, "text to learn from: a text file, a JSONL file (see --text-field), a folder of "
        "them, or a dataset folder saved by datasets' save_to_disk", _DATA, metavar="PATH",
        default_text="the built-in model's data: the stdlib's source, or digits",
    )  # fmt: skip
    text_field: str = _option("text", "the JSONL field or dataset column of the text", _DATA)
    target_field: str = _option(
        "target", "sequence-to-sequence models: the field of the target text (--text-field "
        "holds the source)", _DATA,
    )  # fmt: skip
    val_data: str | None = _option(
        None, "the validation text, as --data", _DATA, metavar="PATH",
        default_text="the data's own split, else --val-fraction of it",
    )  # fmt: skip
    val_fraction: float = _option(
        0.05, "the share of the documents held out for validation (one document: its end)",
        _DATA,
    )  # fmt: skip
    tokenizer: str = _option(
        "auto", "bytes, or a folder holding a Hugging Face tokenizer; auto: the --model "
        "folder's tokenizer, else bytes", _DATA, metavar="auto|bytes|DIR",
    )  # fmt: skip
    packing: str = _option(
        "pack", "pack: documents joined (end-of-text between them) and cut into samples of "
        "--seq; pad: each document cut on its own, its last sample padded (the loss a mean "
        "over the real tokens either way)", _DATA, choices=PACKINGS,
    )  # fmt: skip
    mask_prob: float = _option(0.15, "masked LMs: the share of tokens masked", _DATA)
    seq: int = _option(64, "tokens per sample, language models only", _DATA)
    stages: int = _option(
        2, "K: pipeline stages, one process each; under torchrun, WORLD_SIZE / --replicas",
        _PIPELINE, flags=("-K",),
    )  # fmt: skip
    chunks: int = _option(
        4, "M: micro-batches per mini-batch, i.e. gradient accumulation: one optimizer step "
        "per mini-batch of --batch samples, its gradient summed over M micro-batches",
        _PIPELINE, flags=("-M",),
    )  # fmt: skip
    schedule: str = _option("gpipe", "the pipeline schedule", _PIPELINE, choices=tuple(SCHEDULES))
    virtual_stages: int = _option(
        1, "stages per process", _PIPELINE,
        default_text=f"2 for {_MULTI_STAGE}, else 1",
    )  # fmt: skip
    checkpoint: str = _option(
        "except_last", "re-materialization, Pipe's checkpoint= (for saving see --save-every)",
        _PIPELINE, choices=REMAT_MODES,
    )  # fmt: skip
    checkpoint_layers: int | None = _option(
        None, "re-materialized micro-batches recompute N layers at a time in backward: the "
        "peak holds one group's activations, not the stage's, for one more forward",
        _PIPELINE, metavar="N", default_text="a whole stage at once",
    )  # fmt: skip
    balance: list[int] | None = _option(  # noqa: RUF009 (a field(), not a shared value)
        None, "layers per stage, e.g. 3,3", _PIPELINE, metavar="N,N,...",
        default_text="as even as possible",
    )  # fmt: skip
    replicas: int = _option(
        1,
        "R: data-parallel replicas of the pipeline, K x R processes in all",
        _PIPELINE,
        flags=("-R",),
    )
    shard: str | None = _option(
        None, "shard each stage's parameters, gradients and optimizer state over its "
        "replicas (FSDP2, see gpipe.Layout): 'all' also each micro-batch's gradients as they "
        "accumulate (a reduce-scatter per micro-batch), about 1/R of the memory for weights; "
        "'params' reduce-scatters the step's whole gradients once", _PIPELINE,
        choices=SHARD_MODES, default_text="none: every replica holds all",
    )  # fmt: skip
    compile: bool = _option(
        False, "compile each layer of every stage with torch.compile (inductor): the same "
        "gradients as eager, to rounding; the first steps spend time compiling "
        "(see gpipe.train.compiling)", _PIPELINE,
    )  # fmt: skip
    batch: int = _option(16, "global mini-batch size, all replicas together", _OPTIMIZATION)
    steps: int = _option(
        500, "optimizer steps in all; on --resume, another number moves the end of the decay "
        "there: the rate goes on from where it stood and reaches its end (lr/10, or 0) at the "
        "new last step", _OPTIMIZATION,
    )  # fmt: skip
    lr: float = _option(3e-3, "peak learning rate", _OPTIMIZATION)
    lr_schedule: str = _option(
        "cosine", "after warm-up: cosine (to lr/10 at the last step), linear (to 0), "
        "constant; torch.optim.lr_scheduler's, see gpipe.train.lr_schedule", _OPTIMIZATION,
        choices=LR_SCHEDULES,
    )  # fmt: skip
    warmup: int = _option(20, "linear warm-up steps", _OPTIMIZATION)
    optimizer: str = _option(
        "adamw", "torch.optim's AdamW, Adam or SGD (see gpipe.train.optimizers)", _OPTIMIZATION,
        choices=tuple(OPTIMIZERS),
    )  # fmt: skip
    weight_decay: float = _option(
        0.1, "weight decay of matrices: AdamW's apart from the gradient; Adam's and SGD's "
        "added to it (L2)", _OPTIMIZATION,
    )  # fmt: skip
    beta1: float = _option(0.9, "AdamW's and Adam's first beta", _OPTIMIZATION)
    beta2: float = _option(0.95, "AdamW's and Adam's second beta", _OPTIMIZATION)
    eps: float = _option(1e-8, "AdamW's and Adam's epsilon", _OPTIMIZATION)
    momentum: float = _option(0.0, "SGD's momentum", _OPTIMIZATION)
    grad_clip: float = _option(1.0, "global gradient-norm clip, 0: off", _OPTIMIZATION)
    freeze: str | None = _option(
        None, "freeze the parameters whose names match one of these comma-separated fnmatch "
        "patterns ('0.*,1.*', '*.embed_tokens.*'): no gradient, not in the optimizer",
        _OPTIMIZATION, metavar="PATTERNS", default_text="none",
    )  # fmt: skip
    lora: str | None = _option(
        None, "train low-rank adapters (peft's LoRA) of a Hugging Face model instead of its "
        "weights: r=8,alpha=16,targets=q_proj,v_proj (defaults: r 8, alpha 2r, dropout 0, "
        "peft's targets for the model type); needs pip install 'gpipe[lora]'; see "
        "gpipe.train.lora", _OPTIMIZATION, metavar="SPEC", default_text="none",
    )  # fmt: skip
    skip_nonfinite: int = _option(
        0, "skip up to N steps whose loss or gradients are not finite, 0: stop at the first",
        _OPTIMIZATION, metavar="N",
    )  # fmt: skip
    seed: int = _option(0, "initial weights, data order, dropout", _OPTIMIZATION)
    dtype: str = _option(
        "float32", "bfloat16: autocast; float16: autocast and a gradient scaler; float64: the "
        "weights in float64 (for exact comparisons)",
        _OPTIMIZATION, choices=DTYPES,
    )  # fmt: skip
    save_every: int = _option(100, "checkpoint every N steps, 0: at the end", _CHECKPOINTS)
    keep: int = _option(3, "checkpoints to keep, 0: all", _CHECKPOINTS)
    keep_best: bool = _option(
        False, "also keep the checkpoint of the best validation loss as OUT/best/ (retention "
        "never deletes it); a validation that improves saves one", _CHECKPOINTS,
    )  # fmt: skip
    save_on_exit: bool = _option(
        True, "on Ctrl-C or SIGTERM, save the step it stops after", _CHECKPOINTS
    )
    resume: str | None = _option(
        None, "a checkpoint, or a run folder to continue (its newest intact checkpoint); "
        "auto: --out's, if it holds one, else a fresh start (a job started again, as by "
        "torchrun --max-restarts, continues by itself)", _CHECKPOINTS, metavar="DIR",
    )  # fmt: skip
    out: str = _option(
        "", "output folder", _OUTPUT, flags=("-o",), default_text="runs/MODEL-SIZE-TIME"
    )
    eval_every: int = _option(50, "validate every N steps, 0: at the end", _OUTPUT)
    eval_batches: int = _option(8, "validation batches", _OUTPUT)
    sample_tokens: int = _option(
        200, "tokens of text to generate (bytes, byte-level), causal language models only",
        _OUTPUT,
    )  # fmt: skip
    prompt: str = _option("def ", "start of the generated text", _OUTPUT)
    temperature: float = _option(0.8, "sampling temperature", _OUTPUT)
    progress: str = _option(
        "auto", "a bar (rich), lines, or auto: a bar on a terminal", _OUTPUT, choices=PROGRESS
    )
    log_every: int = _option(10, "steps between progress lines", _OUTPUT)
    report_to: str = _option(
        "tensorboard", "where each step's metrics go besides metrics.jsonl, comma-separated: "
        "tensorboard (event files in the output folder), wandb, mlflow (each an optional "
        "extra: pip install 'gpipe[wandb]'), MODULE:FUNCTION (a function of yours, called with "
        "each record), or none; see gpipe.train.reporters", _OUTPUT, metavar="LIST",
    )  # fmt: skip
    threads: int = _option(
        0,
        "torch threads per process, 0: OMP_NUM_THREADS if set, else cores / processes",
        _PROCESSES,
    )
    cpu_allocator: str = _option(
        "default", "freed CPU tensors: 'default' as the C library does, 'cache' keeps them for "
        "reuse (faster, notably for zero-bubble schedules), 'return' gives them back "
        "(memory-bound runs: what gpipe plan --capacity measures budgets with); each rank "
        "starts with it; see gpipe.base.allocator", _PROCESSES, choices=POLICIES,
    )  # fmt: skip
    timeout: float = _option(120.0, "seconds a rank waits for another", _PROCESSES)
    transport: str = _option(
        "auto", "what carries messages between stages: 'auto' Unix sockets where every rank "
        "is on this machine (the CPU's fastest), else the process group; 'sockets' or "
        "'group' (gloo, NCCL) to insist; see Pipe(transport=...)", _PROCESSES,
        choices=TRANSPORTS,
    )  # fmt: skip
    # The model's own arguments (width, depth; a Hugging Face model's whole configuration):
    # from the preset or the --model folder, or the checkpoint on resume.
    model_args: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    @property
    def layout(self) -> Layout:
        """The pipeline's layout: the fields named as :class:`Layout`'s."""
        return Layout.from_dict(vars(self))

    @property
    def task(self) -> Task:
        return task_of(self)

    @property
    def model_name(self) -> str:
        """The built-in model's name, or the Hugging Face folder's (or file's) name."""
        return self.model if self.model in RECIPES else Path(self.model).stem


def model_spec(config: TrainConfig) -> dict[str, Any]:
    """What builds the model: ``{"kind": "gpt", "args": {...}}`` (saved with checkpoints)."""
    return config.task.model.spec


def num_layers(spec: dict[str, Any]) -> int:
    return source_of(spec).units()


class ConfigError(ValueError):
    """The options ask for something that cannot run; one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(f"- {p}" for p in problems))
        self.problems = problems
