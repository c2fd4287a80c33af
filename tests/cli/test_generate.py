"""``gpipe generate``'s command line: what it refuses before any process starts (the
generation itself: tests/train/test_generate_job.py)."""


def test_generate_without_a_prompt_says_so_in_one_line(in_process, tmp_path):
    done = in_process("generate", str(tmp_path))
    assert done.returncode == 2
    assert "--prompt is required" in done.stderr
