"""The main job's configuration: :class:`TrainConfig`, and :func:`resolve`, which builds one
from the options a user gave, the checkpoint being resumed and the task's presets, and lists
every problem at once (:class:`ConfigError`) before any process starts."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from gpipe import checkpoint as ckpt
from gpipe.allocator import POLICIES
from gpipe.layout import FLAGS, Layout
from gpipe.remat import REMAT_MODES
from gpipe.schedule import SCHEDULES
from gpipe.train.tasks import TASKS, Task

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
LR_SCHEDULES = ("cosine", "linear", "constant")
DTYPES = ("float32", "bfloat16")
PROGRESS = ("auto", "bar", "lines")
# What a checkpoint's weights depend on: these cannot change on resume.
_FIXED_ON_RESUME = ("model", "size", "seq", "seed")


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


def preset_fields() -> set[str]:
    """The fields a task's presets set: their default depends on --model and --size."""
    return {
        key
        for task in TASKS.values()
        for preset in task.presets.values()
        for key in preset
        if key not in task.model_keys
    }


_MODEL, _PIPELINE, _OPTIMIZATION = "model and data", "pipeline", "optimization"
_CHECKPOINTS, _OUTPUT, _PROCESSES = "checkpoints and resuming", "output", "processes"
_MULTI_STAGE = ", ".join(n for n, s in SCHEDULES.items() if s.default_virtual_stages > 1)


@dataclass
class TrainConfig:
    """Everything a run depends on; stored in ``config.json`` and every checkpoint.

    Each field but ``model_args`` is also an option of ``gpipe train`` (:func:`option`).
    """

    model: str = _option(
        "gpt", "the model: a task of gpipe.train.tasks", _MODEL, choices=tuple(sorted(TASKS))
    )
    size: str = _option("small", "the model's preset size", _MODEL, choices=SIZES)
    seq: int = _option(64, "tokens per sample, language models only", _MODEL)
    stages: int = _option(
        2, "K: pipeline stages, one process each; under torchrun, WORLD_SIZE / --replicas",
        _PIPELINE, flags=("-K",),
    )  # fmt: skip
    chunks: int = _option(4, "M: micro-batches per mini-batch", _PIPELINE, flags=("-M",))
    schedule: str = _option("gpipe", "the pipeline schedule", _PIPELINE, choices=tuple(SCHEDULES))
    virtual_stages: int = _option(
        1, "stages per process", _PIPELINE,
        default_text=f"2 for {_MULTI_STAGE}, else 1",
    )  # fmt: skip
    checkpoint: str = _option(
        "except_last", "re-materialization, Pipe's checkpoint= (for saving see --save-every)",
        _PIPELINE, choices=REMAT_MODES,
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
        False, "shard each stage's parameters, gradients and optimizer state over its replicas "
        "(FSDP2): about 1/R of the memory for weights", _PIPELINE,
    )  # fmt: skip
    batch: int = _option(16, "global mini-batch size, all replicas together", _OPTIMIZATION)
    steps: int = _option(500, "optimizer steps in all", _OPTIMIZATION)
    lr: float = _option(3e-3, "peak learning rate", _OPTIMIZATION)
    lr_schedule: str = _option(
        "cosine", "after warm-up: cosine (to lr/10), linear (to 0), constant", _OPTIMIZATION,
        choices=LR_SCHEDULES,
    )  # fmt: skip
    warmup: int = _option(20, "linear warm-up steps", _OPTIMIZATION)
    weight_decay: float = _option(0.1, "AdamW weight decay, of matrices", _OPTIMIZATION)
    grad_clip: float = _option(1.0, "global gradient-norm clip, 0: off", _OPTIMIZATION)
    skip_nonfinite: int = _option(
        0, "skip up to N steps whose loss or gradients are not finite, 0: stop at the first",
        _OPTIMIZATION, metavar="N",
    )  # fmt: skip
    seed: int = _option(0, "initial weights, data order, dropout", _OPTIMIZATION)
    dtype: str = _option("float32", "bfloat16: autocast", _OPTIMIZATION, choices=DTYPES)
    save_every: int = _option(100, "checkpoint every N steps, 0: at the end", _CHECKPOINTS)
    keep: int = _option(3, "checkpoints to keep, 0: all", _CHECKPOINTS)
    save_on_exit: bool = _option(
        True, "on Ctrl-C or SIGTERM, save the step it stops after", _CHECKPOINTS
    )
    resume: str | None = _option(
        None, "a checkpoint, or a run folder to continue (its newest intact checkpoint)",
        _CHECKPOINTS, metavar="DIR",
    )  # fmt: skip
    out: str = _option(
        "", "output folder", _OUTPUT, flags=("-o",), default_text="runs/MODEL-SIZE-TIME"
    )
    eval_every: int = _option(50, "validate every N steps, 0: at the end", _OUTPUT)
    eval_batches: int = _option(8, "validation batches", _OUTPUT)
    sample_tokens: int = _option(200, "bytes of text to generate, language models only", _OUTPUT)
    prompt: str = _option("def ", "start of the generated text", _OUTPUT)
    temperature: float = _option(0.8, "sampling temperature", _OUTPUT)
    progress: str = _option(
        "auto", "a bar (rich), lines, or auto: a bar on a terminal", _OUTPUT, choices=PROGRESS
    )
    log_every: int = _option(10, "steps between progress lines", _OUTPUT)
    threads: int = _option(0, "torch threads per process, 0: cores / processes", _PROCESSES)
    cpu_allocator: str = _option(
        "default", "freed CPU tensors: 'default' as the C library does, 'cache' keeps them for "
        "reuse (faster, notably for zero-bubble schedules), 'return' gives them back "
        "(memory-bound runs); see gpipe.allocator", _PROCESSES, choices=POLICIES,
    )  # fmt: skip
    timeout: float = _option(120.0, "seconds a rank waits for another", _PROCESSES)
    # The model's own arguments (width, depth): from the preset, or the checkpoint on resume.
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
            replicas=self.replicas,
            shard=self.shard,
        )

    @property
    def task(self) -> Task:
        return TASKS[self.model]


def model_spec(config: TrainConfig) -> dict[str, Any]:
    """What builds the model: ``{"kind": "gpt", "args": {...}}`` (saved with checkpoints)."""
    return {"kind": config.model, "args": config.task.spec_args(config.seq, config.model_args)}


def num_layers(spec: dict[str, Any]) -> int:
    return TASKS[spec["kind"]].units(spec["args"])


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

    manifest = None
    if given.get("resume"):
        try:
            manifest = ckpt.read_manifest(given["resume"])
        except ckpt.CheckpointError as error:
            raise ConfigError([f"--resume {given['resume']}: {error}"]) from None
        saved = manifest.config
        for key in _FIXED_ON_RESUME:
            if key in given and given[key] != saved[key]:
                problems.append(
                    f"--{key} {given[key]} differs from the checkpoint's {saved[key]!r}: a "
                    f"resumed run keeps the model, data and seed; drop --{key}"
                )
        if "out" not in given:
            folder = manifest.path
            if folder.parent.name == "checkpoints":
                given["out"] = str(folder.parent.parent)
        values = {**saved, **given, "resume": str(manifest.path)}
    else:
        task = TASKS[given.get("model", TrainConfig.model)]
        preset = dict(task.presets[given.get("size", TrainConfig.size)])
        model_args = {k: preset.pop(k) for k in task.model_keys}
        values = {**preset, **given, "model": task.name, "model_args": model_args}
    problems += TASKS[values["model"]].problems(given)
    default_layout = Layout(schedule=values.get("schedule", "gpipe"))
    values.setdefault("virtual_stages", default_layout.virtual_stages)
    if world_size is not None and "stages" not in given:
        values["stages"] = max(1, world_size // values.get("replicas", 1))
    config = TrainConfig(**{k: v for k, v in values.items() if k in names})
    if not config.out:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        config.out = str(Path("runs") / f"{config.model}-{config.size}-{stamp}")
    start = manifest.step if manifest else 0
    problems += _problems(config, start, world_size, fresh=manifest is None)
    if problems:
        raise ConfigError(problems)
    return config


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
    if c.cpu_allocator not in POLICIES:
        problems.append(f"--cpu-allocator {c.cpu_allocator!r}: choose one of {', '.join(POLICIES)}")
    if c.lr <= 0 or c.grad_clip < 0 or c.weight_decay < 0 or c.temperature <= 0:
        problems.append("--lr and --temperature must be > 0, --grad-clip and --weight-decay >= 0")
    if c.eval_batches < 1 or c.log_every < 1 or not 0 < c.timeout < 1e9:
        problems.append("--eval-batches, --log-every and --timeout must be positive (finite)")
    out = Path(c.out)
    if out.exists() and not out.is_dir():
        problems.append(f"--out {c.out} is a file: give a folder for the run's outputs")
    else:
        existing = next(p for p in (out, *out.parents) if p.exists())
        if not _writable(existing):
            problems.append(f"--out {c.out}: {existing} is not writable; choose another --out")
    layers = num_layers(model_spec(c)) if not problems else None
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
    problems += _memory_problems(c, spawns=world_size is None)
    if fresh and (Path(c.out) / "checkpoints").is_dir():
        try:
            ckpt.find(Path(c.out) / "checkpoints")
            problems.append(
                f"--out {c.out} already holds a run's checkpoints: continue it with "
                f"--resume {c.out}, or choose another --out"
            )
        except ckpt.CheckpointError:
            pass
    return problems


_PROCESS_BYTES = 400 * 2**20  # a rank before its model: Python, torch, gloo (measured ~350 MiB)


def _memory_problems(c: TrainConfig, *, spawns: bool) -> list[str]:
    """Sizes this machine cannot hold, refused before any process allocates them.

    Generous on purpose: the floor is one micro-batch in the largest layer of one rank
    (:meth:`Task.activation_floor`), against all of the machine's memory; a run refused
    here could not have finished its first step. ``spawns``: this command starts every
    rank here (not torchrun, whose ranks may be on several machines).
    """
    memory = _physical_memory()
    if memory is None:
        return []
    problems = []
    micro = -(-c.batch // (c.replicas * c.chunks))  # samples of the largest micro-batch
    floor, terms = c.task.activation_floor(model_spec(c)["args"], micro)
    if floor > memory:
        given = ", ".join(f"--{name} {getattr(c, name)}" for name in c.task.size_options)
        lower = " or ".join(f"--{name}" for name in c.task.size_options)
        problems.append(
            f"{given} (--chunks {c.chunks}): one micro-batch of {micro} samples needs at "
            f"least {_gib(floor)} in a single layer ({terms}), more than this machine's "
            f"{_gib(memory)} of memory; lower {lower}, or raise --chunks"
        )
    if spawns and c.world_size * _PROCESS_BYTES > memory:
        problems.append(
            f"--stages {c.stages} x --replicas {c.replicas} = {c.world_size} processes need "
            f"about {_gib(c.world_size * _PROCESS_BYTES)} before any model, more than this "
            f"machine's {_gib(memory)} of memory; use fewer --replicas, or torchrun over "
            "several machines"
        )
    return problems


def _physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(size: float) -> str:
    return f"{size / 2**30:,.1f} GiB"


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
