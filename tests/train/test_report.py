"""What the main job leaves behind, without running it: ``metrics.jsonl`` with its sinks
(TensorBoard's event files, the user's hook) and the loss plot's title after a resume at
another layout. ``tests/train/test_train_job.py`` checks the same files of a real run."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from gpipe.train import hooks
from gpipe.train.config import ConfigError
from gpipe.train.options import resolve
from gpipe.train.report import Metrics, TensorBoard, loss_title, plot_losses

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _records(steps, layout):
    return [
        {"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": None, "step_time": 0.1,
         "tokens_per_s": 1000.0 + s, "elapsed": 0.1 * s, "layout": layout}
        for s in steps
    ]  # fmt: skip


def _scalars(folder):
    events = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    return scalars, events


def test_each_record_reaches_tensorboard_and_the_hook(tmp_path):
    seen = []
    board = TensorBoard.open(tmp_path, start=0, history=[])
    metrics = Metrics(
        tmp_path / "metrics.jsonl", 0, history=None, enabled=True, layout="K=2 M=4 gpipe",
        sinks=[board, seen.append],
    )  # fmt: skip
    for record in _records([1, 2, 3], None):
        del record["layout"]
        record.update({"val_loss": 4.0} if record["step"] == 3 else {})
        metrics.write(record)
    summary = {
        "bubble": 0.25, "tokens_per_s": 1234.0, "seconds": 3.0,
        "memory_per_rank": [
            {"rank": r, "stages": [r], "activation_bytes": 2**20 * (r + 1), "state_bytes": 2**21,
             "peak_rss_bytes": 2**28}
            for r in range(2)
        ],
    }  # fmt: skip
    (tmp_path / "config.toml").write_text('model = "gpt"\nstages = 2\n')
    board.end(summary, tmp_path, step=3)
    board.close()

    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert seen == written and [r["layout"] for r in seen] == ["K=2 M=4 gpipe"] * 3
    scalars, events = _scalars(tmp_path)
    assert scalars["train/loss"] == [(s, pytest.approx(5.0 - 0.1 * s)) for s in (1, 2, 3)]
    assert [v for _, v in scalars["train/tokens_per_s"]] == [1001.0, 1002.0, 1003.0]
    assert scalars["val/loss"] == [(3, 4.0)]
    assert "train/grad_norm" not in scalars and "train/elapsed" not in scalars  # None; a clock
    assert scalars["pipeline/bubble"] == [(3, 0.25)]
    assert scalars["memory_MiB/activations/rank1_stage1"] == [(3, 2.0)]
    assert scalars["memory_MiB/weights_and_optimizer/rank0_stage0"] == [(3, 2.0)]
    assert scalars["memory_MiB/process_peak/rank0_stage0"] == [(3, 256.0)]
    assert {"summary/text_summary", "config/text_summary"} <= set(events.Tags()["tensors"])


def test_a_resume_covers_the_run_once_in_tensorboard(tmp_path):
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
    assert [s for s, _ in _scalars(elsewhere)[0]["train/loss"]] == list(range(1, 9))

    board = TensorBoard.open(first, start=5, history=[])
    for record in _records(range(6, 9), "K=4 M=4 1f1b"):
        board({**record, "loss": 1.0})
    board.close()
    loss = _scalars(first)[0]["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 9))  # steps 6 and 7 once: the new ones
    assert [v for s, v in loss if s > 5] == [1.0, 1.0, 1.0]


def test_without_the_tensorboard_package_a_run_goes_on_unless_it_asked_for_it(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    assert TensorBoard.open(tmp_path, start=0, history=[]) is None
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a),
    )
    options = {"size": "tiny", "out": str(tmp_path / "run")}
    assert resolve(options).tensorboard  # on by default: the trainer says once it is off
    with pytest.raises(ConfigError, match=r"--tensorboard: .*pip install 'gpipe\[tensorboard\]'"):
        resolve({**options, "tensorboard": True})


def test_a_metrics_hook_is_named_module_colon_function(tmp_path):
    assert hooks.load("json:dumps") is json.dumps
    for spec, words in [
        ("json", "give MODULE:FUNCTION"),
        ("no_such_module_here:f", "cannot import no_such_module_here"),
        ("json:nothing", "json has no function nothing"),
    ]:
        with pytest.raises(ValueError, match=words):
            hooks.load(spec)
        with pytest.raises(ConfigError, match=words):
            resolve({"size": "tiny", "out": str(tmp_path / "run"), "metrics_hook": spec})


def test_the_loss_plot_names_every_layout_of_a_resumed_run(tmp_path):
    records = _records(range(1, 6), "K=2 M=4 gpipe") + _records(range(6, 11), "K=4 M=8 1f1b")
    assert loss_title("gpt tiny", records) == (
        "gpt tiny: K=2 M=4 gpipe (steps 1-5); K=4 M=8 1f1b (steps 6-10)"
    )
    assert loss_title("gpt tiny", records[:5]) == "gpt tiny, K=2 M=4 gpipe"
    older = [{k: v for k, v in r.items() if k != "layout"} for r in records[:5]]  # before layouts
    assert loss_title("gpt tiny", older + records[5:]).startswith("gpt tiny: ? (steps 1-5); K=4")
    pytest.importorskip("matplotlib")
    assert plot_losses(records, tmp_path / "loss.png", name="gpt tiny")
    assert (tmp_path / "loss.png").stat().st_size > 0
