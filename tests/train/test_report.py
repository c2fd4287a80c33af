"""What the main job leaves behind, without running it: ``metrics.jsonl`` with its sinks and
the loss plot's title after a resume at another layout (the sinks themselves:
``test_reporters.py``). ``tests/train/test_train_job.py`` checks the same files of a real run."""

from __future__ import annotations

import json

import pytest

from gpipe.train.report import Metrics, loss_title, plot_losses


def _records(steps, layout):
    return [
        {"step": s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": None, "step_time": 0.1,
         "tokens_per_s": 1000.0 + s, "elapsed": 0.1 * s, "layout": layout}
        for s in steps
    ]  # fmt: skip


def test_each_record_reaches_the_file_and_every_sink_as_a_copy(tmp_path):
    seen = []
    metrics = Metrics(
        tmp_path / "metrics.jsonl", 0, history=None, enabled=True, layout="K=2 M=4 gpipe",
        sinks=[lambda r: r.clear(), seen.append],
    )  # fmt: skip
    for record in _records([1, 2, 3], None):
        del record["layout"]
        metrics.write(record)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert seen == written == metrics.records()
    assert [r["layout"] for r in seen] == ["K=2 M=4 gpipe"] * 3


def test_the_loss_plot_names_every_layout_of_a_resumed_run(tmp_path):
    records = _records(range(1, 6), "K=2 M=4 gpipe") + _records(range(6, 11), "K=4 M=8 1f1b")
    assert loss_title("gpt tiny", records) == (
        "gpt tiny: K=2 M=4 gpipe (steps 1-5); K=4 M=8 1f1b (steps 6-10)"
    )
    assert loss_title("gpt tiny", records[:5]) == "gpt tiny, K=2 M=4 gpipe"
    older = [{k: v for k, v in r.items() if k != "layout"} for r in records[:5]]  # before layouts
    assert loss_title("gpt tiny", older + records[5:]).startswith("gpt tiny: ? (steps 1-5); K=4")
    pytest.importorskip("matplotlib")
    (tmp_path / "target").write_text("theirs")
    (tmp_path / "loss.png").symlink_to(tmp_path / "target")  # replaced, not followed
    assert plot_losses(records, tmp_path / "loss.png", name="gpt tiny")
    assert (tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "target").read_text() == "theirs"
