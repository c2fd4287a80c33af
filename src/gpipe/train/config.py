"""The main job's configuration: :class:`TrainConfig`, and :func:`resolve`, which builds one
from the options a user gave, the checkpoint being resumed and the task's presets, and lists
every problem at once (:class:`ConfigError`) before any process starts."""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
import typing
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import gpipe.train.checkpoint as ckpt
import gpipe.train.lora as lora
import gpipe.train.memory_checks as memory_checks
import gpipe.train.reporters as reporters
import gpipe.train.run_folder as run_folder
from gpipe.allocator import POLICIES
from gpipe.layout import FLAGS, Layout
from gpipe.parallel.group import TRANSPORTS
from gpipe.remat import REMAT_MODES
from gpipe.schedule import SCHEDULES
from gpipe.train.hf import (
    FAMILIES,
    HFModel,
    families_of,
    family_of,
    has_weights,
    parse_overrides,
    read_config,
    transformers_module,
)
from gpipe.train.lr_schedule import LR_SCHEDULES
from gpipe.train.objectives import PACKINGS
from gpipe.train.optimizers import OPTIMIZERS
from gpipe.train.optimizers import problems as optimizer_problems
from gpipe.train.tasks import (
    HF_FOLDER,
    RECIPES,
    Task,
    recipe_of,
    sized_rates,
    source_of,
    task_of,
    tokenizer_of,
)
from gpipe.train.tokenizers import BYTES

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
    "resolve",
]

SIZES = ("tiny", "small", "base")
DTYPES = ("float32", "bfloat16", "float16", "float64")
INITS = ("auto", "pretrained", "random")
PROGRESS = ("auto", "bar", "lines")
# What a checkpoint's weights and data position depend on: these cannot change on resume.
_FIXED_ON_RESUME = (
    "model", "size", "seq", "seed", "model_config", "family", "split", "tokenizer", "data",
    "text_field", "target_field", "val_data", "val_fraction", "packing", "mask_prob", "lora",
)  # fmt: skip
# The optimizer and the schedule a checkpoint's state follows; --steps alone may change (it
# moves the horizon).
_OPTIMIZER_ON_RESUME = (
    "optimizer", "lr", "lr_schedule", "warmup", "weight_decay", "beta1", "beta2", "eps",
    "momentum", "freeze",
)  # fmt: skip
_PATHS = ("model", "data", "val_data", "tokenizer")  # made absolute: a run resumes anywhere


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
    shard: bool = _option(
        False, "shard each stage's parameters, gradients (also as they accumulate, a "
        "reduce-scatter per micro-batch) and optimizer state over its replicas (FSDP2, "
        "Pipe(shard='all')): about 1/R of the memory for weights", _PIPELINE,
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
    threads: int = _option(0, "torch threads per process, 0: cores / processes", _PROCESSES)
    cpu_allocator: str = _option(
        "default", "freed CPU tensors: 'default' as the C library does, 'cache' keeps them for "
        "reuse (faster, notably for zero-bubble schedules), 'return' gives them back "
        "(memory-bound runs: what gpipe plan --capacity measures budgets with); each rank "
        "starts with it; see gpipe.allocator", _PROCESSES, choices=POLICIES,
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
        return Layout(
            stages=self.stages,
            chunks=self.chunks,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            checkpoint=self.checkpoint,
            checkpoint_layers=self.checkpoint_layers,
            replicas=self.replicas,
            shard=self.shard,
        )

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


def resolve(options: dict[str, Any], *, world_size: int | None = None) -> TrainConfig:
    """The run's configuration: the given ``options`` (a field of :class:`TrainConfig` each,
    None meaning not given), else the checkpoint's (on ``resume``), else the task's preset,
    else :class:`TrainConfig`'s. Raises :class:`ConfigError` listing every problem.
    ``world_size`` is torchrun's, when running under it.
    """
    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in options.items() if k in names and v is not None}
    problems: list[str] = []
    if isinstance(given.get("balance"), str):
        try:
            given["balance"] = [int(b) for b in given["balance"].split(",")]
        except ValueError:
            problems.append(f"--balance must be comma-separated ints, got {given['balance']!r}")
            del given["balance"]

    for key in _PATHS:  # paths as the ranks and a resumed run see them, wherever they start
        value = given.get(key)
        if value not in (None, *RECIPES, "auto", BYTES) and Path(value).expanduser().exists():
            given[key] = str(Path(value).expanduser().resolve())

    manifest = None
    if given.get("resume"):
        try:
            manifest = ckpt.read_manifest(given["resume"])
        except ckpt.CheckpointError as error:
            raise ConfigError([f"--resume {given['resume']}: {error}"]) from None
        if manifest.config is None:  # not written by gpipe train
            raise ConfigError([
                f"--resume {given['resume']}: {manifest.path} holds no run configuration (it "
                "was written by gpipe.train.checkpoint directly, not by gpipe train): load its "
                "weights with gpipe.train.checkpoint.load_tensors instead"
            ])  # fmt: skip
        saved = manifest.config
        for key in _FIXED_ON_RESUME:
            if key in given and given[key] != saved.get(key):  # .get: a key newer than it
                problems.append(
                    f"--{key} {given[key]} differs from the checkpoint's {saved.get(key)!r}: a "
                    f"resumed run keeps the model, data and seed; drop --{key}"
                )
                # The rest is checked with the checkpoint's: another model with this
                # checkpoint's model arguments would fail on them instead of saying this.
                del given[key]
        for key in _OPTIMIZER_ON_RESUME:
            was = saved.get(key, getattr(TrainConfig, key))  # a checkpoint older than the key
            if key in given and given[key] != was:
                problems.append(
                    f"{flag(key)} {given[key]} differs from the checkpoint's {was!r}: a "
                    f"resumed run continues its optimizer and learning-rate schedule (--steps "
                    f"may change); drop {flag(key)}"
                )
        if "out" not in given and (run := run_folder.run_of(manifest.path)):
            given["out"] = str(run)
        values = {**saved, **given, "resume": str(manifest.path)}
    else:
        chosen, found = _model(given)
        problems += found
        values = {**chosen.pop("preset"), **given, **chosen, "model": given.get("model", "gpt")}
    problems += _data_problems(values, given) + _output_problems(values, given)
    default_layout = Layout(schedule=values.get("schedule", "gpipe"))
    values.setdefault("virtual_stages", default_layout.virtual_stages)
    if world_size is not None and "stages" not in given:
        values["stages"] = max(1, world_size // values.get("replicas", 1))
    config = TrainConfig(**{k: v for k, v in values.items() if k in names})
    if not config.out:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        config.out = str(Path("runs") / f"{config.model_name}-{config.size}-{stamp}")
    if not problems:
        try:
            problems += config.task.problems()
        except (ValueError, OSError) as error:  # e.g. a tokenizer folder that holds none
            problems.append(f"{type(error).__name__}: {error}")
    start = manifest.step if manifest else 0
    problems += _problems(config, start, world_size, fresh=manifest is None)
    if problems:
        raise ConfigError(problems)
    return config


def _model(given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The model of a new run: its preset, arguments, initial weights and tokenizer."""
    model = given.get("model", TrainConfig.model)
    recipe, problems = recipe_of(model), []
    size = given.get("size", TrainConfig.size)
    try:
        overrides = parse_overrides(given.get("model_config"))
    except ValueError as error:
        problems.append(str(error))
        overrides = {}
    init = given.get("init", "auto")
    if recipe is not HF_FOLDER:
        preset = recipe.preset(size)
        model_args = {k: preset.pop(k) for k in recipe.model_keys}
        unknown = sorted(set(overrides) - set(model_args))
        if unknown:
            problems.append(
                f"--model-config {', '.join(unknown)}: not a field of --model {model}; its "
                f"fields: {', '.join(model_args)}"
            )
        model_args.update((k, v) for k, v in overrides.items() if k in model_args)
        family = recipe.model(model_args, 1, 256).family if recipe.name != "hf-llama" else None
        if init == "pretrained":
            problems.append(
                f"--init pretrained: --model {model} starts from random weights; name a Hugging "
                "Face folder that holds weights to fine-tune it"
            )
        for name in ("family", "split", "lora"):
            if name in given and (name, given[name]) != ("family", family):
                problems.append(f"{flag(name)} applies to a Hugging Face folder (--model DIR)")
        problems += _needs(recipe.name)
        tokenizer = given.get("tokenizer", "auto")
        chosen = {"model_args": model_args, "init": "random",
                  "tokenizer": BYTES if tokenizer == "auto" else tokenizer}  # fmt: skip
        return {"preset": preset, **chosen}, problems

    if not Path(model).exists():
        raise ConfigError([
            f"--model {model}: not a built-in model ({', '.join(RECIPES)}), nor a folder or a "
            "config.json of a Hugging Face model"
        ])  # fmt: skip
    try:
        transformers_module()
    except ImportError as error:
        raise ConfigError([f"--model {model}: {error}"]) from None
    weights = has_weights(model)
    if init == "auto":
        init = "pretrained" if weights else "random"
    if init == "pretrained" and not weights:
        problems.append(
            f"--init pretrained: {model} holds no model.safetensors (nor its index): save it "
            "with save_pretrained (safetensors), or train from scratch with --init random"
        )
    try:
        config = read_config(model, overrides)
    except ValueError as error:
        raise ConfigError([*problems, str(error)]) from None
    family = given.get("family", "auto")
    known = families_of(config["model_type"])
    if family != "auto" and family not in known:
        problems.append(
            f"--family {family}: transformers builds model type {config['model_type']} as "
            f"{', '.join(known) or 'none of ' + ', '.join(FAMILIES)}"
        )
    if family == "auto":
        family = family_of(config)
        if family is None:
            problems.append(
                f"--model {model}: {config.get('architectures') or config['model_type']} is not "
                f"a causal LM, masked LM or sequence-to-sequence model that transformers "
                f"knows; name its family with --family {{{','.join(FAMILIES)}}}"
            )
    split = given.get("split")
    model_args = {"config": config, "family": family,
                  "split": [p.strip() for p in split.split(",")] if split else None}  # fmt: skip
    if given.get("lora"):  # part of the model: its checkpoints hold the adapters' names
        try:
            model_args["lora"] = lora.parse(given["lora"])
        except ValueError as error:
            problems.append(str(error))
        if importlib.util.find_spec("peft") is None:
            problems.append("--lora needs peft: pip install 'gpipe[lora]'")
    tokenizer = given.get("tokenizer", "auto")
    chosen = {
        "preset": _sized(HF_FOLDER.preset(size), model_args, pretrained=init == "pretrained"),
        "model_args": model_args, "init": init,
        "tokenizer": tokenizer_of(model) if tokenizer == "auto" else tokenizer,
    }  # fmt: skip
    return chosen, problems


def _sized(preset: dict[str, Any], model_args: dict[str, Any], **how: Any) -> dict[str, Any]:
    try:
        return {**preset, **sized_rates(HFModel(model_args).parameter_count(), preset, **how)}
    except (ValueError, OSError, ImportError):  # a model transformers cannot build: said later
        return preset


def _output_problems(values: dict[str, Any], given: dict[str, Any]) -> list[str]:
    # Asked for by name, TensorBoard must be there; by default a run without it says so and
    # goes on (gpipe.train.reporters).
    return reporters.problems(values.get("report_to", ""), given="report_to" in given)


def _needs(recipe: str) -> list[str]:
    """The optional libraries a built-in model needs, where missing."""
    library, extra = {"resnet": ("sklearn", "digits"), "hf-llama": ("transformers", "hf")}.get(
        recipe, (None, None)
    )
    if library is None:
        return []
    try:
        __import__(library)
    except ImportError:
        return [f"--model {recipe} needs {library}: pip install 'gpipe[{extra}]'"]
    return []


def _data_problems(values: dict[str, Any], given: dict[str, Any]) -> list[str]:
    problems = []
    if recipe_of(values["model"]).data == "digits":
        for name in ("seq", "data", "val_data", "tokenizer", "packing"):
            if name in given:
                problems.append(f"{flag(name)} applies to language models, not --model resnet")
    for name in ("data", "val_data"):
        if values.get(name) and not Path(values[name]).exists():
            problems.append(f"{flag(name)} {values[name]}: no such file or folder")
    if not 0 < values.get("val_fraction", TrainConfig.val_fraction) < 1:
        problems.append(f"--val-fraction must be in (0, 1), got {values['val_fraction']}")
    if not 0 < values.get("mask_prob", TrainConfig.mask_prob) < 1:
        problems.append(f"--mask-prob must be in (0, 1), got {values['mask_prob']}")
    tokenizer = values.get("tokenizer")
    if tokenizer not in (None, "auto", BYTES) and not Path(tokenizer).is_dir():
        problems.append(f"--tokenizer {tokenizer}: give bytes, or a folder holding a tokenizer")
    return problems


def _problems(c: TrainConfig, start: int, world_size: int | None, *, fresh: bool) -> list[str]:
    problems = []
    for name in ("batch", "steps", "seq"):
        if getattr(c, name) < 1:
            problems.append(f"--{name} must be >= 1, got {getattr(c, name)}")
    for name in (
        "warmup",
        "save_every",
        "eval_every",
        "keep",
        "sample_tokens",
        "threads",
        "skip_nonfinite",
    ):
        if getattr(c, name) < 0:
            problems.append(f"{flag(name)} must be >= 0, got {getattr(c, name)}")
    for f in fields(TrainConfig):  # argparse checks a flag's choices, not a file's values
        how, value = option(f), getattr(c, f.name)
        if how is not None and how.choices is not None and value not in how.choices:
            problems.append(f"{flag(f.name)} {value!r}: choose one of {', '.join(how.choices)}")
    if c.lr <= 0 or c.grad_clip < 0 or c.weight_decay < 0 or c.temperature <= 0:
        problems.append("--lr and --temperature must be > 0, --grad-clip and --weight-decay >= 0")
    problems += optimizer_problems(c, TrainConfig())
    if c.eval_batches < 1 or c.log_every < 1 or not 0 < c.timeout < 1e9:
        problems.append("--eval-batches, --log-every and --timeout must be positive (finite)")
    out = Path(c.out)
    if out.exists() and not out.is_dir():
        problems.append(f"--out {c.out} is a file: give a folder for the run's outputs")
    else:
        existing = next(p for p in (out, *out.parents) if p.exists())
        if not _writable(existing):
            problems.append(f"--out {c.out}: {existing} is not writable; choose another --out")
    layers = None
    if not problems:
        try:
            layers = num_layers(model_spec(c))
        except (ValueError, OSError) as error:  # a model its configuration cannot build
            problems.append(f"--model {c.model}: {error}")
    batch = c.batch if c.batch >= 1 else None
    problems += c.layout.problems(layers=layers, balance=c.balance, batch=batch, spelling=FLAGS)
    if problems:
        return problems  # the checks below assume sane numbers

    if start >= c.steps:
        problems.append(
            f"the checkpoint is at step {start} and --steps is {c.steps}: nothing to train; "
            f"pass --steps > {start}"
        )
    if world_size is not None and world_size != c.world_size:
        problems.append(
            f"torchrun started {world_size} processes but --stages {c.stages} x --replicas "
            f"{c.replicas} needs {c.world_size}"
        )
    problems += memory_checks.problems(c, spawns=world_size is None)
    checkpoints = Path(c.out) / run_folder.CHECKPOINTS
    if fresh and checkpoints.is_dir() and ckpt.holds(checkpoints):
        problems.append(
            f"--out {c.out} already holds a run's checkpoints: continue it with "
            f"--resume {c.out}, or choose another --out"
        )
    return problems


def _writable(folder: Path) -> bool:
    """Whether a folder can be made in ``folder``: tried, since ``os.access`` says yes to
    root everywhere, even on a read-only file system (/proc, a read-only mount)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        probe = tempfile.mkdtemp(prefix=".gpipe-probe-", dir=folder)
    except OSError:
        return False
    os.rmdir(probe)
    return True
