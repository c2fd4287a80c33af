"""Train a model through a pipeline of K processes: the main job, with no download.

    gpipe train                                   # GPT 'small' on the stdlib's source, K=2
    gpipe train --size tiny --steps 40            # a few seconds
    gpipe train --model resnet                    # ResNet-style CNN (batch norm) on digits
    gpipe train --stages 3 --chunks 8 --schedule 1f1b --dtype bfloat16
    gpipe train --stages 2 --replicas 2           # 2 replicas x 2 stages = 4 processes
    gpipe train --resume runs/gpt-small-...       # continue from the newest checkpoint
    torchrun --nproc-per-node 2 -m gpipe train    # the same, launched by torchrun

The language model (``--model gpt``) is a byte-level GPT trained on the Python standard
library's own ``.py`` files (``gpipe.data``); ``--model resnet`` trains a small ResNet with
deferred batch norm on scikit-learn's digits (``pip install 'gpipe[digits]'``).

The command spawns K x R local processes (``gpipe.launch``), or, when ``RANK`` and
``WORLD_SIZE`` are set (``torchrun``), runs as one of them. Every rank builds only its own
stage; rank 0 alone prints. The output folder receives ``metrics.jsonl`` (one record per
step), ``loss.png``, ``timeline.png``/``timeline.json`` (the measured last step),
``sample.txt`` (text the language model wrote through the pipeline), ``summary.json`` and
``checkpoints/step-NNNNNN/`` (one shard per pipeline rank, see ``gpipe.checkpoint``).

Resuming reproduces the uninterrupted run exactly (bitwise on CPU with the same K, M and
schedule): step t's dropout seed is a function of (seed, t), the learning rate a function
of t, and the checkpoint holds the weights, the optimizer state and the data position.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from gpipe import checkpoint as ckpt
from gpipe.data import EpochSampler, TokenWindows, hash_seed
from gpipe.remat import REMAT_MODES
from gpipe.schedule import SCHEDULES, ScheduleError, build_schedule

__all__ = ["PRESETS", "TrainConfig", "build_model", "configure", "run", "train"]

# -- presets and configuration ----------------------------------------------------------------

# Model shape and the training defaults that suit it. 'small' is the default run: a few
# minutes on 2 CPU cores with the loss falling from ~5.5 to ~2.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {
        "tiny": dict(
            d_model=32, n_heads=2, n_layers=2, dropout=0.1,
            seq=32, batch=8, steps=40, lr=3e-3, warmup=5, eval_every=20, save_every=20,
        ),
        "small": dict(
            d_model=128, n_heads=4, n_layers=4, dropout=0.0,
            seq=64, batch=16, steps=500, lr=3e-3, warmup=20, eval_every=50, save_every=100,
        ),
        "base": dict(
            d_model=256, n_heads=8, n_layers=8, dropout=0.1,
            seq=128, batch=32, steps=2000, lr=1e-3, warmup=100, eval_every=200, save_every=500,
        ),
    },
    "resnet": {
        "tiny": dict(
            channels=8, blocks=2, batch=32, steps=40, lr=3e-3, warmup=5, eval_every=20,
            save_every=20,
        ),
        "small": dict(
            channels=16, blocks=4, batch=64, steps=300, lr=3e-3, warmup=20, eval_every=50,
            save_every=100,
        ),
        "base": dict(
            channels=32, blocks=8, batch=128, steps=1000, lr=2e-3, warmup=50, eval_every=100,
            save_every=250,
        ),
    },
}  # fmt: skip
_MODEL_KEYS = {
    "gpt": ("d_model", "n_heads", "n_layers", "dropout"),
    "resnet": ("channels", "blocks"),
}
# What a checkpoint's weights depend on: these cannot change on resume.
_FIXED_ON_RESUME = ("model", "size", "seq", "seed")


@dataclass
class TrainConfig:
    """Everything a run depends on; stored in ``config.json`` and every checkpoint."""

    model: str = "gpt"  # "gpt" (byte-level LM on stdlib source) or "resnet" (digits)
    size: str = "small"  # preset: "tiny", "small", "base"
    stages: int = 2  # K: pipeline stages, one process each
    replicas: int = 1  # R: data-parallel replicas of the pipeline (K x R processes)
    chunks: int = 4  # M: micro-batches per mini-batch
    schedule: str = "gpipe"
    virtual_stages: int = 1  # stages per process, for "interleaved-1f1b"
    checkpoint: str = "except_last"  # re-materialization (Pipe's checkpoint=)
    balance: list[int] | None = None  # layers per stage (default: as even as possible)
    batch: int = 16  # global mini-batch (all replicas together)
    seq: int = 64  # tokens per sample (gpt)
    steps: int = 500
    lr: float = 3e-3
    lr_schedule: str = "cosine"  # "cosine" (to lr/10), "linear" (to 0), "constant"
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0: off
    seed: int = 0
    dtype: str = "float32"  # or "bfloat16" (autocast)
    out: str = ""
    save_every: int = 100  # 0: only at the end
    keep: int = 3  # checkpoints kept (0: all)
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 8
    sample_tokens: int = 200
    prompt: str = "def "
    temperature: float = 0.8
    log_every: int = 10
    progress: str = "auto"  # "bar" (rich), "lines", "auto": bar on a terminal
    threads: int = 0  # torch threads per process (0: cores / processes)
    timeout: float = 120.0  # seconds a rank waits for another
    resume: str | None = None  # checkpoint folder
    model_args: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas


def model_spec(config: TrainConfig) -> dict[str, Any]:
    """What builds the model: ``{"kind": "gpt", "args": {...}}`` (saved with checkpoints)."""
    if config.model == "gpt":
        args = dict(vocab_size=256, context=config.seq, **config.model_args)
    else:
        args = dict(in_channels=1, classes=10, **config.model_args)
    return {"kind": config.model, "args": args}


def build_model(spec: dict[str, Any]) -> nn.Sequential:
    """The plain (un-split) model of a spec, e.g. to load an exported state dict into."""
    from gpipe.models import GPTConfig, convnet, gpt

    if spec["kind"] == "gpt":
        return gpt(GPTConfig(**spec["args"]))
    if spec["kind"] == "resnet":
        return convnet(**spec["args"])
    raise ValueError(f"unknown model kind {spec['kind']!r}")


def constructor(spec: dict[str, Any]) -> str:
    """Python code that builds the plain model of ``spec``."""
    args = ", ".join(f"{k}={v!r}" for k, v in spec["args"].items())
    if spec["kind"] == "gpt":
        return f"gpipe.models.gpt(gpipe.models.GPTConfig({args}))"
    return f"gpipe.models.convnet({args})"


def num_layers(spec: dict[str, Any]) -> int:
    with torch.device("meta"):
        return len(build_model(spec))


# -- the command line ---------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    # Every option defaults to None: "not given", so that presets and, on --resume, the
    # checkpoint's configuration fill it in.
    g = parser.add_argument_group("model and data")
    g.add_argument("--model", choices=sorted(PRESETS), help="gpt (default) or resnet")
    g.add_argument("--size", choices=["tiny", "small", "base"], help="preset (default: small)")
    g.add_argument("--seq", type=int, help="tokens per sample, gpt only (preset: 64)")
    g = parser.add_argument_group("pipeline")
    g.add_argument("-K", "--stages", type=int, help="pipeline stages (processes; default 2)")
    g.add_argument("-M", "--chunks", type=int, help="micro-batches per mini-batch (default 4)")
    g.add_argument("--schedule", choices=list(SCHEDULES), help="default: gpipe")
    g.add_argument("--virtual-stages", type=int, help="stages per process (interleaved-1f1b: 2)")
    g.add_argument(
        "--checkpoint",
        choices=REMAT_MODES,
        help="re-materialization mode (saving: --save-every)",
    )
    g.add_argument("--balance", help="layers per stage, e.g. 3,3 (default: even)")
    g.add_argument("-R", "--replicas", type=int, help="data-parallel replicas (default 1)")
    g = parser.add_argument_group("optimization")
    g.add_argument("--batch", type=int, help="global mini-batch size (preset)")
    g.add_argument("--steps", type=int, help="optimizer steps in all (preset)")
    g.add_argument("--lr", type=float, help="peak learning rate (preset)")
    g.add_argument("--lr-schedule", choices=["cosine", "linear", "constant"])
    g.add_argument("--warmup", type=int, help="linear warm-up steps (preset)")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.1)")
    g.add_argument("--grad-clip", type=float, help="global gradient-norm clip, 0: off (1.0)")
    g.add_argument("--seed", type=int, help="initial weights, data order, dropout (0)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    g = parser.add_argument_group("output and checkpoints")
    g.add_argument("-o", "--out", help="output folder (default: runs/MODEL-SIZE-TIME)")
    g.add_argument("--resume", metavar="DIR", help="checkpoint, or run folder to continue")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps, 0: at the end")
    g.add_argument("--keep", type=int, help="checkpoints to keep, 0: all (default 3)")
    g.add_argument("--eval-every", type=int, help="validate every N steps, 0: at the end")
    g.add_argument("--eval-batches", type=int, help="validation batches (default 8)")
    g.add_argument("--sample-tokens", type=int, help="bytes of text to generate, gpt (200)")
    g.add_argument("--prompt", help="start of the generated text (default 'def ')")
    g.add_argument("--temperature", type=float, help="sampling temperature (0.8)")
    g.add_argument("--progress", choices=["auto", "bar", "lines"], help="default: auto")
    g.add_argument("--log-every", type=int, help="steps between progress lines (10)")
    g.add_argument("--threads", type=int, help="torch threads per process (cores/processes)")
    g.add_argument("--timeout", type=float, help="seconds a rank waits for another (120)")
    del add


class ConfigError(ValueError):
    """The command line asks for something that cannot run; one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(f"- {p}" for p in problems))
        self.problems = problems


def resolve(args: argparse.Namespace, *, world_size: int | None = None) -> TrainConfig:
    """The run's configuration: explicit options, else the checkpoint's (on --resume), else
    the preset's, else :class:`TrainConfig`'s. Raises :class:`ConfigError` listing every
    problem. ``world_size`` is torchrun's, when running under it.
    """
    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
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
        saved = manifest["config"]
        for key in _FIXED_ON_RESUME:
            if key in given and given[key] != saved[key]:
                problems.append(
                    f"--{key} {given[key]} differs from the checkpoint's {saved[key]!r}: a "
                    f"resumed run keeps the model, data and seed; drop --{key}"
                )
        if "out" not in given:
            folder = Path(manifest["path"])
            if folder.parent.name == "checkpoints":
                given["out"] = str(folder.parent.parent)
        values = {**saved, **given, "resume": manifest["path"]}
    else:
        model = given.get("model", "gpt")
        size = given.get("size", "small")
        preset = dict(PRESETS[model][size])
        model_args = {k: preset.pop(k) for k in _MODEL_KEYS[model]}
        values = {**preset, **given, "model_args": model_args}
        if model == "resnet" and "seq" in given:
            problems.append("--seq applies to --model gpt only")
    values.setdefault("virtual_stages", 2 if values.get("schedule") == "interleaved-1f1b" else 1)
    if world_size is not None and "stages" not in given:
        values["stages"] = max(1, world_size // values.get("replicas", 1))
    config = TrainConfig(**{k: v for k, v in values.items() if k in names})
    if not config.out:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        config.out = str(Path("runs") / f"{config.model}-{config.size}-{stamp}")
    start = manifest["step"] if manifest else 0
    problems += _problems(config, start, world_size, fresh=manifest is None)
    if problems:
        raise ConfigError(problems)
    return config


def _problems(c: TrainConfig, start: int, world_size: int | None, *, fresh: bool) -> list[str]:
    problems = []
    for name in ("stages", "replicas", "chunks", "batch", "steps", "seq", "virtual_stages"):
        value = getattr(c, name)
        if value < 1:
            flag = name.replace("_", "-")
            problems.append(f"--{flag} must be >= 1, got {value}")
    for name in ("warmup", "save_every", "eval_every", "keep", "sample_tokens", "threads"):
        if getattr(c, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(c, name)}")
    if c.lr <= 0 or c.grad_clip < 0 or c.weight_decay < 0 or c.temperature <= 0:
        problems.append("--lr and --temperature must be > 0, --grad-clip and --weight-decay >= 0")
    if c.eval_batches < 1 or c.log_every < 1 or c.timeout <= 0:
        problems.append("--eval-batches, --log-every and --timeout must be positive")
    if problems:
        return problems  # the checks below assume sane numbers

    layers = num_layers(model_spec(c))
    ranks = c.stages * c.virtual_stages
    if ranks > layers:
        what = f"--stages {c.stages}" + (
            f" x --virtual-stages {c.virtual_stages}" if c.virtual_stages > 1 else ""
        )
        problems.append(
            f"{what} needs at least {ranks} layers, but {c.model} {c.size} has {layers}: use "
            f"--stages <= {layers // c.virtual_stages} or a larger --size"
        )
    if c.balance is not None and (len(c.balance) != ranks or sum(c.balance) != layers):
        problems.append(
            f"--balance {','.join(map(str, c.balance))} must have {ranks} entries (one per "
            f"stage) summing to {layers} (the layers of {c.model} {c.size})"
        )
    elif c.balance is not None and min(c.balance) < 1:
        problems.append("--balance entries must be >= 1")
    if c.batch % c.replicas:
        problems.append(f"--batch {c.batch} must be divisible by --replicas {c.replicas}")
    elif c.batch // c.replicas < c.chunks:
        problems.append(
            f"each replica's batch ({c.batch // c.replicas}) must have at least --chunks "
            f"{c.chunks} samples: one per micro-batch; raise --batch or lower --chunks"
        )
    if c.virtual_stages > 1 and c.schedule != "interleaved-1f1b":
        problems.append("--virtual-stages > 1 needs --schedule interleaved-1f1b")
    else:
        try:
            build_schedule(
                c.schedule,
                num_ranks=c.stages,
                num_microbatches=c.chunks,
                virtual_stages=c.virtual_stages,
            )
        except (ScheduleError, ValueError) as error:
            problems.append(f"--schedule {c.schedule}: {error}")
    if c.model == "resnet":
        try:
            import sklearn  # noqa: F401
        except ImportError:
            problems.append(
                "--model resnet trains on scikit-learn's digits: pip install 'gpipe[digits]'"
            )
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


def run(args: argparse.Namespace) -> int:
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else None
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = resolve(args, world_size=world_size)
    except ConfigError as error:
        if rank == 0:
            print(f"gpipe train: error:\n{error}", file=sys.stderr)
        return 2
    if torchrun:
        return _run_under_torchrun(config)
    data = _prepare(config)
    from gpipe.parallel.launch import LaunchError, launch

    try:
        # gloo: this command trains on CPU, and its own collectives carry CPU tensors.
        launch(
            train,
            nprocs=config.world_size,
            args=(config, data),
            backend="gloo",
            timeout=config.timeout,
        )
    except LaunchError as error:
        rank = _root_cause(error.failures)
        first_line = error.failures[rank].strip().splitlines()[0]
        others = len(error.failures) - 1
        print(f"gpipe train: failed in rank {rank}: {first_line}", file=sys.stderr)
        if others:
            print(f"  ({others} other rank(s) stopped with it)", file=sys.stderr)
        if os.environ.get("GPIPE_DEBUG"):
            print(error.failures[rank], file=sys.stderr)
        else:
            print("  set GPIPE_DEBUG=1 for the traceback", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("gpipe train: interrupted", file=sys.stderr)
        return 130
    return 0


# How a rank fails when another one failed first: not the cause worth reporting.
_SECONDARY = (
    "PipelineError",
    "Connection closed",
    "Connection reset",
    "timed out",
    "Timed out",
    "killed by signal",
    "without a result",
)


def _root_cause(failures: dict[int, str]) -> int:
    """The rank whose error started it: the lowest one whose error is not a consequence."""

    def secondary(rank: int) -> bool:
        first_line = (failures[rank].strip().splitlines() or [""])[0]
        return any(s in first_line for s in _SECONDARY)

    return min(failures, key=lambda r: (secondary(r), r))


def _prepare(config: TrainConfig) -> Any:
    """Once, before the ranks start: the output folder and the data (or its cache)."""
    Path(config.out).mkdir(parents=True, exist_ok=True)
    _write_json(Path(config.out) / "config.json", asdict(config))
    if config.model == "gpt":
        from gpipe.data import stdlib_corpus

        stdlib_corpus()  # built and cached here, so the ranks only read it
        return None
    from gpipe.data import digits

    return digits()  # small: handed to the ranks, which then need not import scikit-learn


def _run_under_torchrun(config: TrainConfig) -> int:
    if not dist.is_initialized():
        dist.init_process_group("gloo")  # CPU training, as when the command spawns the ranks
    rank = dist.get_rank()
    try:
        # Every rank resolved the same options; only rank 0's clock named the folder.
        shared = [config]
        dist.broadcast_object_list(shared, src=0)
        config = shared[0]
        if rank == 0:
            _prepare(config)
        dist.barrier()
        train(rank, config)
    finally:
        dist.destroy_process_group()
    return 0


# -- one rank's training ---------------------------------------------------------------------


def train(rank: int, config: TrainConfig, data: Any = None) -> dict[str, Any] | None:
    """The training run of one rank (inside a launched or torchrun process); ``data``: the
    data set when the launcher loaded it (digits), else each rank loads it."""
    return _Trainer(rank, config, data).run()


class _Task:
    """The model's data, loss and units: a language model or an image classifier."""

    def __init__(self, config: TrainConfig, data: Any = None) -> None:
        self.config = config
        if config.model == "gpt":
            from gpipe.data import stdlib_corpus

            corpus = stdlib_corpus()
            self.description = corpus.describe()
            self.train_set = TokenWindows(corpus.train, seq=config.seq)
            self.val_set = TokenWindows(corpus.val, seq=config.seq)
            self.unit, self.per_sample = "tokens", config.seq
            val_indices = self.val_set.evenly_spaced(config.eval_batches * config.batch)
        else:
            if data is None:
                from gpipe.data import digits

                data = digits()
            self.description = data.describe()
            self.train_set = _Pairs(data.train_images, data.train_labels)
            self.val_set = _Pairs(data.val_images, data.val_labels)
            self.unit, self.per_sample = "images", 1
            val_indices = torch.arange(len(data.val_labels))
        self.val_indices = val_indices

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.config.model == "gpt":
            return F.cross_entropy(output.float().flatten(0, 1), target.flatten())
        return F.cross_entropy(output.float(), target)

    def correct(self, output: torch.Tensor, target: torch.Tensor) -> int:
        if self.config.model == "gpt":
            return 0
        return int((output.argmax(-1) == target).sum())


class _Pairs:
    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]


class _Trainer:
    def __init__(self, rank: int, config: TrainConfig, data: Any = None) -> None:
        import gpipe

        self.config, self.rank = config, rank
        self.out = Path(config.out)
        threads = config.threads or max(1, len(os.sched_getaffinity(0)) // config.world_size)
        torch.set_num_threads(threads)
        K, R = config.stages, config.replicas
        if R > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (R, K), mesh_dim_names=("dp", "pp"))
            self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        else:
            self.pp_group, self.dp_group = dist.group.WORLD, None
        self.pp_rank = dist.get_rank(self.pp_group)
        self.replica = rank // K
        self.spec = model_spec(config)
        layers = num_layers(self.spec)
        ranks = K * config.virtual_stages
        balance = config.balance or [
            layers // ranks + (1 if i < layers % ranks else 0) for i in range(ranks)
        ]
        self.pipe = gpipe.Pipe(
            functools.partial(build_model, self.spec),
            balance=balance,
            chunks=config.chunks,
            checkpoint=config.checkpoint,
            schedule=config.schedule,
            virtual_stages=config.virtual_stages,
            deferred_batch_norm=config.model == "resnet",
            group=self.pp_group,
            data_parallel_group=self.dp_group,
            init_seed=config.seed,
            timeout=config.timeout,
        )
        self.balance = balance
        self.names = {p: n for n, p in self.pipe.named_parameters()}
        self.optimizer = self._optimizer()
        self.task = _Task(config, data)
        self.sampler = EpochSampler(len(self.task.train_set), seed=config.seed)
        self.start = 0
        self.bubble: float | None = None
        if config.resume:
            self._load(config.resume)
        self.last_global_rank = dist.get_global_rank(
            self.pp_group, self.pipe.schedule.stage_to_rank[-1]
        )
        self.show = _Reporter(config, rank == 0)
        self.autocast = (
            functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
            if config.dtype == "bfloat16"
            else contextlib.nullcontext
        )

    def _optimizer(self) -> torch.optim.Optimizer | None:
        # Weight decay on matrices (dim >= 2) only, as in nanoGPT; groups are named so that a
        # checkpoint's optimizer state loads into any cut (gpipe.checkpoint).
        params = list(self.pipe.parameters())
        groups = [
            {"name": "decay", "params": [p for p in params if p.dim() >= 2]},
            {"name": "no_decay", "params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if not groups:
            return None  # this rank's layers have no parameters (e.g. pooling only)
        return torch.optim.AdamW(
            groups, lr=self.config.lr, weight_decay=self.config.weight_decay, betas=(0.9, 0.95)
        )

    def lr_at(self, step: int) -> float:
        c = self.config
        if c.warmup and step <= c.warmup:
            return c.lr * step / c.warmup
        if c.lr_schedule == "constant":
            return c.lr
        progress = (step - c.warmup) / max(1, c.steps - c.warmup)
        if c.lr_schedule == "linear":
            return c.lr * (1 - progress)
        return c.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        c = self.config
        total_params = self._sum_over_pipeline(sum(p.numel() for p in self.pipe.parameters()))
        self.show.header(self, int(total_params))
        history = None  # the resumed run's metrics, when it wrote them elsewhere
        if c.resume and Path(c.resume).parent.name == "checkpoints":
            history = Path(c.resume).parent.parent / "metrics.jsonl"
        metrics = _Metrics(
            self.out / "metrics.jsonl", self.start, history=history, enabled=self.rank == 0
        )
        share = c.batch // c.replicas
        items_per_step = c.batch * self.task.per_sample
        step_times: list[float] = []
        first_loss = last_val = None
        trace_step = c.steps
        memory: dict[str, Any] = {}
        started = time.perf_counter()
        self.show.start(self.start)
        for step in range(self.start + 1, c.steps + 1):
            lr = self.lr_at(step)
            if self.optimizer is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
            indices = self.sampler.take(c.batch)
            x, y = self.task.train_set[indices[self.replica * share : (self.replica + 1) * share]]
            tick = time.perf_counter()
            traced = step == trace_step
            with contextlib.ExitStack() as stack:
                meter = stack.enter_context(_meter(self.pipe)) if traced else None
                stack.enter_context(self.autocast())
                loss = self.pipe.step(
                    x, y, self.task.loss, seed=hash_seed(c.seed, step, self.replica), trace=traced
                )
            norm = self.pipe.clip_grad_norm_(c.grad_clip) if c.grad_clip else None
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            loss = self._mean_over_replicas(float(loss))
            step_times.append(time.perf_counter() - tick)
            if traced:
                memory = self._memory(meter)
                self._save_timeline()
            first_loss = loss if first_loss is None else first_loss
            record = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": None if norm is None else float(norm),
                "step_time": step_times[-1],
                f"{self.task.unit}_per_s": items_per_step / step_times[-1],
                "elapsed": time.perf_counter() - started,
            }
            if not math.isfinite(loss):
                self.show.note(f"step {step}: the loss is {loss}; stopping")
                metrics.write(record)
                raise FloatingPointError(f"loss is {loss} at step {step}")
            self.show.step(step, loss, items_per_step / step_times[-1], self.task.unit)
            if (c.eval_every and step % c.eval_every == 0) or step == c.steps:
                last_val = self.evaluate()
                record.update(last_val)
                self.show.note(_format_val(step, last_val))
            metrics.write(record)
            if (c.save_every and step % c.save_every == 0) or step == c.steps:
                where = self.save(step)
                self.show.note(f"step {step}: checkpoint {where}")
        self.show.stop()
        sample = self.generate() if c.model == "gpt" and c.sample_tokens else None
        if self.rank != 0:
            return None
        warm = step_times[1:] or step_times
        summary = {
            "config": asdict(c),
            "steps_run": len(step_times),
            "first_step": self.start + 1,
            "first_loss": first_loss,
            "last_loss": loss,
            "last_losses_mean": metrics.mean_loss(10),
            "last_losses_count": min(10, len(metrics.records())),
            **{k: v for k, v in (last_val or {}).items()},
            f"{self.task.unit}_per_s": items_per_step * len(warm) / sum(warm),
            "seconds": time.perf_counter() - started,
            "bubble": self.bubble,
            **memory,
            "sample": sample,
        }
        _write_json(self.out / "summary.json", summary)
        _plot_losses(metrics.records(), self.out / "loss.png", title=self.show.title)
        self.show.summary(summary, self.out)
        return summary

    def _sum_over_pipeline(self, value: float) -> float:
        total = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(total, group=self.pp_group)
        return float(total)

    def _mean_over_replicas(self, value: float) -> float:
        if self.dp_group is None:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total, group=self.dp_group)
        return float(total) / self.config.replicas

    # -- validation and sampling -------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Mean loss (and accuracy) on the fixed validation set, shared out over replicas."""
        c = self.config
        mine = torch.tensor_split(self.task.val_indices, c.replicas)[self.replica]
        batches = max(1, len(mine) // max(c.batch // c.replicas, c.chunks))
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, samples, correct
        self.pipe.eval()
        try:
            with torch.no_grad(), self.autocast():
                for part in torch.tensor_split(mine, batches):
                    x, y = self.task.val_set[part]
                    out = self.pipe(x)
                    if out is not None:
                        totals += torch.tensor(
                            [
                                float(self.task.loss(out, y)) * len(y),
                                len(y),
                                self.task.correct(out, y),
                            ],
                            dtype=torch.float64,
                        )
        finally:
            self.pipe.train()
        dist.all_reduce(totals)  # only the last stage's ranks contribute
        result = {"val_loss": float(totals[0] / totals[1])}
        if c.model == "resnet":
            result["val_accuracy"] = float(totals[2] / totals[1])
        return result

    def generate(self) -> str | None:
        """Text written by the model through the pipeline, one byte per pipelined forward.

        The M micro-batches carry M samples; the last stage picks each next byte and
        broadcasts it to the pipeline, whose first stage feeds it back in.
        """
        c = self.config
        if self.replica != 0:
            return None
        prompt = torch.tensor(list(c.prompt.encode()) or [10], dtype=torch.int64)
        tokens = prompt.repeat(c.chunks, 1)  # (M, T)
        generator = torch.Generator().manual_seed(hash_seed(c.seed, -1))
        self.pipe.eval()
        try:
            with torch.no_grad(), self.autocast():
                for _ in range(c.sample_tokens):
                    logits = self.pipe(tokens[:, -c.seq :])  # (M, T, 256) on the last stage
                    chosen = torch.zeros(c.chunks, 1, dtype=torch.int64)
                    if logits is not None:
                        probs = F.softmax(logits[:, -1, :].float() / c.temperature, dim=-1)
                        chosen = torch.multinomial(probs, 1, generator=generator)
                    dist.broadcast(chosen, src=self.last_global_rank, group=self.pp_group)
                    tokens = torch.cat([tokens, chosen], dim=1)
        finally:
            self.pipe.train()
        texts = [bytes(row.tolist()).decode("utf-8", "replace") for row in tokens]
        if self.rank == 0:
            (self.out / "sample.txt").write_text(
                "\n\n".join(f"--- sample {i} ---\n{t}" for i, t in enumerate(texts)) + "\n"
            )
        return texts[0]

    # -- measurements ----------------------------------------------------------------------

    def _memory(self, meter) -> dict[str, Any]:
        """Per pipeline rank: measured activation peak, weights + optimizer, process peak RSS."""
        local = {
            "stages": [s.index for s in self.pipe.stages],
            "activation_bytes": sum(meter.peak_bytes[s.index] for s in self.pipe.stages),
            "state_bytes": sum(
                t.numel() * t.element_size()
                for t in [*self.pipe.parameters(), *self.pipe.buffers()]
                + [
                    v
                    for s in (self.optimizer.state.values() if self.optimizer else [])
                    for v in s.values()
                    if isinstance(v, torch.Tensor)
                ]
            ),
            # ru_maxrss is in KiB on Linux
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        gathered: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, local, group=self.pp_group)
        return {"memory_per_rank": gathered}

    def _save_timeline(self) -> None:
        gathered: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, self.pipe.last_trace, group=self.pp_group)
        if self.rank != 0:
            return
        events = [e for trace in gathered for e in trace]
        start, end = min(e.start for e in events), max(e.end for e in events)
        busy = sum(e.end - e.start for e in events)
        self.bubble = 1 - busy / (self.config.stages * (end - start))
        self.show.bubble = self.bubble
        from gpipe import timeline

        timeline.save_chrome_trace(events, self.out / "timeline.json")
        with contextlib.suppress(ImportError):
            timeline.save_png(
                events,
                self.out / "timeline.png",
                title=f"{self.show.title}, step {self.config.steps} (measured)",
                time_unit="s",
            )

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Every rank's part of one checkpoint; rank 0 commits it (see gpipe.checkpoint)."""
        c = self.config
        root = self.out / "checkpoints"
        if self.rank == 0:
            ckpt.begin(root, step)
        dist.barrier()
        folder = ckpt.staging_folder(root, step)
        info = None
        if self.replica == 0:  # replicas hold equal weights: one writer per stage
            state = {k: v.detach().cpu() for k, v in self.pipe.state_dict().items()}
            shard = {
                "model": state,
                "optimizer": (
                    ckpt.optimizer_state_by_name(self.optimizer, self.names)
                    if self.optimizer
                    else None
                ),
                "rng": {"torch": torch.get_rng_state()},
                "stages": [s.index for s in self.pipe.stages],
            }
            ckpt.write_shard(folder, self.pp_rank, shard)
            info = (
                ckpt.shard_file(self.pp_rank),
                {"names": list(state), "stages": shard["stages"]},
            )
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, info)
        final = root / ckpt.step_folder(step)
        if self.rank == 0:
            manifest = {
                "step": step,
                "config": asdict(c),
                "model": self.spec,
                "data": self.sampler.state_dict(),
                "layout": {
                    "stages": c.stages,
                    "replicas": c.replicas,
                    "virtual_stages": c.virtual_stages,
                    "balance": self.balance,
                },
                "shards": dict(i for i in gathered if i is not None),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            final = ckpt.commit(root, folder, manifest, keep=c.keep)
        dist.barrier()
        return final

    def _load(self, path: str) -> None:
        manifest = ckpt.read_manifest(path)
        names = list(self.pipe.state_dict())
        self.pipe.load_state_dict(ckpt.load_tensors(manifest, names), strict=True)
        if self.optimizer is not None:
            params = list(self.names.values())
            state = ckpt.load_optimizer_state(manifest, params)
            ckpt.load_optimizer_state_by_name(self.optimizer, self.names, state)
        self.sampler.load_state_dict(manifest["data"])
        same_layout = manifest["layout"]["stages"] == self.config.stages
        own = Path(manifest["path"]) / ckpt.shard_file(self.pp_rank)
        if same_layout and own.is_file():
            rng = torch.load(own, weights_only=True, mmap=True).get("rng") or {}
            if "torch" in rng:
                torch.set_rng_state(rng["torch"].clone())
        self.start = int(manifest["step"])


@contextlib.contextmanager
def _meter(pipe):
    from gpipe.engine.memory import measure_activations

    with measure_activations(pipe) as meter:
        yield meter


# -- output: progress, metrics, plots ---------------------------------------------------------


class _Metrics:
    """``metrics.jsonl``: one JSON record per step. On resume it starts with the records up
    to the checkpoint's step (from ``history``, the resumed run's file, or this folder's own),
    so that the file and the loss curve cover the whole run."""

    def __init__(self, path: Path, start: int, *, history: Path | None, enabled: bool) -> None:
        self.path, self.enabled = path, enabled
        self._records: list[dict[str, Any]] = []
        if not enabled:
            return
        source = history if history is not None and history.exists() else path
        if source.exists():
            for line in source.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("step", 0) <= start:
                        self._records.append(record)
        if start == 0:
            self._records = []
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self._records))
        os.replace(tmp, path)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    def mean_loss(self, last: int) -> float:
        losses = [r["loss"] for r in self._records[-last:]]
        return sum(losses) / len(losses)


class _Reporter:
    """What rank 0 shows: a rich progress bar on a terminal, else one line every few steps."""

    def __init__(self, config: TrainConfig, enabled: bool) -> None:
        self.config, self.enabled = config, enabled
        self.bubble: float | None = None
        self.title = (
            f"{config.model} {config.size}, K={config.stages} M={config.chunks} "
            f"{config.schedule}"
            + (f" R={config.replicas}" if config.replicas > 1 else "")
            + (" bf16" if config.dtype == "bfloat16" else "")
        )
        self._bar = None
        mode = config.progress
        if enabled and mode != "lines":
            try:
                from rich.console import Console

                console = Console()
                if mode == "bar" or console.is_terminal:
                    self._console = console
                    self._bar = "wanted"
            except ImportError:
                pass

    def print(self, text: str = "") -> None:
        if not self.enabled:
            return
        if self._bar not in (None, "wanted"):
            self._bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    note = print

    def header(self, trainer: _Trainer, parameters: int) -> None:
        c = self.config
        resumed = f", resumed from step {trainer.start}" if trainer.start else ""
        self.print(
            f"gpipe train: {self.title}: {parameters:,} parameters in {num_layers(trainer.spec)} "
            f"layers, balance={trainer.balance}, batch {c.batch}"
            + (f" x {c.seq} tokens" if c.model == "gpt" else "")
            + f", {c.steps} steps, {c.world_size} processes{resumed}"
        )
        self.print(f"  data: {trainer.task.description}")
        self.print(f"  output: {c.out}")

    def start(self, start: int) -> None:
        self._t0, self._start = time.perf_counter(), start
        if self._bar == "wanted":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self._console,
            )
            self._task = self._bar.add_task(
                "train", total=self.config.steps, completed=start, loss="-", rate="-"
            )
            self._bar.start()

    def step(self, step: int, loss: float, rate: float, unit: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(
                self._task, completed=step, loss=f"{loss:.3f}", rate=f"{rate:,.0f} {unit}/s"
            )
            return
        c = self.config
        if step == self._start + 1 or step % c.log_every == 0 or step == c.steps:
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / (step - self._start) * (c.steps - step)
            print(
                f"step {step:5d}/{c.steps}  loss {loss:.4f}  {rate:,.0f} {unit}/s  "
                f"eta {_duration(eta)}",
                flush=True,
            )

    def stop(self) -> None:
        if self._bar not in (None, "wanted"):
            self._bar.stop()
        self._bar = None  # what follows is plain text

    def summary(self, s: dict[str, Any], out: Path) -> None:
        c = self.config
        unit = "tokens" if c.model == "gpt" else "images"
        lines = [
            "",
            f"done: {s['steps_run']} steps in {_duration(s['seconds'])}",
            f"  train loss   {s['first_loss']:.4f} (step {s['first_step']}) -> {s['last_loss']:.4f}"
            f" (step {c.steps}; mean of the last {s['last_losses_count']} steps "
            f"{s['last_losses_mean']:.4f})",
        ]
        if "val_loss" in s:
            acc = f", accuracy {s['val_accuracy']:.1%}" if "val_accuracy" in s else ""
            lines.append(f"  val loss     {s['val_loss']:.4f}{acc}")
        lines.append(f"  throughput   {s[f'{unit}_per_s']:,.0f} {unit}/s")
        if self.bubble is not None:
            from gpipe.schedule.simulate import simulate

            schedule = build_schedule(
                c.schedule,
                num_ranks=c.stages,
                num_microbatches=c.chunks,
                virtual_stages=c.virtual_stages,
            )
            ideal = simulate(schedule).bubble_fraction
            lines.append(
                f"  bubble       {self.bubble:.1%} measured on step {c.steps} ({c.schedule} "
                f"with equal action costs: {ideal:.1%})"
            )
        for r, m in enumerate(s.get("memory_per_rank", [])):
            lines.append(
                f"  rank {r} (stage {','.join(map(str, m['stages']))}): activations "
                f"{_mib(m['activation_bytes'])} measured, weights+optimizer "
                f"{_mib(m['state_bytes'])}, process peak {_mib(m['peak_rss_bytes'])}"
            )
        produced = [name for name in _OUTPUT_FILES if (out / name).exists()]
        lines.append(f"  files        {out}/: {', '.join(produced)}, checkpoints/")
        if s.get("sample"):
            lines.append(f"  sample ({c.sample_tokens} bytes after {c.prompt!r}):")
            lines += ["    | " + line for line in s["sample"].splitlines()]
        for line in lines:
            self.print(line)


_OUTPUT_FILES = (
    "metrics.jsonl",
    "loss.png",
    "timeline.png",
    "timeline.json",
    "sample.txt",
    "summary.json",
    "config.json",
)


def _format_val(step: int, val: dict[str, float]) -> str:
    acc = f"  accuracy {val['val_accuracy']:.1%}" if "val_accuracy" in val else ""
    return f"step {step}: val loss {val['val_loss']:.4f}{acc}"


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    os.replace(tmp, path)


def _plot_losses(records: list[dict[str, Any]], path: Path, *, title: str) -> bool:
    """Train loss per step (and its running mean) with validation points; False without
    matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    window = max(1, len(losses) // 30)
    if window > 1:
        ax.plot(steps, losses, color="#0072B2", alpha=0.3, linewidth=0.8, label="train (per step)")
    smooth = [
        sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
        for i in range(len(losses))
    ]
    label = f"train (mean of {window} steps)" if window > 1 else "train"
    ax.plot(steps, smooth, color="#0072B2", linewidth=1.6, label=label)
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", color="#E69F00", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(color="#dddddd", linewidth=0.6)
    ax.legend(frameon=False)
    fig.savefig(path, dpi=120, facecolor="white")
    return True
