"""``gpipe train`` end to end, with K processes spawned by the command.

One tiny run (K=2, the session's ``tiny_run``) is shared by these tests: its files, its
progress output, resuming from its middle checkpoint, and loading its last checkpoint at K=1
and K=4. Faults (signals, damaged checkpoints, bad input) are in ``tests/faults``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict

import pytest
import torch

import gpipe
import gpipe.train.checkpoint as ckpt
from gpipe.__main__ import main
from gpipe.cli import train as train_cli
from gpipe.cli.export import export
from gpipe.train import TrainConfig, Trainer, build_model, config_file, resolve
from gpipe.train.optimizer_state import optimizer_state_by_name
from train import fake_trackers
from train_runs import losses

RANK_FILES = ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.timeout(200)
def test_a_tiny_run_trains_and_leaves_its_files(tiny_run):
    out, done = tiny_run
    files = {p.name for p in out.iterdir()}
    expected = {"config.json", "config.toml", "metrics.jsonl", "summary.json", "loss.png"}
    expected |= {"sample.txt"}
    assert expected | {"timeline.png", "timeline.json", "checkpoints"} <= files
    assert not [name for name in files if name.startswith(".")]  # no lock file left
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest",
        "step-000005",
        "step-000010",
    ]
    manifest = ckpt.read_manifest(out)
    # DCP's files: its metadata and one file per rank
    assert manifest.step == 10 and sorted(manifest.files) == [".metadata", *RANK_FILES]

    loss = losses(out)
    assert list(loss) == list(range(1, 11))
    assert all(torch.isfinite(torch.tensor(v)) for v in loss.values())
    assert loss[1] > 5.0 and sum(loss[s] for s in (8, 9, 10)) / 3 < loss[1] - 0.5
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_loss"] < 5.0 and summary["tokens_per_s"] > 0
    assert 0 <= summary["bubble"] < 1 and len(summary["memory_per_rank"]) == 2
    assert summary["sample"].startswith("def ")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["layout"] for r in records} == {"K=2 M=4 gpipe"}

    # TensorBoard's files in the run folder: the curves of metrics.jsonl and the measurements.
    tensorboard = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = tensorboard.EventAccumulator(str(out), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 11))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(list(loss.values()))
    assert [e.step for e in events.Scalars("val/loss")] == [5, 10]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "pipeline/bubble"} <= set(
        events.Tags()["scalars"]
    )
    assert "memory_MiB/activations/rank1_stage1" in events.Tags()["scalars"]
    assert events.Tags()["images"] == ["timeline/measured"]

    # What the user sees: rank 0's progress lines, validation, the summary; nothing twice.
    stdout = done.stdout
    assert stdout.count("gpipe train: gpt tiny, K=2 M=4") == 1
    assert "step     1/10  loss" in stdout and "step    10/10" in stdout and "tokens/s" in stdout
    assert "eta" in stdout and "step 5: val loss" in stdout
    assert "train loss" in stdout and "bubble" in stdout and "rank 1 (stage 1)" in stdout
    assert stdout.count("done: 10 steps") == 1

    # Its config.toml, given back with --config, is the same run (in another folder).
    again = resolve(config_file.merge(out / "config.toml", {"out": str(out.parent / "again")}))
    ran = json.loads((out / "config.json").read_text())
    assert {**asdict(again), "out": ran["out"]} == ran


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_resuming_reproduces_the_uninterrupted_run_bitwise(tiny_run, in_process, tmp_path):
    out, _ = tiny_run
    resumed = tmp_path / "b"
    middle = out / "checkpoints" / "step-000005"
    done = in_process(
        "train", "--resume", str(middle), "--out", str(resumed), "--sample-tokens", "0",
        "--progress", "bar", "--transport", "group",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resumed from step 5" in done.stdout
    assert "train ━" in done.stdout and "10/10 loss" in done.stdout  # rich's bar, at its end
    before, after = losses(out), losses(resumed)
    assert list(after) == list(range(1, 11))  # steps 1-5 carried over from the first run
    # Same K, M and schedule on CPU: the same floating-point operations in the same order,
    # whatever carries the messages (the first run's sockets, gloo here).
    assert [after[s] for s in range(6, 11)] == [before[s] for s in range(6, 11)]
    ran = [json.loads((run / "summary.json").read_text())["transport"] for run in (out, resumed)]
    assert ran == ["sockets", "group"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_one_process_resumes_bitwise(in_process, tmp_path):
    """K=1: one rank writes the whole DCP checkpoint, and a resume repeats the run exactly."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    tiny = ["--size", "tiny", "--stages", "1", "--steps", "4", "--eval-every", "2",
            "--sample-tokens", "0"]  # fmt: skip
    done = in_process("train", *tiny, "--save-every", "2", "--out", str(whole))
    assert done.returncode == 0, done.stderr
    middle = whole / "checkpoints" / "step-000002"
    assert sorted(ckpt.read_manifest(middle).files) == [".metadata", "__0_0.distcp"]
    done = in_process("train", "--resume", str(middle), "--out", str(resumed))
    assert done.returncode == 0, done.stderr
    assert "resumed from step 2" in done.stdout
    before, after = losses(whole), losses(resumed)
    assert all(after[s] == before[s] for s in (3, 4)), (before, after)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_resuming_with_more_steps_goes_on_from_the_rate_where_it_stood(
    tiny_run, in_process, tmp_path
):
    out, _ = tiny_run
    longer = tmp_path / "longer"
    done = in_process(
        "train", "--resume", str(out), "--steps", "13", "--out", str(longer),
        "--sample-tokens", "0", "--eval-every", "0", "--save-every", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rates = {r["step"]: r["lr"] for r in map(json.loads, (longer / "metrics.jsonl").open())}
    # Step 10 ended the cosine at lr/10: the 3 steps more stay there (they jumped up before).
    assert rates[10] == pytest.approx(3e-4) and rates[11] == rates[12] == rates[13] == rates[10]
    assert ckpt.read_manifest(longer).scheduler["_schedulers"][1]["T_max"] == 13 - 5


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_checkpoint_without_the_schedulers_state_resumes_bitwise(tiny_run, in_process, tmp_path):
    """Saved by a rank 0 without a scheduler (a stage without parameters has no optimizer):
    the rates are replayed from step 1 to its step."""
    out, _ = tiny_run
    old = tmp_path / "old" / "step-000005"
    shutil.copytree(out / "checkpoints" / "step-000005", old)
    manifest = ckpt.read_manifest(old)
    manifest.scheduler = None
    ckpt.write_manifest(old, manifest)  # as written (an edited manifest would be refused)
    resumed = tmp_path / "b"
    done = in_process("train", "--resume", str(old), "--out", str(resumed), "--sample-tokens", "0")
    assert done.returncode == 0, done.stderr
    rates = {r["step"]: r["lr"] for r in map(json.loads, (resumed / "metrics.jsonl").open())}
    before = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").open())}
    assert all(rates[s] == before[s]["lr"] for s in range(6, 11))
    assert all(losses(resumed)[s] == before[s]["loss"] for s in range(6, 11))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_run_reports_to_wandb_mlflow_and_a_function_of_its_own(in_process, tmp_path, monkeypatch):
    """Through stand-ins of wandb and mlflow (tests/train/fake_trackers.py) and a hook, all
    importable first (the ranks start with this process's path); without tensorboard in
    --report-to, no event files."""
    out, seen, log = tmp_path / "run", tmp_path / "hook.jsonl", tmp_path / "trackers.jsonl"
    fake_trackers.install(tmp_path / "site", log, monkeypatch)
    (tmp_path / "site" / "step_hook.py").write_text(
        "import json, os\n"
        "def record(metrics):\n"
        "    with open(os.environ['GPIPE_TEST_HOOK_FILE'], 'a') as f:\n"
        "        f.write(json.dumps(metrics) + '\\n')\n"
    )
    monkeypatch.setenv("GPIPE_TEST_HOOK_FILE", str(seen))
    # This process imports the hook to check --report-to: it leaves with the test.
    monkeypatch.setitem(sys.modules, "step_hook", None)
    del sys.modules["step_hook"]
    done = in_process(
        "train", "--size", "tiny", "--stages", "1", "--steps", "3", "--eval-every", "0",
        "--save-every", "0", "--sample-tokens", "0", "--out", str(out),
        "--report-to", "wandb,mlflow,step_hook:record",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert not list(out.glob("events.out.tfevents.*")) and (out / "metrics.jsonl").exists()
    hooked = [json.loads(line) for line in seen.read_text().splitlines()]
    written = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert hooked == written and [r["step"] for r in hooked] == [1, 2, 3]  # rank 0's, once
    wandb = fake_trackers.calls(log, "wandb.log")
    assert [(c[1], c[2]["train/loss"]) for c in wandb] == [(r["step"], r["loss"]) for r in written]
    mlflow = fake_trackers.calls(log, "mlflow.metric")
    assert [v for _, _, k, v in mlflow if k == "train/loss"] == [r["loss"] for r in written]
    finished = fake_trackers.calls(log, "wandb.finish")[0][1]
    assert finished["steps_run"] == 3 and finished["val_loss"] > 0
    assert ["mlflow.artifact", "loss.png"] in fake_trackers.calls(log, "mlflow.artifact")
    assert "files" in done.stdout and "trackers.json" in done.stdout


def _outputs_at(rank: int, config: TrainConfig, x: torch.Tensor):
    """In each of K launched processes: load the checkpoint as ``gpipe train`` does, run x."""
    trainer = Trainer(rank, config)
    trainer.pipe.eval()
    with torch.no_grad():
        out = trainer.pipe(x)
    optimizer = optimizer_state_by_name(trainer.optimizer, trainer.names)
    return out, optimizer["state"], trainer.sampler.state_dict()


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_a_k2_checkpoint_loads_at_k1_and_k4_and_exports_to_the_plain_model(
    tiny_run, cache, tmp_path, monkeypatch
):
    out, _ = tiny_run
    manifest = ckpt.read_manifest(out)
    x = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))

    # Export: one plain state dict for the un-split model.
    exported = export(out, tmp_path / "model.pt")
    plain = build_model(manifest.model)
    plain.load_state_dict(torch.load(exported, weights_only=True), strict=True)
    plain.eval()
    with torch.no_grad():
        expected = plain(x)

    # K=1: one process holding every layer, loaded by name.
    one = gpipe.Pipe(build_model(manifest.model), balance=[4], chunks=4)
    one.load_state_dict(ckpt.load_tensors(manifest, list(one.state_dict())), strict=True)
    one.eval()
    with torch.no_grad():
        torch.testing.assert_close(one(x), expected, rtol=1e-6, atol=1e-6)

    # K=4: four processes, each reading only its layer's tensors.
    monkeypatch.setenv("GPIPE_CACHE_DIR", str(cache))
    parser = argparse.ArgumentParser()
    train_cli.configure(parser)
    args = parser.parse_args(["--resume", str(out), "--stages", "4", "--out", str(tmp_path)])
    args.steps = 11  # one more than the checkpoint's, so that the configuration is valid
    config = resolve(vars(args))
    assert (config.stages, config.model_args) == (4, manifest.config["model_args"])
    results = gpipe.launch(_outputs_at, nprocs=4, args=(config, x), timeout=60)
    torch.testing.assert_close(results[3][0], expected, rtol=1e-6, atol=1e-6)
    assert all(r[0] is None for r in results[:3])  # outputs only on the last stage's rank
    assert all(r[2] == manifest.data for r in results)  # the data position

    # The optimizer state of every parameter, by name, is the saved one.
    names = [n for n, _ in plain.named_parameters()]
    saved = ckpt.load(manifest, model=[], optimizer=names).optimizer["state"]
    loaded = {name: state for r in results for name, state in r[1].items()}
    assert set(loaded) == set(saved) == {n for n, _ in plain.named_parameters()}
    for name, state in saved.items():
        for key, value in state.items():
            assert torch.equal(loaded[name][key], value), (name, key)


@pytest.mark.timeout(200)
@pytest.mark.slow
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
    # Every rank's memory, replica 1's too, and no lock file left in the folder.
    assert [m["rank"] for m in summary["memory_per_rank"]] == [0, 1, 2, 3]
    for rank, stage, replica in [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]:
        assert f"rank {rank} (stage {stage}, replica {replica}): activations" in done.stdout
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    state = ckpt.export_state_dict(out)
    assert any("running_mean" in name for name in state)  # batch norm statistics are saved
    plain = build_model(ckpt.read_manifest(out).model)
    plain.load_state_dict(state, strict=True)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_sharded_replicas_train_as_plain_ones_and_their_checkpoints_load_at_other_layouts(
    in_process, tmp_path
):
    """--replicas 2 --shard all: the losses of plain replicas; a checkpoint (each rank writes its
    shards) resumes at K=1 with the same losses and exports; a plain replicas' checkpoint
    resumes into sharded ones."""
    common = ["train", "--size", "tiny", "--steps", "6", "--save-every", "3", "--eval-every",
              "3", "--replicas", "2", "--sample-tokens", "4"]  # fmt: skip
    sharded, plain, resumed = tmp_path / "sharded", tmp_path / "plain", tmp_path / "resumed"
    for out, extra in ((sharded, ["--shard", "all"]), (plain, [])):
        done = in_process(*common, *extra, "--out", str(out))
        assert done.returncode == 0, done.stderr
    for step, loss in losses(plain).items():
        assert abs(losses(sharded)[step] - loss) <= 1e-5 * abs(loss), step
    middle = sharded / "checkpoints" / "step-000003"
    done = in_process("train", "--resume", str(middle), "--stages", "1", "--out", str(resumed))
    assert done.returncode == 0, done.stderr
    for step in (4, 5, 6):
        assert abs(losses(resumed)[step] - losses(sharded)[step]) <= 1e-5 * losses(sharded)[step]
    state = ckpt.export_state_dict(sharded)
    plain_model = build_model(ckpt.read_manifest(sharded).model)
    plain_model.load_state_dict(state, strict=True)
    # Every one of the 4 ranks wrote its own shards (DCP), none gathered whole tensors.
    files = ckpt.read_manifest(middle).files
    assert sorted(files) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]

    into_shards = tmp_path / "into-shards"
    middle = plain / "checkpoints" / "step-000003"
    done = in_process("train", "--resume", str(middle), "--stages", "1", "--shard", "all",
                      "--out", str(into_shards))  # fmt: skip
    assert done.returncode == 0, done.stderr
    for step in (4, 5, 6):
        assert abs(losses(into_shards)[step] - losses(plain)[step]) <= 1e-5 * losses(plain)[step]


@pytest.mark.slow
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
    plain = build_model(ckpt.read_manifest(out).model)
    assert isinstance(plain, transformers.LlamaForCausalLM)
    plain.load_state_dict(state, strict=True)


def test_resume_rules(tiny_run, capsys, tmp_path):
    out, _ = tiny_run
    assert main(["train", "--resume", str(out)]) == 2  # at step 10 of 10 already
    assert "nothing to train; pass --steps > 10" in capsys.readouterr().err
    # --resume auto (torchrun --max-restarts) after the last checkpoint: done, not an error
    before = sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*"))
    assert main(["train", "--resume", "auto", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"{out} is complete (its checkpoint is at step 10 of --steps 10)" in said
    assert sorted((p, p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    assert main(["train", "--resume", "auto", "--out", str(out), "--steps", "9"]) == 0
    assert main(["train", "--resume", str(out), "--seq", "16", "--steps", "20"]) == 2
    assert "--seq 16 differs from the checkpoint's 32" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--warmup", "2", "--steps", "20"]) == 2
    assert "--warmup 2 differs from the checkpoint's 5: a resumed run continues its" in (
        capsys.readouterr().err
    )
    assert main(["train", "--resume", str(out), "--optimizer", "sgd", "--steps", "20"]) == 2
    assert "--optimizer sgd differs from the checkpoint's 'adamw'" in capsys.readouterr().err
    # Another model: said so, not a KeyError of the GPT's arguments in the other's recipe.
    assert main(["train", "--resume", str(out), "--model", "hf-llama", "--steps", "20"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gpipe train: error: --model hf-llama differs from the checkpoint's 'gpt': a resumed "
        "run keeps the model, data and seed; drop --model"
    ]  # the one problem, in one line
    assert main(["train", "--size", "tiny", "--out", str(out)]) == 2
    assert f"already holds a run's checkpoints: continue it with --resume {out}" in (
        capsys.readouterr().err
    )
