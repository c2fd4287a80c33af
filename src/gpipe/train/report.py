"""What the main job shows and leaves behind: progress on rank 0, ``metrics.jsonl`` (whose
records also go to ``--report-to``'s destinations, ``gpipe.train.reporters``), the loss plot,
the summary. Nothing here touches the model or the other ranks."""

from __future__ import annotations

import contextlib
import json
import textwrap
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from gpipe.base._utils import MiB
from gpipe.base.files import write_file
from gpipe.schedule.simulate import simulate
from gpipe.train.config import TrainConfig
from gpipe.train.run_folder import FILES, TENSORBOARD

__all__ = [
    "Metrics",
    "Reporter",
    "layout_of",
    "loss_title",
    "plot_losses",
    "write_json",
]


class Metrics:
    """``metrics.jsonl``: one JSON record per step, each also handed to ``sinks`` (the
    destinations of ``--report-to``). On resume it starts with the records up to the
    checkpoint's step (from ``history``, the resumed run's file, or this folder's own), so that
    the file and the loss curve cover the whole run. Each record names the ``layout`` that
    trained its step."""

    def __init__(
        self,
        path: Path,
        start: int,
        *,
        history: Path | None,
        enabled: bool,
        layout: str = "",
        sinks: Iterable[Callable[[dict[str, Any]], Any]] = (),
    ) -> None:
        self.path, self.enabled, self.layout = path, enabled, layout
        self.sinks = list(sinks)
        self._records: list[dict[str, Any]] = []
        if not enabled:
            return
        source = history if history is not None and history.exists() else path
        if start > 0 and source.exists():
            for line in source.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("step", 0) <= start:
                        self._records.append(record)
        text = "".join(json.dumps(r) + "\n" for r in self._records)
        write_file(path, lambda f: f.write(text.encode()))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {**record, "layout": self.layout} if self.layout else dict(record)
        self._records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink(dict(record))  # a copy: a destination may change what it is given

    def records(self) -> list[dict[str, Any]]:
        return list(self._records)

    def mean_loss(self, last: int) -> float:
        losses = [r["loss"] for r in self._records[-last:]]
        return sum(losses) / len(losses)


class Reporter:
    """What rank 0 shows: a rich progress bar on a terminal, else one line every few steps."""

    def __init__(self, config: TrainConfig, enabled: bool) -> None:
        self.config, self.enabled = config, enabled
        self.unit = config.task.unit
        self.name = f"{config.model_name} {config.size}"
        self.layout = layout_of(config)
        self.title = f"{self.name}, {self.layout}"
        self._bar: Any = None
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

    def header(
        self, *, parameters: int, layers: int, balance: list[int], data: str, start: int
    ) -> None:
        c = self.config
        per_sample = c.task.samples()
        resumed = f", resumed from step {start}" if start else ""
        self.print(
            f"gpipe train: {self.title}: {parameters:,} parameters in {layers} layers, "
            f"balance={balance}, batch {c.batch}"
            + (f" x {per_sample} {self.unit}" if per_sample > 1 else "")
            + f", {c.steps} steps, {c.world_size} processes{resumed}"
        )
        self.print(f"  data: {data}")
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

    def step(self, step: int, loss: float, rate: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(
                self._task, completed=step, loss=f"{loss:.3f}", rate=f"{rate:,.0f} {self.unit}/s"
            )
            return
        c = self.config
        if step == self._start + 1 or step % c.log_every == 0 or step == c.steps:
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / (step - self._start) * (c.steps - step)
            print(
                f"step {step:5d}/{c.steps}  loss {loss:.4f}  {rate:,.0f} {self.unit}/s  "
                f"eta {_duration(eta)}",
                flush=True,
            )

    def validation(self, step: int, val: dict[str, float]) -> None:
        acc = f"  accuracy {val['val_accuracy']:.1%}" if "val_accuracy" in val else ""
        self.note(f"step {step}: val loss {val['val_loss']:.4f}{acc}")

    def stop(self) -> None:
        if self._bar not in (None, "wanted"):
            self._bar.stop()
        self._bar = None  # what follows is plain text

    def summary(self, s: dict[str, Any], out: Path) -> None:
        c, unit = self.config, self.unit
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
        if s.get("bubble") is not None:
            ideal = simulate(c.layout.build_schedule()).bubble_fraction
            lines.append(
                f"  bubble       {s['bubble']:.1%} measured on step {c.steps} ({c.schedule} "
                f"with equal action costs: {ideal:.1%})"
            )
        for r, m in enumerate(s.get("memory_per_rank", [])):
            replica = f", replica {m['replica']}" if c.replicas > 1 else ""
            lines.append(
                f"  rank {m.get('rank', r)} (stage {','.join(map(str, m['stages']))}{replica}): "
                "activations "
                f"{_mib(m['activation_bytes'])} measured, weights+optimizer "
                f"{_mib(m['state_bytes'])}, process peak {_mib(m['peak_rss_bytes'])}"
            )
        produced = [name for name in FILES if (out / name).exists()]
        if any(out.glob(f"{TENSORBOARD}*")):
            produced.append(f"TensorBoard's {TENSORBOARD}*")
        lines.append(f"  files        {out}/: {', '.join(produced)}, checkpoints/")
        if s.get("sample"):
            lines.append(f"  sample ({c.sample_tokens} tokens after {c.prompt!r}):")
            lines += ["    | " + line for line in s["sample"].splitlines()]
        for line in lines:
            self.print(line)


def layout_of(config: TrainConfig) -> str:
    """How a run's steps were computed, in short: ``K=2 M=4 1f1b R=2 sharded bf16 compiled``."""
    return (
        f"K={config.stages} M={config.chunks} {config.schedule}"
        + (f" R={config.replicas}" if config.replicas > 1 else "")
        + (" sharded" if config.shard else "")
        + {"bfloat16": " bf16", "float16": " fp16"}.get(config.dtype, "")
        + (" compiled" if config.compile else "")
    )


def _segments(records: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    """(layout, first step, last step) of each run of steps trained under one layout; a
    record written before records named their layout reads as "?"."""
    segments: list[tuple[str, int, int]] = []
    for r in records:
        layout = r.get("layout", "?")
        if segments and segments[-1][0] == layout:
            segments[-1] = (layout, segments[-1][1], r["step"])
        else:
            segments.append((layout, r["step"], r["step"]))
    return segments


def loss_title(name: str, records: list[dict[str, Any]]) -> str:
    """The loss plot's title: the model and every layout that trained it (a run resumed at
    another K or schedule shows each, with its steps)."""
    segments = _segments(records)
    if len(segments) <= 1:
        return f"{name}, {segments[0][0] if segments else ''}".rstrip(", ")
    return f"{name}: " + "; ".join(f"{lay} (steps {a}-{b})" for lay, a, b in segments)


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _mib(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` whole or not at all (a crash never leaves half a file)."""
    write_file(path, lambda f: f.write(json.dumps(value, indent=1, default=str).encode()))


def plot_losses(records: list[dict[str, Any]], path: Path, *, name: str) -> bool:
    """Train loss per step (and its running mean) with validation points, titled by ``name``
    (the model) and the layouts that trained it, each change of layout a dashed line; False
    without matplotlib."""
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
    for _, first, _ in _segments(records)[1:]:  # where a resumed run changed the layout
        ax.axvline(first - 0.5, color="#888888", linestyle="--", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    title = loss_title(name, records)
    ax.set_title(textwrap.fill(title, 90), loc="left", fontsize=10)
    ax.grid(color="#dddddd", linewidth=0.6)
    ax.legend(frameon=False)
    write_file(path, lambda f: fig.savefig(f, format="png", dpi=120, facecolor="white"))
    return True
