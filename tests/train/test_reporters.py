"""``--report-to``'s destinations (``gpipe.train.reporters``), without running a job: TensorBoard's
event files read back, W&B and MLflow through stand-ins of their packages (``fake_trackers``)
and, where the packages are installed, for real in their offline modes (W&B's offline run
files, an MLflow file store under ``tmp_path``): nothing leaves the machine.
``test_train_job.py`` sends a whole run to them."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from gpipe.train import reporters
from gpipe.train.config import ConfigError
from gpipe.train.options import resolve
from gpipe.train.report import Metrics
from gpipe.train.reporters import TensorBoard, open_sinks
from train import fake_trackers


def _records(steps, layout):
    return [
        {"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": None, "step_time": 0.1,
         "tokens_per_s": 1000.0 + s, "elapsed": 0.1 * s, "layout": layout}
        for s in steps
    ]  # fmt: skip


SUMMARY = {
    "bubble": 0.25, "tokens_per_s": 1234.0, "seconds": 3.0, "transport": "sockets",
    "memory_per_rank": [
        {"rank": r, "stages": [r], "activation_bytes": 2**20 * (r + 1), "state_bytes": 2**21,
         "peak_rss_bytes": 2**28}
        for r in range(2)
    ],
}  # fmt: skip


@pytest.fixture
def event_accumulator():
    return pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _scalars(accumulator, folder):
    events = accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    return scalars, events


def test_each_record_reaches_tensorboard(tmp_path, event_accumulator):
    board = TensorBoard.open(tmp_path, start=0, history=[])
    metrics = Metrics(
        tmp_path / "metrics.jsonl", 0, history=None, enabled=True, layout="K=2 M=4 gpipe",
        sinks=[board],
    )  # fmt: skip
    for record in _records([1, 2, 3], None):
        del record["layout"]
        record.update({"val_loss": 4.0} if record["step"] == 3 else {})
        metrics.write(record)
    (tmp_path / "config.toml").write_text('model = "gpt"\nstages = 2\n')
    board.end(SUMMARY, tmp_path, step=3)
    board.close()

    scalars, events = _scalars(event_accumulator, tmp_path)
    assert scalars["train/loss"] == [(s, pytest.approx(5.0 - 0.1 * s)) for s in (1, 2, 3)]
    assert [v for _, v in scalars["train/tokens_per_s"]] == [1001.0, 1002.0, 1003.0]
    assert scalars["val/loss"] == [(3, 4.0)]
    assert "train/grad_norm" not in scalars and "train/elapsed" not in scalars  # None; a clock
    assert scalars["pipeline/bubble"] == [(3, 0.25)]
    assert scalars["memory_MiB/activations/rank1_stage1"] == [(3, 2.0)]
    assert scalars["memory_MiB/weights_and_optimizer/rank0_stage0"] == [(3, 2.0)]
    assert scalars["memory_MiB/process_peak/rank0_stage0"] == [(3, 256.0)]
    assert {"summary/text_summary", "config/text_summary"} <= set(events.Tags()["tensors"])


def test_a_resume_covers_the_run_once_in_tensorboard(tmp_path, event_accumulator):
    """In a new folder the history up to the checkpoint is written again; in the same
    folder the old file's steps after the checkpoint are purged."""
    first = tmp_path / "first"
    first.mkdir()
    board = TensorBoard.open(first, start=0, history=[])
    for record in _records(range(1, 8), "K=2 M=4 gpipe"):  # ran to 7, checkpoint at 5
        board(record)
    board.close()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    board = TensorBoard.open(elsewhere, start=5, history=_records(range(1, 6), "K=2 M=4 gpipe"))
    for record in _records(range(6, 9), "K=4 M=4 1f1b"):
        board(record)
    board.close()
    assert [s for s, _ in _scalars(event_accumulator, elsewhere)[0]["train/loss"]] == [*range(1, 9)]

    board = TensorBoard.open(first, start=5, history=[])
    for record in _records(range(6, 9), "K=4 M=4 1f1b"):
        board({**record, "loss": 1.0})
    board.close()
    loss = _scalars(event_accumulator, first)[0]["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 9))  # steps 6 and 7 once: the new ones
    assert [v for s, v in loss if s > 5] == [1.0, 1.0, 1.0]


def test_a_missing_package_is_refused_when_named_and_tensorboard_by_default_noted(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    notes = []
    assert open_sinks("tensorboard", tmp_path, start=0, history=[], options={},
                      note=notes.append) == []  # fmt: skip
    assert len(notes) == 1 and "pip install 'gpipe[tensorboard]'" in notes[0]
    find_spec = importlib.util.find_spec
    missing = ("tensorboard", "wandb", "mlflow")
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *a: None if name in missing else find_spec(name, *a),
    )
    options = {"size": "tiny", "out": str(tmp_path / "run")}
    assert resolve(options).report_to == "tensorboard"  # the default: the trainer notes it
    for name in missing:
        words = rf"--report-to {name}: the {name} package .*pip install 'gpipe\[{name}\]'"
        with pytest.raises(ConfigError, match=words):
            resolve({**options, "report_to": f"{name},none"})
    assert resolve({**options, "report_to": "none"}).report_to == "none"


def test_a_function_is_named_module_colon_function_and_other_names_are_refused(tmp_path):
    assert reporters.load_function("json:dumps") is json.dumps
    for spec, words in [
        ("json:", "give MODULE:FUNCTION"),
        ("no_such_module_here:f", "cannot import no_such_module_here"),
        ("json:nothing", "json has no function nothing"),
        ("comet", "not one of tensorboard, wandb, mlflow, MODULE:FUNCTION"),
    ]:
        with pytest.raises(ConfigError, match=words):
            resolve({"size": "tiny", "out": str(tmp_path / "run"), "report_to": spec})
    seen = []
    sink = reporters.Function(seen.append)
    sink({"step": 1})
    assert seen == [{"step": 1}]


def _send(sinks, steps, out):
    for record in _records(steps, "K=2 M=4 gpipe"):
        for sink in sinks:
            sink(record)
    (out / "config.toml").write_text("stages = 2\n")
    for sink in sinks:
        sink.end(SUMMARY, out, step=steps[-1])
        sink.close()


def test_wandb_and_mlflow_get_each_record_the_summary_and_the_files(tmp_path, monkeypatch):
    log = tmp_path / "calls.jsonl"
    fake_trackers.install(tmp_path / "site", log, monkeypatch)
    out = tmp_path / "run"
    out.mkdir()
    opened = open_sinks("wandb,mlflow", out, start=0, history=[], options={"stages": 2},
                        note=print)  # fmt: skip
    _send(opened, [1, 2], out)
    calls = fake_trackers.calls(log)
    assert calls[0] == ["wandb.init", {"project": "gpipe", "name": "run", "id": None,
                                       "resume": None}]  # fmt: skip
    logged = [c for c in calls if c[0] == "wandb.log"]
    assert [c[1] for c in logged] == [1, 2] and logged[0][2]["train/loss"] == 4.9
    assert "train/elapsed" not in logged[0][2] and "train/grad_norm" not in logged[0][2]
    metrics = [c[1:] for c in calls if c[0] == "mlflow.metric"]
    assert [v for _, k, v in metrics if k == "train/loss"] == [4.9, 4.8]
    assert [s for s, k, _ in metrics if k == "summary/bubble"] == [2]
    assert ["mlflow.params", {"stages": "2"}] in calls
    assert ["wandb.save", "config.toml"] in calls and ["mlflow.artifact", "config.toml"] in calls
    finish = next(c for c in calls if c[0] == "wandb.finish")
    assert finish[1]["tokens_per_s"] == 1234.0 and "transport" not in finish[1]
    assert calls[-1] == ["mlflow.terminated", "mlflow-run-1"]
    assert json.loads((out / "trackers.json").read_text()) == {
        "wandb": "wandb-run-1", "mlflow": "mlflow-run-1"
    }  # fmt: skip

    # Resumed in its folder: the same runs, only the new steps. Elsewhere: new runs, the
    # history first.
    log.unlink()
    history = _records(range(1, 3), "K=2 M=4 gpipe")
    _send(open_sinks("wandb,mlflow", out, start=2, history=history, options={}, note=print),
          [3], out)  # fmt: skip
    calls = fake_trackers.calls(log)
    assert calls[0][1]["id"] == "wandb-run-1" and calls[0][1]["resume"] == "allow"
    assert ["mlflow.update_run", "mlflow-run-1", "RUNNING"] in calls
    assert [c[1] for c in calls if c[0] == "wandb.log"] == [3]
    log.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _send(open_sinks("wandb", elsewhere, start=2, history=history, options={}, note=print),
          [3], elsewhere)  # fmt: skip
    assert [c[1] for c in fake_trackers.calls(log, "wandb.log")] == [1, 2, 3]


@pytest.mark.slow  # wandb starts its service process, wandb-core
@pytest.mark.timeout(120)
def test_wandb_offline_writes_its_run_files_in_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    _send(open_sinks("wandb", tmp_path, start=0, history=[], options={"stages": 2},
                     note=print), [1, 2], tmp_path)  # fmt: skip
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]
    (data,) = tmp_path.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    assert b"train/loss" in data.read_bytes() and b"tokens_per_s" in data.read_bytes()


def test_mlflow_records_every_step_in_a_file_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store, deprecated
    out = tmp_path / "run"
    out.mkdir()
    history = _records(range(1, 3), "K=2 M=4 gpipe")
    _send(open_sinks("mlflow", out, start=2, history=history, options={"stages": 2},
                     note=print), [3], out)  # fmt: skip
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    run = client.get_run(json.loads((out / "trackers.json").read_text())["mlflow"])
    assert run.data.params["stages"] == "2" and run.info.status == "FINISHED"
    loss = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(loss) == [(1, 4.9), (2, 4.8), (3, 4.7)]
    assert run.data.metrics["summary/bubble"] == 0.25
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.toml"}
