"""What loading a checkpoint found, and the one error (or warning) that says it."""

from __future__ import annotations

from gpipe.frontend.report import LoadReport, WeightsError


def test_the_ranks_reports_merge_and_the_error_lists_a_few_names_and_the_counts():
    ranks = [
        LoadReport("ckpt", missing=["b", "a"], unexpected=["x"]),
        LoadReport("ckpt", missing=["a", "c", "d", "e"], mismatched=[("w", (2, 3), (3, 2))]),
    ]
    assert all(not r.complete for r in ranks) and LoadReport("ckpt").complete
    report = LoadReport.merged(ranks)
    assert report.missing == ["a", "b", "c", "d", "e"] and report.unexpected == ["x"]
    error = report.error()
    assert isinstance(error, WeightsError) and error.report is report
    message = str(error)
    assert message.startswith("weights=ckpt does not fill the model:\n")
    assert "- 5 tensors of the model not in it: a, b, c, d, ... (1 more)" in message
    assert "- 1 tensor in it that the model does not have: x" in message
    assert "- 1 tensor of another shape: w (2, 3) in it, (3, 2) in the model" in message
    assert "Remedy: pass the checkpoint of this model" in message and "another model" not in message


def test_many_names_on_both_sides_suggest_another_model_and_strict_false_warns():
    report = LoadReport("ckpt", missing=["a", "b"], unexpected=["x", "y"], initialized=["a", "b"])
    assert "is it the checkpoint of another model or configuration?" in str(report.error())
    assert report.warning() == (
        "weights=ckpt (strict=False) did not fill the model: 2 tensors of the model not in it: "
        "a, b; 2 tensors in it that the model does not have: x, y. Initialized instead: a, b"
    )
