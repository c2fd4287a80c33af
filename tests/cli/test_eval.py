"""``gpipe eval``'s command line: what is missing is one line (the evaluation itself:
train/test_evaluation.py, train/test_eval_job.py)."""

from __future__ import annotations


def test_gpipe_eval_without_data_says_so_in_one_line(in_process, tmp_path):
    done = in_process("eval", str(tmp_path))
    assert done.returncode == 2
    assert "--data is required" in done.stderr
