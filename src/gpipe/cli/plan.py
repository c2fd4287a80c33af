"""Recommend K, M, schedule and re-materialization for the model ``gpipe train`` trains with
the same ``--model``, ``--size``, ``--model-config``, ``--seq`` and ``--batch`` (any it
accepts: a built-in, a Hugging Face folder or ``config.json``), and a memory budget.

The model is profiled layer by layer on this machine (with the torch threads each pipeline
process gets: ``--threads``, as gpipe train's), every configuration is simulated with those
costs, and those that fit the budget are ranked by predicted throughput::

    gpipe plan --model gpt --model-config n_layers=8 --batch 32 --processes 2 --memory 2GiB
    gpipe plan --model resnet --processes 2 --calibrate --verify 3
    gpipe plan --model ./my-qwen --seq 256 --batch 8 --processes 4 --write-config run.toml

``--calibrate`` first measures what a profile cannot see, in ``--processes`` local processes
(``gpipe.planner.Machine``): the compute slowdown when K processes share the cores, the
link between two processes, and the runtime's time per action and per step.
``--verify N`` then trains the top N for a few steps on K local processes and prints the
measured throughput next to the prediction. From Python, ``gpipe.plan(model, sample, ...)``
takes any ``nn.Sequential``.

``--capacity`` asks another question: the largest model of the preset's family (the GPT by
its number of blocks, the ResNet by blocks per resolution) that trains within ``--memory``
per process on ``--processes`` processes, and the layout that achieves it (stages,
replicas, sharding, micro-batches, schedule, re-materialization, balance)::

    gpipe plan --capacity --model gpt --d-model 256 --seq 128 --vocab 2048 --batch 16 \\
        --memory 600MiB --processes 8 --optimizer adamw --verify 1

There ``--memory`` is what each process may hold at its peak, the *whole* process (Python,
torch and the process group: about 230 MiB on a CPU before any model), as ``top`` shows
it. It first measures what a training process holds before its model and needs beyond
the model's terms, in a few short runs (minutes; it prints the flags that give the same
numbers next time: ``--baseline-memory 230MiB --process-memory 95MiB --model-layer-memory
0.03MiB --stage-layer-memory 0.2MiB``); ``--verify N`` trains the N largest for real, and each one's
next size up, and prints measured peaks next to predicted ones (``docs/capacity.md``).
Measured and planned with the allocator policy ``return`` (``gpipe.base.allocator``), which a
run must use to fit what was measured: ``gpipe train --cpu-allocator return``.

The options are the fields of :class:`gpipe.cli.plan_config.PlanConfig`: those ``gpipe
train`` has too mean the same there; the ranges searched are ``--search-*`` (comma lists).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from gpipe.cli.plan_config import PlanConfig, optimizer_state, parse_bytes, resolve_plan
from gpipe.cli.train import add_config_options, config_of

__all__ = ["configure", "parse_bytes", "run"]

_MiB = 2**20


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_config_options(p, PlanConfig)


@contextlib.contextmanager
def _threads(config: PlanConfig, processes: int) -> Iterator[None]:
    """Profile with the torch threads each of ``processes`` gets (gpipe train's --threads:
    0 shares the cores), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(_thread_count(config, processes))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _thread_count(config: PlanConfig, processes: int) -> int:
    from gpipe.parallel.launch import threads_per_process

    return config.threads or threads_per_process(processes)


def family(config: PlanConfig):
    """The preset's family (by depth) for ``--capacity``."""
    from gpipe.planner.families import gpt_family, resnet_family

    batch = config.batch or 16  # gpipe train's default batch
    if config.model == "gpt":
        return gpt_family(d_model=config.d_model, heads=config.heads, seq=config.seq or 64,
                          vocab=config.vocab, batch=batch)  # fmt: skip
    if config.model == "resnet":
        return resnet_family(channels=config.channels, image=config.image, batch=batch)
    raise ValueError(
        f"--capacity searches a family by depth, gpt or resnet: --model {config.model} is not "
        "one; plan it without --capacity"
    )


def run_capacity(config: PlanConfig) -> int:
    from gpipe.planner import capacity, verify_capacity

    if config.memory is None:
        raise ValueError("--capacity needs --memory (bytes per process, e.g. 2GiB)")
    models = family(config)
    overhead = _calibration(config, models)
    shard = {"both": None, "on": ["all"], "off": [None]}[config.search_shard]
    start = time.perf_counter()
    with _threads(config, config.processes):
        result = capacity(
            models, memory_budget=config.memory, processes=config.processes,
            optimizer=optimizer_state(config), overhead=overhead,
            stages=config.search_stages, replicas=config.search_replicas, shard=shard,
            chunks=config.search_chunks, schedules=config.search_schedules,
            checkpoints=config.search_checkpoints,
            checkpoint_layers=config.search_checkpoint_layers,
        )  # fmt: skip
    print(f"gpipe plan --capacity: searched {len(result.rows)} layouts in "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    print(result.table(top=config.top))
    fitting = [row for row in result.rows if row.fits]
    for row in fitting[: config.verify]:
        print()
        check = verify_capacity(models, row, optimizer=optimizer_state(config), steps=2)
        print(check.describe())
    return 0 if fitting else 1


def _calibration(config: PlanConfig, models):
    """What a process needs beyond the model's terms: given, or measured (minutes; each run
    is printed as it goes) and printed as the flags that give it next time."""
    from gpipe.estimate.memory_model import Calibration
    from gpipe.planner import calibrate

    if config.process_memory is not None:
        baseline = config.baseline_memory
        if baseline is None:
            baseline = _resident_bytes()
            print(f"a process holds {baseline / _MiB:.1f} MiB before its model (this one, "
                  "after importing torch)")  # fmt: skip
        return Calibration(config.process_memory, config.model_layer_memory,
                           config.stage_layer_memory, baseline)  # fmt: skip
    print(f"calibrating on {config.processes} processes (2-4 short training runs, a few "
          "minutes; --process-memory and the flags printed after skip this)",
          flush=True)  # fmt: skip
    overhead = calibrate(models, processes=config.processes, optimizer=optimizer_state(config),
                         progress=lambda line: print(f"  {line}", flush=True))  # fmt: skip
    if config.baseline_memory is not None:
        overhead = replace(overhead, baseline=config.baseline_memory)
    print(f"calibrated: a training process needs {overhead} beyond the model's terms; next "
          f"time: --baseline-memory {overhead.baseline / _MiB:.1f}MiB --process-memory "
          f"{overhead.process / _MiB:.1f}MiB --model-layer-memory "
          f"{overhead.per_layer / _MiB:.4f}MiB --stage-layer-memory "
          f"{overhead.per_stage_layer / _MiB:.4f}MiB")  # fmt: skip
    return overhead


def _resident_bytes() -> float:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except OSError:
        return 0.0


def run(args: argparse.Namespace) -> int:
    config = resolve_plan(config_of(args, PlanConfig))
    if config.capacity:
        if config.write_config:
            raise ValueError(
                "--write-config writes a plan of the model gpipe train trains; --capacity's "
                "rows are members of a family: drop --write-config, or --capacity"
            )
        return run_capacity(config)
    if config.write_config:
        from gpipe.cli.plan_model import not_ours

        refusal = not_ours(config.write_config)
        if refusal:
            raise ValueError(refusal)
    return run_plan(config)


def run_plan(config: PlanConfig) -> int:
    """Plan the model ``gpipe train`` trains with the same model options."""
    from gpipe.cli.plan_model import trained_model, write_train_config
    from gpipe.planner import verify

    trained = trained_model(config)
    model, x, y = trained.model, trained.inputs, trained.targets
    batch = trained.options["batch"]
    too_many = [m for m in config.search_chunks or [] if m > batch]
    if too_many:
        raise ValueError(
            f"--search-chunks {','.join(map(str, too_many))}: a micro-batch holds at least one "
            f"sample of --batch {batch}; give at most {batch}"
        )
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    result = _search(config, trained)
    print(
        f"gpipe plan: {trained.what} ({len(model)} layers, {params:,} parameters); profiled "
        f"on {config.device}, {_thread_count(config, config.processes)} thread(s), "
        f"{len(result.profiles)} micro-batch sizes in {time.perf_counter() - start:.1f} s"
    )
    print(result.table(top=config.top))
    if config.verify:
        result.verified = verify(
            result, model, x, y, trained.loss_fn, top=config.verify, steps=config.verify_steps
        )
        print()
        print(result.verify_table())
    if config.write_config and result.candidates:
        write_train_config(config.write_config, trained, result.best,
                           budget=config.memory is not None)  # fmt: skip
        print(f"wrote the first choice to {config.write_config}: gpipe train --config "
              f"{config.write_config}")  # fmt: skip
    return 0 if result.candidates else 1


def _search(config: PlanConfig, trained):
    """Profile ``trained``'s model and rank every layout (:func:`gpipe.plan`)."""
    from gpipe.estimate.memory_model import MemoryModel
    from gpipe.planner import Link, plan

    timing = {}
    if not config.calibrate:
        link = Link(latency=config.latency, bandwidth=config.bandwidth)
        timing = {"link": Link.measure() if config.measure_link else link,
                  "overhead": config.action_seconds}  # fmt: skip
    with _threads(config, config.processes):
        return plan(
            trained.model, trained.inputs, devices=config.processes,
            memory_budget=config.memory, target=trained.targets, loss_fn=trained.loss_fn,
            device=config.device, repeats=config.profile_repeats,
            warmup=config.profile_warmup, stages=config.search_stages,
            chunks=config.search_chunks, schedules=config.search_schedules,
            checkpoints=config.search_checkpoints,
            virtual_stages=config.search_virtual_stages or (1, 2),
            memory=MemoryModel(optimizer_state=optimizer_state(config)),
            calibrate=config.calibrate, **timing,
        )  # fmt: skip
