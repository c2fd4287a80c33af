"""One rank's training: :class:`Trainer` builds its stage of the pipeline, its optimizer and
its data, then runs the loop of :meth:`Trainer.run`, which validates, saves checkpoints and
writes the metrics as it goes.

Resuming reproduces the uninterrupted run exactly (bitwise on CPU with the same K, M and
schedule): step t's dropout seed is a function of (seed, t), and the checkpoint holds the
weights, the optimizer state, the learning-rate scheduler's state and the data position.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

import gpipe.train.checkpoint as ckpt
import gpipe.train.generation as generation
import gpipe.train.lr_schedule as lr_schedule
import gpipe.train.optimizers as optimizers
import gpipe.train.outputs as outputs
import gpipe.train.reporters as reporters
import gpipe.train.run_folder as run_folder
import gpipe.train.timeline as timeline
from gpipe.base._utils import local_value
from gpipe.base.allocator import cpu_allocator
from gpipe.base.errors import NonFiniteError
from gpipe.base.files import write_file
from gpipe.engine.memory import measure_activations
from gpipe.layout import Layout
from gpipe.parallel.launch import threads_per_process
from gpipe.parallel.mesh import Mesh
from gpipe.parallel.sharded import sharded_optimizer_state
from gpipe.schedule.actions import Action, TimedAction
from gpipe.train.compiling import compile_stages, split_backward_note
from gpipe.train.config import TrainConfig, model_spec, num_layers
from gpipe.train.data import EpochSampler, hash_seed
from gpipe.train.evaluation import build_pipe, validate
from gpipe.train.freezing import freeze
from gpipe.train.optimizer_state import load_optimizer_state_by_name, optimizer_state_by_name
from gpipe.train.precision import autocast_of, load_scaler, optimizer_step, save_scaler, scaler_of
from gpipe.train.report import Metrics, Reporter, plot_losses, write_json

__all__ = ["Trainer"]


class Trainer:
    """Rank ``rank``'s part of the run ``config``, inside a process of the job's group.

    ``prepared`` is what the task prepared before the ranks started (see
    :meth:`gpipe.train.tasks.Task.prepare`), or None to let each rank load its data.
    """

    def __init__(self, rank: int, config: TrainConfig, prepared: Any = None) -> None:
        c = self.config = config
        self.rank, self.out, self.task = rank, Path(config.out), config.task
        threads = c.threads or threads_per_process(c.world_size)
        torch.set_num_threads(threads)
        cpu_allocator(c.cpu_allocator)
        self.mesh = Mesh.build(c.stages, c.replicas, timeout=c.timeout)
        self.autocast, self.scaler = autocast_of(c.dtype), scaler_of(c.dtype)
        self.replica = rank // c.stages
        self.spec = model_spec(c)
        self.layers = num_layers(self.spec)
        self.balance = c.balance or c.layout.default_balance(self.layers)
        self.pipe = build_pipe(c, self.mesh, self.balance)
        if c.compile:
            compile_stages(self.pipe.stages)
        self.names = {p: n for n, p in self.pipe.named_parameters()}
        self.optimizer = self._optimizer()
        self.scheduler = self._scheduler(c.steps)
        self.data = self.task.data(
            batch=c.batch, eval_batches=c.eval_batches, prepared=prepared, chunks=c.chunks
        )
        self.sampler = EpochSampler(len(self.data.train), seed=c.seed)
        self.start = 0
        self.best_loss = float("inf")  # --keep-best's, of this run's best/ (rank 0's file)
        if c.keep_best:
            mine = outputs.best_loss(self.out) if rank == 0 else None
            self.best_loss = self.mesh.everyone.broadcast_object(mine, "the best loss")
        if c.resume:
            self._load(c.resume)
        self.show = Reporter(c, rank == 0)
        self.step_times: list[float] = []
        self.skipped = 0  # steps refused for a non-finite loss or gradient
        self.signals = _Signals(self.mesh)
        self.measured: dict[str, Any] = {}  # of the traced step: bubble, memory per rank

    def _optimizer(self) -> torch.optim.Optimizer | None:
        c = self.config
        frozen = freeze(list(self.pipe.named_parameters()), c.freeze)
        if c.freeze and not self.mesh.sum_over_pipeline(len(frozen), "the frozen count"):
            raise ValueError(f"--freeze {c.freeze} matches no parameter's name; "
                             f"they read like {next(iter(self.names.values()))!r}")  # fmt: skip
        trained = [p for p in self.pipe.parameters() if p.requires_grad]
        return optimizers.build(trained, c)

    def _scheduler(self, steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
        c = self.config
        if self.optimizer is None:
            return None
        return lr_schedule.build(
            self.optimizer, kind=c.lr_schedule, lr=c.lr, warmup=c.warmup, steps=steps
        )

    # -- the loop --------------------------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        """Train from the start (or the resumed step) to ``config.steps``; rank 0 returns the
        summary, the other ranks None."""
        c = self.config
        parameters = self.mesh.sum_over_pipeline(
            sum(p.numel() for p in self.pipe.parameters()), "the parameter count (all-reduce)"
        )
        self.show.header(
            parameters=int(parameters), layers=self.layers, balance=self.balance,
            data=self.data.description, start=self.start,
        )  # fmt: skip
        if c.compile and (note := split_backward_note(self.pipe.schedule)):
            self.show.note(note)
        resumed = c.resume and run_folder.run_of(c.resume)  # its metrics, wherever it wrote them
        history = resumed / run_folder.METRICS if resumed else None
        metrics = Metrics(self.out / run_folder.METRICS, self.start, history=history,
                          enabled=self.rank == 0, layout=self.show.layout)  # fmt: skip
        self.sinks: list[reporters.Sink] = []
        if self.rank == 0:  # --report-to's destinations
            options = {k: v for k, v in asdict(c).items() if k != "model_args"}
            self.sinks = reporters.open_sinks(
                c.report_to, self.out, start=self.start, history=metrics.records(),
                options=options, note=self.show.note,
            )  # fmt: skip
            metrics.sinks += self.sinks
        try:
            return self._loop(metrics)
        finally:
            for sink in self.sinks:
                sink.close()  # flushed, also when a signal or a failure ends the run

    def _loop(self, metrics: Metrics) -> dict[str, Any] | None:
        c = self.config
        started = time.perf_counter()
        self.show.start(self.start)
        for step in range(self.start + 1, c.steps + 1):
            try:
                record = self.train_step(step, traced=step == c.steps)
            except NonFiniteError as error:  # refused on every rank: the weights are intact
                self.skipped += 1
                self.show.note(f"step {step} ({self.skipped} refused in all): {error}")
                if self.skipped > c.skip_nonfinite:
                    raise  # the newest checkpoint is the last good state (--skip-nonfinite)
                continue
            record["elapsed"] = time.perf_counter() - started
            self.show.step(step, record["loss"], record[f"{self.task.unit}_per_s"])
            best = False
            if _due(c.eval_every, step, c.steps):
                record.update(self.evaluate())
                self.show.validation(step, record)
                best = c.keep_best and record["val_loss"] < self.best_loss
            metrics.write(record)
            stop = self.signals.agreed(step)  # Ctrl-C or SIGTERM on any rank
            if _due(c.save_every, step, c.steps) or (stop and c.save_on_exit) or best:
                saved = self.save(step)
                self.show.note(f"step {step}: checkpoint {saved}")
                if best:
                    self._keep_best(saved, step, record["val_loss"])
            if stop:
                self.show.stop()
                self.show.note(f"stopped by a signal after step {step}")
                raise SystemExit(self.signals.exit_code)
        self.show.stop()
        sample = self.generate() if self.task.writes_text and c.sample_tokens else None
        if self.rank != 0:
            return None
        return self._summarize(metrics, sample, seconds=time.perf_counter() - started)

    def train_step(self, step: int, *, traced: bool = False) -> dict[str, Any]:
        """One optimizer step on mini-batch ``step``; ``traced``: measure its timeline and
        activation memory too. Returns the step's metrics record."""
        c = self.config
        lr = None
        if self.scheduler is not None:
            lr_schedule.advance(self.scheduler, step)
            lr = self.optimizer.param_groups[0]["lr"]
        # The whole mini-batch, then this replica's share: its samples (and their masks, for
        # a masked LM) are those of a run with any other number of replicas.
        share = c.batch // c.replicas
        rows = slice(self.replica * share, (self.replica + 1) * share)
        drawn = hash_seed(c.seed, step, -1)
        batch = self.task.batch(self.data.train, self.sampler.take(c.batch), seed=drawn)
        x, y = pytree.tree_map(lambda t: t[rows], batch)
        tick = time.perf_counter()
        with contextlib.ExitStack() as stack:
            meter = stack.enter_context(measure_activations(self.pipe)) if traced else None
            stack.enter_context(self.autocast())
            seed = hash_seed(c.seed, step, self.replica)
            loss = self.pipe.step(x, y, self.task.loss, count=self.task.count, seed=seed,
                                  trace=traced, scaler=self.scaler)  # fmt: skip
        stepped = optimizer_step(self.pipe, self.optimizer, self.scaler, c.grad_clip)
        loss = self.mesh.mean_over_replicas(
            float(loss), "the loss average over replicas", doing=f"step {step}"
        )
        seconds = time.perf_counter() - tick
        self.step_times.append(seconds)
        if traced:
            self.measured = {**self._memory(meter), "bubble": self._save_timeline()}
        return {
            "step": step,
            "loss": loss,
            "lr": lr,
            **stepped,  # grad_norm; with float16, scale and skipped
            "step_time": seconds,
            f"{self.task.unit}_per_s": c.batch * self.task.samples() / seconds,
        }

    def _summarize(self, metrics: Metrics, sample: str | None, seconds: float) -> dict[str, Any]:
        c = self.config
        records = metrics.records()[-len(self.step_times) :]
        warm = self.step_times[1:] or self.step_times
        validation = [r for r in records if "val_loss" in r]
        summary = {
            "config": asdict(c),
            "steps_run": len(self.step_times),
            "first_step": self.start + 1,
            "first_loss": records[0]["loss"],
            "last_loss": records[-1]["loss"],
            "last_losses_mean": metrics.mean_loss(10),
            "last_losses_count": min(10, len(metrics.records())),
            **{k: v for k, v in validation[-1].items() if k.startswith("val_")},
            f"{self.task.unit}_per_s": c.batch * self.task.samples() * len(warm) / sum(warm),
            "seconds": seconds,
            "bubble": None,
            "transport": self.pipe.transport,
            **self.measured,
            "sample": sample,
        }
        write_json(self.out / run_folder.SUMMARY, summary)
        plot_losses(metrics.records(), self.out / run_folder.LOSS_PLOT, name=self.show.name)
        for sink in self.sinks:
            sink.end(summary, self.out, step=c.steps)
        self.show.summary(summary, self.out)
        return summary

    # -- validation and sampling -------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Mean loss (and accuracy or perplexity) on the fixed validation set."""
        data = self.data
        result = validate(
            self.pipe, self.config, self.mesh, data.val, data.val_indices,
            replica=self.replica, autocast=self.autocast,
        )  # fmt: skip
        del result["val_targets"]
        return result

    def generate(self) -> str | None:
        """Text written by the model through the pipeline (gpipe.train.generation): the M
        micro-batches carry M samples. The window, not a key-value cache: a few tokens cost
        less than capturing the decode step (``gpipe generate`` uses the cache)."""
        c = self.config
        if self.replica != 0 and not c.shard:  # sharded: every replica holds part of a layer
            return None
        tokens = generation.generate(
            self.pipe, self.mesh, self.task, self.task.encode(c.prompt), rows=c.chunks,
            new_tokens=c.sample_tokens, window=c.seq, seed=hash_seed(c.seed, -1),
            sampling=generation.Sampling(temperature=c.temperature), autocast=self.autocast,
            cache=False,
        )  # fmt: skip
        texts = [self.task.decode(row.tolist()) for row in tokens]
        if self.rank == 0:
            text = "\n\n".join(f"--- sample {i} ---\n{t}" for i, t in enumerate(texts)) + "\n"
            write_file(self.out / run_folder.SAMPLE, lambda f: f.write(text.encode()))
        return texts[0] if self.replica == 0 else None

    # -- measurements ----------------------------------------------------------------------

    def _memory(self, meter: Any) -> dict[str, Any]:
        """Per rank: measured activation peak, weights + optimizer, process peak RSS."""
        optimizer_state = self.optimizer.state.values() if self.optimizer else []
        state = [*self.pipe.parameters(), *self.pipe.buffers()] + [
            v for s in optimizer_state for v in s.values() if isinstance(v, torch.Tensor)
        ]
        local = {
            "rank": self.rank,
            "replica": self.replica,
            "stages": [s.index for s in self.pipe.stages],
            "activation_bytes": sum(meter.peak_bytes[s.index] for s in self.pipe.stages),
            "state_bytes": sum(local_value(t).numel() * t.element_size() for t in state),
            # ru_maxrss is in KiB on Linux
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        # Every rank's, replicas' too: a sharded replica holds its own part of the weights.
        gathered = self.mesh.everyone.all_gather_object(local, "the memory report gather")
        return {"memory_per_rank": gathered}

    def _save_timeline(self) -> float | None:
        """Rank 0 saves the traced step's timeline; returns its measured bubble fraction."""
        # Plain values across processes: each action as its text, "F3@1"
        mine = [(e.rank, str(e.action), e.start, e.end) for e in self.pipe.last_trace]
        traces = self.mesh.pipeline.all_gather_object(mine, "the timeline gather")
        events = [TimedAction(r, Action.parse(a), s, e) for t in traces for r, a, s, e in t]
        if self.rank != 0:
            return None
        start, end = min(e.start for e in events), max(e.end for e in events)
        busy = sum(e.end - e.start for e in events)
        timeline.save_chrome_trace(events, self.out / run_folder.TIMELINE_TRACE)
        with contextlib.suppress(ImportError):
            timeline.save_png(
                events,
                self.out / run_folder.TIMELINE_PNG,
                title=f"{self.show.title}, step {self.config.steps} (measured)",
                time_unit="s",
            )
        return 1 - busy / (self.config.stages * (end - start))

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Every rank's part of one checkpoint, written with DCP; rank 0 commits it (see
        gpipe.train.checkpoint)."""
        c = self.config
        root = self.out / run_folder.CHECKPOINTS
        everyone, doing = self.mesh.everyone, f"saving the checkpoint of step {step}"
        if self.rank == 0:
            ckpt.begin(root, step)
        everyone.barrier("the checkpoint barrier before writing", doing=doing)
        folder = ckpt.staging_folder(root, step)
        # The random state is replica 0's, as each stage resumes it.
        optimizer = self.optimizer and optimizer_state_by_name(self.optimizer, self.names)
        rng = {self.mesh.pp_rank: torch.get_rng_state()} if self.replica == 0 else None
        ckpt.write(folder, model=self.pipe.state_dict(), optimizer=optimizer, rng=rng,
                   replica=self.replica)  # fmt: skip
        everyone.barrier("the checkpoint barrier after writing", doing=doing)
        final = root / run_folder.step_folder(step)
        if self.rank == 0:
            manifest = ckpt.Manifest(
                step=step, config=asdict(c), model=self.spec, data=self.sampler.state_dict(),
                layout={**c.layout.to_dict(), "balance": self.balance}, scheduler=save_scaler(
                    self.scheduler and lr_schedule.state(self.scheduler), self.scaler),
            )  # fmt: skip
            final = ckpt.commit(root, folder, manifest, keep=c.keep)
        everyone.barrier("the checkpoint barrier after the commit", doing=doing)
        return final

    def _keep_best(self, saved: Path, step: int, val_loss: float) -> None:
        self.best_loss = val_loss
        if self.rank == 0:
            best = outputs.keep_best(saved, self.out, step=step, val_loss=val_loss)
            self.show.note(f"step {step}: best validation loss so far, kept as {best}")

    def _load(self, path: str) -> None:
        manifest = ckpt.read_manifest(path)
        # the same ranks' random state
        same_cut = Layout.from_dict(manifest.layout).stages == self.config.stages
        loaded = ckpt.load(
            manifest, model=list(self.pipe.state_dict()),
            optimizer=self.optimizer and list(self.names.values()),
            rng=self.mesh.pp_rank if same_cut else None,
        )  # fmt: skip
        self.pipe.load_state_dict(loaded.model, strict=True)
        manifest.scheduler = load_scaler(manifest.scheduler, self.scaler)
        if self.optimizer is not None:
            state = sharded_optimizer_state(loaded.optimizer, {n: p for p, n in self.names.items()})
            load_optimizer_state_by_name(self.optimizer, self.names, state)
            self._load_schedule(manifest)
        self.sampler.load_state_dict(manifest.data)
        if loaded.rng is not None:
            torch.set_rng_state(loaded.rng)
        self.start = manifest.step

    def _load_schedule(self, manifest: ckpt.Manifest) -> None:
        """The scheduler as saved (with the optimizer's rates), its decay then made to end at
        this run's --steps, from the current rate on (see gpipe.train.lr_schedule)."""
        c, saved_steps = self.config, manifest.config["steps"]
        if manifest.scheduler is None:  # saved before schedulers, or by a rank without one
            for group in self.optimizer.param_groups:  # replayed from step 1 to its step
                group["lr"] = c.lr
                group.pop("initial_lr", None)
            self.scheduler = self._scheduler(saved_steps)
            lr_schedule.advance(self.scheduler, manifest.step)
        else:
            lr_schedule.load_state(self.scheduler, manifest.scheduler)
        if saved_steps != c.steps:
            lr_schedule.stretch(self.scheduler, warmup=c.warmup, steps=c.steps)


class _Signals:
    """SIGTERM or SIGINT asks every rank to stop after the step in flight, all at the same
    step (agreed each step by a one-number all-reduce) and after saving it; a second signal,
    later than a second after the first, stops this process at once."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.received = 0
        self._first = 0.0
        self._agreed = False
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Ctrl-C in a terminal reaches every process, and the launcher then sends SIGTERM:
        # that is one request, not a second one.
        if self.received and time.monotonic() - self._first > 1.0:
            os._exit(128 + signum)
        if not self.received:
            self.received, self._first = signum, time.monotonic()

    def agreed(self, step: int) -> bool:
        """Whether any rank was asked to stop (collective: every rank calls it each step)."""
        if not self._agreed:
            asked = self.mesh.everyone.all_reduce(
                torch.tensor([float(self.received)]), "the stop-signal agreement (all-reduce)",
                doing=f"after step {step}",
            )  # fmt: skip
            self._agreed = bool(asked.item())
        return self._agreed

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGTERM)


def _due(every: int, step: int, last: int) -> bool:
    """Whether a periodic task (``every`` steps, 0: only at the end) runs at ``step``."""
    return (every > 0 and step % every == 0) or step == last
