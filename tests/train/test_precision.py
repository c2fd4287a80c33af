"""``gpipe train --dtype float16``: float16 autocast with a ``torch.amp.GradScaler`` across
the processes; each step's ``scale`` and whether it was ``skipped`` are in metrics.jsonl, and
a step whose gradients overflow is skipped with its scale halved (the trainer's step,
:func:`gpipe.train.precision.optimizer_step`, on a pipeline whose last stage overflows)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

import gpipe
import gpipe.train.checkpoint as ckpt
import user_scripts
from gpipe.train.precision import autocast_of, load_scaler, optimizer_step, scaler_of


def test_an_overflowing_step_is_skipped_and_its_scale_halved():
    model = user_scripts.scaler_model()
    pipe = gpipe.Pipe(model, balance=[3, 3], chunks=2)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler = scaler_of("float16")
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    records = []
    for step, (x, y) in enumerate(user_scripts.clip_batches(2)):
        model[3].armed = step == 0
        pipe.step(x.double(), y, F.cross_entropy, scaler=scaler)
        records.append(optimizer_step(pipe, optimizer, scaler, grad_clip=1.0))
        if step == 0:  # skipped: no weight moved
            assert all(torch.equal(p, before[n]) for n, p in pipe.named_parameters())
    assert records[0] == {"grad_norm": None, "scale": 65536.0, "skipped": True}
    assert records[1]["scale"] == 32768.0 and records[1]["skipped"] is False
    assert records[1]["grad_norm"] is not None


def test_float16_autocasts_on_cpu():
    with autocast_of("float16")():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16
    assert scaler_of("float32") is None


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_float16_run_in_2_processes_writes_its_scale(in_process, tmp_path):
    run = tmp_path / "run"
    done = in_process("train", "--size", "tiny", "--steps", "4", "--dtype", "float16",
                      "--stages", "2", "--eval-every", "0", "--sample-tokens", "0",
                      "--progress", "lines", "--report-to", "none", "--out", str(run))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "fp16" in done.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["scale"] for r in records] == [65536.0] * 4
    assert [r["skipped"] for r in records] == [False] * 4
    assert all(r["loss"] < 6 for r in records)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_float16_run_resumes_its_scaler(in_process, tmp_path):
    run = tmp_path / "run"
    options = ["--size", "tiny", "--dtype", "float16", "--eval-every", "0", "--save-every",
               "2", "--sample-tokens", "0", "--progress", "lines",
               "--report-to", "none"]  # fmt: skip
    done = in_process("train", *options, "--steps", "2", "--out", str(run))
    assert done.returncode == 0, done.stderr
    saved = ckpt.read_manifest(ckpt.find(run)).scheduler["grad_scaler"]
    assert (saved["scale"], saved["_growth_tracker"]) == (65536.0, 2)
    done = in_process("train", "--resume", str(run), "--steps", "4")
    assert done.returncode == 0, done.stderr
    resumed = ckpt.read_manifest(ckpt.find(run)).scheduler["grad_scaler"]
    assert resumed["_growth_tracker"] == 4  # counted on from the checkpoint's 2
    scaler = scaler_of("float16")
    assert load_scaler({"last_epoch": 4, "grad_scaler": resumed}, scaler) == {"last_epoch": 4}
    assert scaler.state_dict()["_growth_tracker"] == 4
    assert load_scaler({"grad_scaler": resumed}, None) is None
