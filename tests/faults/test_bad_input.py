"""Bad input is a clear error naming the value and the remedy, before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import gpipe
from gpipe.__main__ import main
from gpipe.models import mlp
from train_runs import SRC


@pytest.mark.parametrize("timeout", [float("inf"), -1, 0, "10"])
def test_a_timeout_must_be_a_finite_number_of_seconds(timeout):
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        gpipe.Pipe(mlp([4, 4]), balance=[1, 1], chunks=2, timeout=timeout)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "tiny", "--stages", "5"], "--stages 5 needs at least 5 layers"),
        (["--chunks", "0"], "--chunks must be a positive int (micro-batches), got 0"),
        (["--batch", "6", "--replicas", "4"], "--batch 6 must be divisible by --replicas 4"),
        (["--batch", "4", "--chunks", "8"], "at least --chunks 8 samples"),
        (["--schedule", "interleaved-1f1b", "--chunks", "3"], "--schedule interleaved-1f1b"),
        (["--balance", "3,x"], "--balance must be comma-separated ints"),
        (
            ["--size", "tiny", "--balance", "1,1"],
            "--balance 1,1 sums to 2 layers, but the model has 4; e.g. --balance 2,2",
        ),
        (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: /nonexistent/run does not"),
        (["--model", "resnet", "--seq", "8"], "--seq applies to language models, not --model"),
        (
            ["--model", "vit"],
            "--model vit: not a built-in model (gpt, resnet, hf-llama), nor a folder or a "
            "config.json of a Hugging Face model",
        ),
        (["--model", "gpt", "--data", "/nonexistent.txt"], "--data /nonexistent.txt: no such"),
        (["--model", "gpt", "--init", "pretrained"], "--init pretrained: --model gpt starts from"),
        (["--model-config", "depth=3"], "--model-config depth: not a field of --model gpt"),
        (
            ["--checkpoint", "never", "--checkpoint-layers", "1"],
            "--checkpoint-layers 1 says how a re-materialized micro-batch is recomputed, but "
            "--checkpoint never re-materializes none",
        ),
        (["--checkpoint-layers", "0"], "--checkpoint-layers must be a positive int"),
        (["--timeout", "inf"], "--timeout must be positive (finite)"),
        (["--timeout", "-1"], "--timeout must be positive (finite)"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys, tmp_path):
    assert main(["train", *argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpipe train: error:") and message in err
    assert not (tmp_path / "x").exists()  # nothing was started


def test_problems_are_reported_together(capsys):
    assert main(["train", "--size", "tiny", "--stages", "9", "--chunks", "0", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "--chunks must be a positive int" in err and "--steps must be >= 1" in err


def test_an_unknown_schedule_is_rejected_by_the_parser(capsys):
    for argv in (["--schedule", "fifo"], ["--packing", "tight"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", *argv])
        assert exit_info.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


def test_an_output_that_cannot_hold_a_run_is_a_clear_error(tmp_path, capsys):
    a_file = tmp_path / "weights.pt"
    a_file.write_text("x")
    assert main(["train", "--size", "tiny", "--out", str(a_file)]) == 2
    assert f"--out {a_file} is a file" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # root may write anywhere
            assert main(["train", "--size", "tiny", "--out", str(locked / "run")]) == 2
            assert "is not writable" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_an_output_on_a_read_only_file_system_is_a_clear_error(capsys):
    # os.access says yes to root even there: the check must try
    assert main(["train", "--size", "tiny", "--out", "/proc/gpipe-run"]) == 2
    assert "--out /proc/gpipe-run: /proc is not writable" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not a rank of WORLD_SIZE=2 (ranks 0 to 1)"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a whole number"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not"),
    ],
)
def test_a_wrong_torchrun_environment_is_named_before_anything_waits(
    monkeypatch, capsys, variables, message
):
    """Set by hand, RANK/WORLD_SIZE/MASTER_* once gave torch's store errors after its timeout."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for name, value in variables.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert main(["train", "--size", "tiny", "--timeout", "600"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"gpipe train: error: {message}"), error
    assert "torchrun" in error and "unset RANK and WORLD_SIZE" in error  # the remedies
    assert len(error.strip().splitlines()) == 1


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_process_waiting_for_peers_that_never_come_names_them_within_the_timeout(cache, tmp_path):
    """RANK=0 WORLD_SIZE=3 alone: told at once that it waits, then which ranks did not come,
    once --timeout has passed (not torch's store error)."""
    import time

    from gpipe.parallel.launch import free_port

    env = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)}
    env.update(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    timeout = 5.0
    text = tmp_path / "text.txt"  # small: read before it waits
    text.write_text("a few lines to train on\n" * 400)
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gpipe", "train", "--size", "tiny", "--stages", "3",
         "--data", str(text), "--timeout", str(timeout), "--out", str(tmp_path / "alone")],
        env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    seconds = time.monotonic() - began
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("gpipe: rank 0 of WORLD_SIZE=3 waits for the other processes")
    assert lines[-1].startswith(
        "gpipe train: error: rank 0: 1 of WORLD_SIZE=3 processes joined at MASTER_ADDR=127.0.0.1"
    ), lines
    assert "within 5 s; ranks 1, 2 did not come: start them with the same MASTER_ADDR" in lines[-1]
    assert len(lines) == 2, lines
    assert timeout <= seconds <= 4 * timeout + 20  # start-up, then the timeout: no store error


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--search-chunks", "0"], "gpipe plan: error: --search-chunks 0: give whole "
         "numbers >= 1, comma-separated, e.g. 1,2,4"),
        (["plan", "--search-schedules", "gpipe,fifo"], "gpipe plan: error: --search-schedules "
         "gpipe,fifo: 'fifo' is not one of gpipe, 1f1b,"),
        (["plan", "--search-checkpoints", "sometimes"], "gpipe plan: error: --search-checkpoints "
         "sometimes: 'sometimes' is not one of always,"),
        (["plan", "--batch", "8", "--search-chunks", "4,16"], "gpipe plan: error: "
         "--search-chunks 16: a micro-batch holds at least one sample of --batch 8; give at "
         "most 8"),
        (["plan", "--memory", "lots"], "gpipe plan: error: --memory lots: cannot read 'lots' as "
         "a size"),
        (["plan", "--optimizer", "adagrad"], "gpipe plan: error: argument --optimizer: invalid "
         "choice: 'adagrad'"),
        (["plan", "--capacity"], "gpipe plan: error: --capacity needs --memory"),
        (["checkpoints", "/nonexistent"], "gpipe checkpoints: error: no checkpoint in "
         "/nonexistent"),
        (["export", "/nonexistent"], "gpipe export: error: /nonexistent does not exist"),
        (["train", "--chunks", "0"], "gpipe train: error: --chunks must be a positive int"),
        (["train", "--schedule", "fifo"], "gpipe train: error: argument --schedule: invalid "
         "choice: 'fifo'"),
        (["nothing"], "gpipe: error: argument COMMAND: invalid choice: 'nothing'"),
    ],
)  # fmt: skip
def test_every_command_says_bad_input_in_one_line(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's own refusals
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err
