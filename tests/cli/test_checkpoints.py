"""``gpipe checkpoints``: each checkpoint of a run and its state, intact, damaged (what is
wrong with it) or incomplete, and which one ``latest`` names."""

from __future__ import annotations

from gpipe.__main__ import main
from saved_checkpoints import DATA, flip_a_byte, newest, run_of_two_checkpoints


def test_gpipe_checkpoints_lists_each_state(tmp_path, capsys):
    run = run_of_two_checkpoints(tmp_path)
    flip_a_byte(newest(run) / DATA)
    (run / "checkpoints" / "step-000030.tmp").mkdir()
    assert main(["checkpoints", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step-000010") and "intact" in lines[0]
    assert lines[1].startswith("step-000020") and f"{DATA} is not the file saved" in lines[1]
    assert "<- latest" in lines[1]
    assert lines[2].startswith("step-000030.tmp") and "incomplete" in lines[2]
