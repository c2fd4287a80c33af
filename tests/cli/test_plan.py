"""``gpipe plan``: the ranked table, the capacity table (its budget the whole process, the
calibration it runs unless given), and byte sizes as the options take them."""

from __future__ import annotations

import pytest
import torch

from gpipe.__main__ import main
from gpipe.base._utils import MiB
from gpipe.cli.plan import parse_bytes
from gpipe.estimate.memory_model import Calibration


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1.5e9
    assert parse_bytes("1e9") == 1e9
    with pytest.raises(Exception, match="cannot read"):
        parse_bytes("lots")


def test_cli_prints_a_ranked_table(capsys):
    threads = torch.get_num_threads()
    code = main(
        [
            "plan",
            "--model",
            "gpt",
            "--model-config",
            "n_layers=1,d_model=16,n_heads=2",
            "--seq",
            "8",
            "--batch",
            "4",
            "--processes",
            "2",
            "--search-chunks",
            "1,2",
            "--profile-repeats",
            "1",
            "--profile-warmup",
            "0",
            "--top",
            "3",
            "--memory",
            "1GiB",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert torch.get_num_threads() == threads
    assert "gpipe plan: gpt (small, seq 8, batch 4) (3 layers" in out
    assert "budget 1,024 MiB per device" in out
    assert "samples/s" in out and "peak MiB per device" in out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 3


def test_cli_prints_the_capacity_table(in_process):
    done = in_process(
        "plan", "--capacity", "--model", "gpt", "--d-model", "16", "--heads", "2", "--seq", "8",
        "--vocab", "64", "--batch", "4", "--memory", "2MiB", "--processes", "2",
        "--search-chunks", "2",
        "--top", "4", "--baseline-memory", "0", "--process-memory", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "capacity of GPT d_model 16" in done.stdout
    assert "budget 2.0 MiB per process, 2 processes" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("K=")]
    assert len(rows) == 4 and rows[0].startswith("K=2")


def test_cli_budget_is_the_whole_process(in_process):
    # Without --baseline-memory the process's own memory counts: 2 MiB holds nothing, and
    # the answer names that fixed cost.
    done = in_process(
        "plan", "--capacity", "--model", "gpt", "--d-model", "16", "--heads", "2", "--seq", "8",
        "--vocab", "64", "--batch", "4", "--memory", "2MiB", "--processes", "2",
        "--search-chunks", "2",
        "--process-memory", "1MiB",
    )  # fmt: skip
    assert done.returncode == 1
    assert "MiB before its model" in done.stdout and "nothing fits 2.0 MiB" in done.stdout
    assert "fixed per process" in done.stdout


def test_cli_calibrates_unless_given_and_prints_the_flags(monkeypatch, in_process):
    # No depth without the fixed cost per process: it is measured, with progress, and
    # printed as the flags that give it next time.
    import gpipe.planner

    def fake(family, *, processes, optimizer, progress):
        progress("calibrating 1/2: K=1 M=4 gpipe always at depth 1 ...")
        return Calibration(3 * MiB, 0.25 * MiB, 0.5 * MiB, 7 * MiB)

    monkeypatch.setattr(gpipe.planner, "calibrate", fake)
    out = in_process(
        "plan", "--capacity", "--model", "gpt", "--d-model", "16", "--heads", "2", "--seq", "8",
        "--vocab", "64", "--batch", "4", "--memory", "64MiB", "--processes", "1",
        "--search-chunks", "2",
    ).stdout  # fmt: skip
    assert "calibrating 1/2" in out
    assert ("--baseline-memory 7.0MiB --process-memory 3.0MiB --model-layer-memory 0.2500MiB "
            "--stage-layer-memory 0.5000MiB") in out  # fmt: skip
