"""Recommend K, M, schedule and re-materialization for the model ``gpipe train`` trains with
the same ``--model``, ``--size``, ``--model-config``, ``--seq`` and ``--batch`` (any it
accepts: a built-in, a Hugging Face folder or ``config.json``), and a memory budget.

The model is profiled layer by layer on this machine (one thread by default, as each
pipeline process gets), every configuration is simulated with those costs, and those that
fit the budget are ranked by predicted throughput::

    gpipe plan --model gpt --model-config n_layers=8 --batch 32 --devices 2 --memory 2GiB
    gpipe plan --model resnet --devices 2 --calibrate --verify 3
    gpipe plan --model ./my-qwen --seq 256 --batch 8 --devices 4 --write-config run.toml

``--calibrate`` first measures what a profile cannot see, in ``--devices`` local processes
(``gpipe.planner.Machine``): the compute slowdown when K processes share the cores, the
link between two processes, and the runtime's time per action and per step.
``--verify N`` then trains the top N for a few steps on K local processes and prints the
measured throughput next to the prediction. From Python, ``gpipe.plan(model, sample, ...)``
takes any ``nn.Sequential``.

``--capacity`` asks another question: the largest model of the preset's family (the GPT by
its number of blocks, the ResNet by blocks per resolution) that trains within ``--memory``
per process on ``--processes`` processes, and the layout that achieves it (stages,
replicas, sharding, micro-batches, schedule, re-materialization, balance)::

    gpipe plan --capacity --model gpt --d-model 256 --seq 128 --vocab 2048 --batch 16 \
        --memory 600MiB --processes 8 --optimizer adamw --verify 1

There ``--memory`` is what each process may hold at its peak, the *whole* process (Python,
torch and the process group: about 230 MiB on a CPU before any model), as ``top`` shows
it. It first measures what a training process holds before its model and needs beyond
the model's terms, in a few short runs (minutes; it prints the flags that give the same
numbers next time: ``--baseline-memory 230MiB --process-memory 95MiB --model-layer-memory
0.03MiB --stage-layer-memory 0.2MiB``); ``--verify N`` trains the N largest for real, and each one's
next size up, and prints measured peaks next to predicted ones (``docs/capacity.md``).
Measured and planned with the allocator policy ``return`` (``gpipe.allocator``), which a
run must use to fit what was measured: ``gpipe train --cpu-allocator return``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from gpipe.remat import REMAT_MODES
from gpipe.schedule import SCHEDULES

__all__ = ["configure", "parse_bytes", "run"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "tb": 10**12,
}


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """Profile with ``count`` torch threads (as each pipeline process gets), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parse_bytes(text: str) -> float:
    """``"2GiB"`` -> 2147483648.0; also ``"500MB"``, ``"1.5gib"``, ``"1e9"`` (bytes)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a size; use e.g. 2GiB, 512MiB, 1.5GB or 1e9"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--model", default="gpt",
        help="the model gpipe train trains with the same --model, --size, --model-config, "
        "--seq and --batch: a built-in (gpt, resnet, hf-llama) or a Hugging Face folder or "
        "config.json; with --capacity: gpt or resnet, by the family's shape below",
    )  # fmt: skip
    p.add_argument("--size", default=None, help="as gpipe train's --size (default: its)")
    p.add_argument(
        "--model-config", default=None,
        help="as gpipe train's --model-config, e.g. n_layers=8,d_model=128",
    )  # fmt: skip
    p.add_argument("--devices", type=_positive, default=2, help="devices (processes) available")
    p.add_argument(
        "--memory", type=parse_bytes, default=None,
        help="with --capacity: each process's whole peak (Python, torch and the process group "
        "included; see --baseline-memory), e.g. 600MiB; otherwise: per device, for the "
        "model's terms alone (parameters, optimizer state, activations), e.g. 2GiB",
    )  # fmt: skip
    p.add_argument(
        "--batch", type=_positive, default=None,
        help="samples per mini-batch (default: gpipe train's preset; --capacity: 32)",
    )  # fmt: skip
    p.add_argument(
        "--seq", type=_positive, default=None,
        help="tokens per sample (default: gpipe train's preset; --capacity: 64)",
    )  # fmt: skip
    g = p.add_argument_group("--capacity's gpt family")
    g.add_argument("--d-model", type=_positive, default=128)
    g.add_argument("--heads", type=_positive, default=4)
    g.add_argument("--vocab", type=_positive, default=4096, help="a large vocabulary: heavy head")
    g = p.add_argument_group("--capacity's resnet family")
    g.add_argument("--channels", type=_positive, default=32, help="width at full resolution")
    g.add_argument("--image", type=_positive, default=32, help="image side in pixels")
    _search_options(p)
    g = p.add_argument_group("measuring")
    g.add_argument("--device", default="cpu", help="where to profile")
    g.add_argument("--threads", type=_positive, default=1, help="torch threads while profiling")
    g.add_argument("--repeats", type=_positive, default=5, help="timed runs per layer (median)")
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--top", type=_positive, default=10, help="rows to print")
    g.add_argument(
        "--write-config", metavar="FILE",
        help="write the first choice as options of gpipe train (TOML): gpipe train --config FILE",
    )  # fmt: skip
    g.add_argument("--verify", type=int, default=0, metavar="N", help="run the top N for real")
    g.add_argument("--steps", type=_positive, default=10, help="timed steps per verified run")
    g.add_argument("--seed", type=int, default=0)
    _capacity_options(p)


def _search_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search")
    g.add_argument("--chunks", type=_positive, nargs="+", help="micro-batch counts M to try")
    g.add_argument(
        "--schedules", nargs="+", choices=list(SCHEDULES), metavar="SCHEDULE",
        help=f"schedules to try: {', '.join(SCHEDULES)} (default: all but zb-auto)",
    )  # fmt: skip
    g.add_argument(
        "--checkpoints", nargs="+", choices=REMAT_MODES, metavar="MODE",
        help=f"checkpoint modes to try: {', '.join(REMAT_MODES)} (default: all)",
    )  # fmt: skip
    g.add_argument(
        "--checkpoint-layers", nargs="+", type=_layers_at_a_time, metavar="N|stage",
        help="--capacity: layers a re-materialized micro-batch recomputes at a time, or stage "
        "(all of it) (default: stage 1 2 4)",
    )  # fmt: skip
    g.add_argument("--virtual", type=_positive, nargs="+", default=[1, 2], help="virtual stages")
    g.add_argument("--optimizer-state", type=float, default=2.0, help="x parameter bytes")
    g.add_argument("--latency", type=float, default=100e-6, help="seconds per transfer")
    g.add_argument("--bandwidth", type=parse_bytes, default=2e9, help="bytes/s between devices")
    g.add_argument(
        "--measure-link",
        action="store_true",
        help="measure latency and bandwidth between two local processes instead",
    )
    g.add_argument(
        "--overhead", type=float, default=100e-6, help="seconds of runtime cost per action"
    )


def _capacity_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capacity: the largest model of the family that fits --memory")
    g.add_argument("--capacity", action="store_true", help="search depth x layout instead")
    g.add_argument("--processes", type=_positive, help="processes available (default: --devices)")
    g.add_argument("--optimizer", default="adamw", help="adamw (2 states), sgd-momentum, sgd")
    g.add_argument(
        "--stages", type=_positive, nargs="+", help="stage counts K to try (default: all)"
    )
    g.add_argument("--replicas", type=_positive, nargs="+", help="replica counts R to try")
    g.add_argument(
        "--shard", choices=["both", "yes", "no"], default="both", help="shard replicas' state"
    )
    # the four terms of gpipe.planner.calibrate's answer (Calibration), one flag each
    g.add_argument(
        "--baseline-memory", type=parse_bytes, default=None,
        help="what a training process holds before its model, part of --memory (default: "
        "calibrated; with --process-memory given: this process's, after importing torch)",
    )  # fmt: skip
    g.add_argument(
        "--process-memory", type=parse_bytes, default=None,
        help="the fixed cost of a training process beyond its baseline and the model's terms "
        "(calibrated's 'MiB per process'); given, nothing is calibrated",
    )  # fmt: skip
    g.add_argument(
        "--model-layer-memory", type=parse_bytes, default=0.0,
        help="per layer of the whole model, in every process (calibrated's 'per layer of the "
        "model'; with --process-memory)",
    )  # fmt: skip
    g.add_argument(
        "--stage-layer-memory", type=parse_bytes, default=0.0,
        help="per layer of a process's own stage (calibrated's 'per layer of its stage'; with "
        "--process-memory)",
    )  # fmt: skip
    g.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine first: the time per action and per step, the link and the "
        "compute slowdown of K processes at once (--capacity always calibrates its memory "
        "unless --process-memory is given)",
    )


def family(args: argparse.Namespace):
    """The preset's family (by depth) for ``--capacity``."""
    from gpipe.planner.families import gpt_family, resnet_family

    batch = args.batch or 32
    if args.model == "gpt":
        return gpt_family(d_model=args.d_model, heads=args.heads, seq=args.seq or 64,
                          vocab=args.vocab, batch=batch)  # fmt: skip
    if args.model == "resnet":
        return resnet_family(channels=args.channels, image=args.image, batch=batch)
    raise ValueError(
        f"--capacity searches a family by depth, gpt or resnet: --model {args.model} is not one; "
        "plan it without --capacity"
    )


def run_capacity(args: argparse.Namespace) -> int:
    from gpipe.planner import capacity, verify_capacity

    if args.memory is None:
        raise ValueError("--capacity needs --memory (bytes per process, e.g. 2GiB)")
    models = family(args)
    processes = args.processes or args.devices
    overhead = _calibration(args, models, processes)
    shard = {"both": None, "yes": ["all"], "no": [None]}[args.shard]
    start = time.perf_counter()
    with _threads(args.threads):
        result = capacity(
            models,
            memory_budget=args.memory,
            processes=processes,
            optimizer=args.optimizer,
            overhead=overhead,
            stages=args.stages,
            replicas=args.replicas,
            shard=shard,
            chunks=args.chunks,
            schedules=args.schedules,
            checkpoints=args.checkpoints,
            checkpoint_layers=args.checkpoint_layers,
        )
    print(f"gpipe plan --capacity: searched {len(result.rows)} layouts in "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    print(result.table(top=args.top))
    fitting = [row for row in result.rows if row.fits]
    for row in fitting[: args.verify]:
        print()
        print(verify_capacity(models, row, optimizer=args.optimizer, steps=2).describe())
    return 0 if fitting else 1


def _calibration(args: argparse.Namespace, models, processes: int):
    """What a process needs beyond the model's terms: given, or measured (minutes; each run
    is printed as it goes) and printed as the flags that give it next time."""
    from gpipe.estimate.memory_model import Calibration
    from gpipe.planner import calibrate

    if args.process_memory is not None:
        baseline = args.baseline_memory
        if baseline is None:
            baseline = _resident_bytes()
            print(f"a process holds {baseline / 2**20:.1f} MiB before its model (this one, "
                  "after importing torch)")  # fmt: skip
        return Calibration(args.process_memory, args.model_layer_memory,
                           args.stage_layer_memory, baseline)  # fmt: skip
    print(f"calibrating on {processes} processes (2-4 short training runs, a few minutes; "
          "--process-memory and the flags printed after skip this)", flush=True)  # fmt: skip
    overhead = calibrate(models, processes=processes, optimizer=args.optimizer,
                         progress=lambda line: print(f"  {line}", flush=True))  # fmt: skip
    if args.baseline_memory is not None:
        overhead = replace(overhead, baseline=args.baseline_memory)
    print(f"calibrated: a training process needs {overhead} beyond the model's terms; next "
          f"time: --baseline-memory {overhead.baseline / 2**20:.1f}MiB --process-memory "
          f"{overhead.process / 2**20:.1f}MiB --model-layer-memory "
          f"{overhead.per_layer / 2**20:.4f}MiB --stage-layer-memory "
          f"{overhead.per_stage_layer / 2**20:.4f}MiB")  # fmt: skip
    return overhead


def _resident_bytes() -> float:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:
        return 0.0


def _positive(text: str) -> int:
    if text.strip().isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")


def _layers_at_a_time(text: str) -> int | None:
    if text == "stage":
        return None
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: give a number of layers >= 1, or stage")


def run(args: argparse.Namespace) -> int:
    if args.capacity:
        if args.write_config:
            raise ValueError(
                "--write-config writes a plan of the model gpipe train trains; --capacity's "
                "rows are members of a family: drop --write-config, or --capacity"
            )
        return run_capacity(args)
    from gpipe.cli.plan_model import trained_model, write_train_config
    from gpipe.estimate.memory_model import MemoryModel
    from gpipe.planner import Link, plan, verify

    trained = trained_model(args)
    model, x, y, batch = trained.model, trained.inputs, trained.targets, trained.options["batch"]
    too_many = [m for m in args.chunks or [] if m > batch]
    if too_many:
        raise ValueError(
            f"--chunks {' '.join(map(str, too_many))}: a micro-batch holds at least one sample "
            f"of --batch {batch}; give at most {batch}"
        )
    link = Link(latency=args.latency, bandwidth=args.bandwidth)
    if args.measure_link and not args.calibrate:
        link = Link.measure()
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    with _threads(args.threads):
        result = plan(
            model,
            x,
            devices=args.devices,
            memory_budget=args.memory,
            target=y,
            loss_fn=trained.loss_fn,
            device=args.device,
            repeats=args.repeats,
            warmup=args.warmup,
            chunks=args.chunks,
            schedules=args.schedules,
            checkpoints=args.checkpoints,
            virtual_stages=args.virtual,
            memory=MemoryModel(optimizer_state=args.optimizer_state),
            calibrate=args.calibrate,
            **({} if args.calibrate else {"link": link, "overhead": args.overhead}),
        )
    print(
        f"gpipe plan: {trained.what} ({len(model)} layers, {params:,} parameters); profiled "
        f"on {args.device}, {args.threads} thread(s), {len(result.profiles)} micro-batch "
        f"sizes in {time.perf_counter() - start:.1f} s"
    )
    print(result.table(top=args.top))
    if args.verify:
        result.verified = verify(
            result, model, x, y, trained.loss_fn, top=args.verify, steps=args.steps
        )
        print()
        print(result.verify_table())
    if args.write_config and result.candidates:
        write_train_config(args.write_config, trained, result.best, budget=args.memory is not None)
        print(f"wrote the first choice to {args.write_config}: gpipe train --config "
              f"{args.write_config}")  # fmt: skip
    return 0 if result.candidates else 1
