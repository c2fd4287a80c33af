"""``gpipe train`` and ``gpipe export`` end to end, with K processes spawned by the command.

One tiny run (K=2) is shared by the tests of this module: its files, its progress output,
resuming from its middle checkpoint, and loading its last checkpoint at K=1 and K=4.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpipe
from gpipe import checkpoint as ckpt
from gpipe.__main__ import main
from gpipe.cli import train as train_cli
from gpipe.cli.export import export
from gpipe.train import TrainConfig, Trainer, build_model, resolve
from gpipe.train.job import root_cause

SRC = Path(__file__).parents[2] / "src"
TINY = ["--size", "tiny", "--steps", "10", "--save-every", "5", "--eval-every", "5"]


def gpipe_command(*args: str, cache: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)  # not under torchrun: the command spawns its processes
    return subprocess.run(
        [sys.executable, "-m", "gpipe", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, cache) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("runs") / "a"
    done = gpipe_command("train", *TINY, "--sample-tokens", "12", "--out", str(out), cache=cache)
    assert done.returncode == 0, done.stderr
    return out, done


@pytest.mark.timeout(200)
def test_a_tiny_run_trains_and_leaves_its_files(tiny_run):
    out, done = tiny_run
    files = {p.name for p in out.iterdir()}
    expected = {"config.json", "metrics.jsonl", "summary.json", "loss.png", "sample.txt"}
    assert expected | {"timeline.png", "timeline.json", "checkpoints"} <= files
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "step-000005",
        "step-000010",
    ]
    manifest = ckpt.read_manifest(out)
    assert manifest["step"] == 10 and sorted(manifest["shards"]) == ["shard-000.pt", "shard-001.pt"]

    loss = losses(out)
    assert list(loss) == list(range(1, 11))
    assert all(torch.isfinite(torch.tensor(v)) for v in loss.values())
    assert loss[1] > 5.0 and sum(loss[s] for s in (8, 9, 10)) / 3 < loss[1] - 0.5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] < 5.0 and summary["tokens_per_s"] > 0
    assert 0 <= summary["bubble"] < 1 and len(summary["memory_per_rank"]) == 2
    assert summary["sample"].startswith("def ")

    # What the user sees: rank 0's progress lines, validation, the summary; nothing twice.
    stdout = done.stdout
    assert stdout.count("gpipe train: gpt tiny, K=2 M=4") == 1
    assert "step     1/10  loss" in stdout and "step    10/10" in stdout and "tokens/s" in stdout
    assert "eta" in stdout and "step 5: val loss" in stdout
    assert "train loss" in stdout and "bubble" in stdout and "rank 1 (stage 1)" in stdout
    assert stdout.count("done: 10 steps") == 1


@pytest.fixture
def in_process(cache, monkeypatch, capfd):
    """``gpipe ...`` run by this process (its spawned ranks print to the captured fds)."""
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(cache))

    def command(*args: str) -> subprocess.CompletedProcess:
        code = main(list(args))
        captured = capfd.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    return command


@pytest.mark.timeout(200)
def test_resuming_reproduces_the_uninterrupted_run_bitwise(tiny_run, in_process, tmp_path):
    out, _ = tiny_run
    resumed = tmp_path / "b"
    middle = out / "checkpoints" / "step-000005"
    done = in_process(
        "train", "--resume", str(middle), "--out", str(resumed), "--sample-tokens", "0",
        "--progress", "bar",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resumed from step 5" in done.stdout
    assert "train ━" in done.stdout and "10/10 loss" in done.stdout  # rich's bar, at its end
    before, after = losses(out), losses(resumed)
    assert list(after) == list(range(1, 11))  # steps 1-5 carried over from the first run
    # Same K, M and schedule on CPU: the same floating-point operations in the same order.
    assert [after[s] for s in range(6, 11)] == [before[s] for s in range(6, 11)]


def _outputs_at(rank: int, config: TrainConfig, x: torch.Tensor):
    """In each of K launched processes: load the checkpoint as ``gpipe train`` does, run x."""
    trainer = Trainer(rank, config)
    trainer.pipe.eval()
    with torch.no_grad():
        out = trainer.pipe(x)
    optimizer = ckpt.optimizer_state_by_name(trainer.optimizer, trainer.names)
    return out, optimizer["state"], trainer.sampler.state_dict()


@pytest.mark.timeout(200)
def test_a_k2_checkpoint_loads_at_k1_and_k4_and_exports_to_the_plain_model(
    tiny_run, cache, tmp_path, monkeypatch
):
    out, _ = tiny_run
    manifest = ckpt.read_manifest(out)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))

    # Export: one plain state dict for the un-split model.
    exported = export(out, tmp_path / "model.pt")
    plain = build_model(manifest["model"])
    plain.load_state_dict(torch.load(exported, weights_only=True), strict=True)
    plain.eval()
    with torch.no_grad():
        expected = plain(x)

    # K=1: one process holding every layer, loaded shard by shard by name.
    one = gpipe.Pipe(build_model(manifest["model"]), balance=[4], chunks=4)
    one.load_state_dict(ckpt.load_tensors(manifest, list(one.state_dict())), strict=True)
    one.eval()
    with torch.no_grad():
        torch.testing.assert_close(one(x), expected, rtol=1e-6, atol=1e-6)

    # K=4: four processes, each reading only the shard that holds its layer.
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(cache))
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    args = parser.parse_args(["--resume", str(out), "--stages", "4", "--out", str(tmp_path)])
    args.steps = 11  # one more than the checkpoint's, so that the configuration is valid
    config = resolve(vars(args))
    assert (config.stages, config.model_args) == (4, manifest["config"]["model_args"])
    results = gpipe.launch(_outputs_at, nprocs=4, args=(config, x), timeout=60)
    torch.testing.assert_close(results[3][0], expected, rtol=1e-6, atol=1e-6)
    assert all(r[0] is None for r in results[:3])  # outputs only on the last stage's rank
    assert all(r[2] == manifest["data"] for r in results)  # the data position

    # The optimizer state of every parameter, by name, is the saved one.
    saved = {}
    for file in manifest["shards"]:
        saved.update(
            torch.load(Path(manifest["path"]) / file, weights_only=True)["optimizer"]["state"]
        )
    loaded = {name: state for r in results for name, state in r[1].items()}
    assert set(loaded) == set(saved) == {n for n, _ in plain.named_parameters()}
    for name, state in saved.items():
        for key, value in state.items():
            assert torch.equal(loaded[name][key], value), (name, key)


@pytest.mark.timeout(200)
def test_resnet_with_replicas_and_bfloat16(in_process, tmp_path):
    """The CNN preset (deferred batch norm) as 2 replicas x 2 stages under bf16 autocast."""
    pytest.importorskip("sklearn")
    out = tmp_path / "r"
    done = in_process(
        "train", "--model", "resnet", "--size", "tiny", "--steps", "4", "--replicas", "2",
        "--dtype", "bfloat16", "--schedule", "1f1b", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resnet tiny, K=2 M=4 1f1b R=2 bf16" in done.stdout and "images/s" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert all(torch.isfinite(torch.tensor(v)) for v in losses(out).values())
    assert 0 <= summary["val_accuracy"] <= 1
    state = ckpt.export_state_dict(out)
    assert any("running_mean" in name for name in state)  # batch norm statistics are saved
    plain = build_model(ckpt.read_manifest(out)["model"])
    plain.load_state_dict(state, strict=True)


def test_a_hugging_face_llama_trains_as_it_is_and_exports_to_the_plain_model(in_process, tmp_path):
    """--model hf-llama: the Hugging Face model captured and cut (gpipe.frontend), 2 processes,
    checkpoints under the model's own names, text sampled through the pipeline."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "h"
    done = in_process(
        "train", "--model", "hf-llama", "--size", "tiny", "--steps", "6", "--save-every", "3",
        "--eval-every", "3", "--sample-tokens", "4", "--schedule", "1f1b", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "hf-llama tiny, K=2 M=4 1f1b" in done.stdout
    assert all(torch.isfinite(torch.tensor(v)) for v in losses(out).values())
    assert (out / "sample.txt").exists()
    state = ckpt.export_state_dict(out)
    assert "model.layers.0.self_attn.q_proj.weight" in state
    plain = build_model(ckpt.read_manifest(out)["model"])
    assert isinstance(plain, transformers.LlamaForCausalLM)
    plain.load_state_dict(state, strict=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "tiny", "--stages", "5"], "--stages 5 needs at least 5 layers"),
        (["--chunks", "0"], "--chunks must be >= 1, got 0"),
        (["--batch", "6", "--replicas", "4"], "--batch 6 must be divisible by --replicas 4"),
        (["--batch", "4", "--chunks", "8"], "at least --chunks 8 samples"),
        (["--schedule", "interleaved-1f1b", "--chunks", "3"], "--schedule interleaved-1f1b"),
        (["--balance", "3,x"], "--balance must be comma-separated ints"),
        (
            ["--size", "tiny", "--balance", "1,1"],
            "must have 2 entries (one per stage) summing to 4",
        ),
        (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: /nonexistent/run does not"),
        (["--model", "resnet", "--seq", "8"], "--seq applies to --model gpt only"),
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
    assert "--chunks must be >= 1" in err and "--steps must be >= 1" in err


def test_unknown_schedule_and_model_are_rejected_by_the_parser(capsys):
    for argv in (["--schedule", "fifo"], ["--model", "vit"]):
        with pytest.raises(SystemExit) as exit_info:
            main(["train", *argv])
        assert exit_info.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


def test_resume_folder_without_a_checkpoint_or_with_a_damaged_one(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert f"no complete checkpoint in {tmp_path}" in capsys.readouterr().err
    step = tmp_path / "checkpoints" / "step-000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_resume_rules(tiny_run, capsys, tmp_path):
    out, _ = tiny_run
    assert main(["train", "--resume", str(out)]) == 2  # at step 10 of 10 already
    assert "nothing to train; pass --steps > 10" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--seq", "16", "--steps", "20"]) == 2
    assert "--seq 16 differs from the checkpoint's 32" in capsys.readouterr().err
    assert main(["train", "--size", "tiny", "--out", str(out)]) == 2
    assert f"already holds a run's checkpoints: continue it with --resume {out}" in (
        capsys.readouterr().err
    )


def test_export_command(tiny_run, tmp_path, capsys):
    out, _ = tiny_run
    assert main(["export", str(out), "-o", str(tmp_path / "m.pt")]) == 0
    printed = capsys.readouterr().out
    assert "gpipe.models.gpt(gpipe.models.GPTConfig(vocab_size=256, context=32" in printed
    assert json.loads((tmp_path / "m.json").read_text())["step"] == 10
    assert main(["export", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_failed_run_reports_the_rank_that_caused_it():
    failures = {
        0: "RuntimeError: [gloo] Connection closed by peer\nTraceback ...",
        1: "CheckpointError: cannot read shard shard-001.pt\nTraceback ...",
        2: "PipelineError: rank 2: the step failed elsewhere",
    }
    assert root_cause(failures) == 1
    assert root_cause({3: "killed by signal 9", 2: "exited with code 1 without a result"}) == 2


@pytest.mark.timeout(200)
def test_non_finite_steps_are_refused_and_the_last_checkpoint_stays_good(in_process, tmp_path):
    out = tmp_path / "nf"
    done = in_process(
        "train", "--size", "tiny", "--steps", "4", "--lr", "1e30", "--warmup", "0",
        "--grad-clip", "0", "--save-every", "1", "--skip-nonfinite", "1", "--out", str(out),
        "--sample-tokens", "0",
    )  # fmt: skip
    assert done.returncode == 1
    assert "step 2 (1 refused in all): the step was refused" in done.stdout
    assert "step 3 (2 refused in all)" in done.stdout  # one skipped, the second stops the run
    assert "failed in rank" in done.stderr and "NonFiniteError" in done.stderr
    manifest = ckpt.read_manifest(out)
    assert manifest["step"] == 1  # the last good step
    state = ckpt.export_state_dict(out)
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


@pytest.mark.timeout(200)
def test_resume_falls_back_from_a_damaged_checkpoint_with_a_warning(tiny_run, in_process, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(tiny_run[0], out)
    shard = out / "checkpoints" / "step-000010" / "shard-001.pt"
    data = bytearray(shard.read_bytes())
    data[300] ^= 0xFF
    shard.write_bytes(bytes(data))
    strict = in_process("train", "--resume", str(out), "--steps", "11", "--strict-resume")
    assert strict.returncode == 2 and "drop --strict-resume" in strict.stderr
    done = in_process("train", "--resume", str(out), "--steps", "11", "--sample-tokens", "0")
    assert done.returncode == 0, done.stderr
    assert "warning:" in done.stderr and "shard-001.pt is not the file saved" in done.stderr
    assert "resumed from step 5" in done.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("how", "code"), [("ctrl-c", 130), ("sigterm", 143)], ids=["ctrl-c", "sigterm"]
)
def test_a_signal_saves_the_step_in_flight_and_leaves_no_process(cache, tmp_path, how, code):
    import signal as signals
    import time

    out = tmp_path / "stopped"
    env = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    argv = ["train", "--size", "tiny", "--steps", "5000", "--save-every", "0", "--eval-every",
            "0", "--sample-tokens", "0", "--progress", "lines", "--out", str(out)]  # fmt: skip
    job = subprocess.Popen(
        [sys.executable, "-m", "gpipe", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal gives a job
    )  # fmt: skip
    try:
        for line in job.stdout:
            if line.startswith("step    10/"):
                break
        if how == "ctrl-c":
            os.killpg(job.pid, signals.SIGINT)  # what a terminal does: every process
        else:
            job.send_signal(signals.SIGTERM)  # what Slurm or Kubernetes does: the launcher
        started = time.monotonic()
        assert job.wait(timeout=60) == code, job.stderr.read()
        assert time.monotonic() - started < 30
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signals.SIGKILL)
    manifest = ckpt.read_manifest(out)
    assert manifest["step"] >= 10  # at most the step in flight was lost
    assert len(losses(out)) == manifest["step"]
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits last
    while time.monotonic() < deadline:
        leftover = subprocess.run(["pgrep", "-a", "-s", str(job.pid)], capture_output=True)
        if not leftover.stdout.strip():
            break
        time.sleep(0.2)
    assert not leftover.stdout.strip(), leftover.stdout.decode()


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


@pytest.mark.timeout(200)
def test_two_runs_into_one_folder_are_refused(cache, tmp_path):
    out = tmp_path / "shared"
    first = subprocess.Popen(
        [sys.executable, "-m", "gpipe", "train", "--size", "tiny", "--steps", "3000",
         "--save-every", "0", "--progress", "lines", "--out", str(out)],
        env={**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(SRC)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in first.stdout:
            if line.startswith("step "):
                break
        second = gpipe_command("train", "--size", "tiny", "--out", str(out), cache=cache)
        assert second.returncode == 2
        assert "is in use by another run" in second.stderr
    finally:
        first.kill()
        first.wait()


def test_export_refuses_a_json_name_for_the_weights(tiny_run, tmp_path, capsys):
    out, _ = tiny_run
    assert main(["export", str(out), "-o", str(tmp_path / "weights.json")]) == 2
    assert "another name than the .json file" in capsys.readouterr().err
    assert not (tmp_path / "weights.json").exists()
