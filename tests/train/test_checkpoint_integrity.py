"""gpipe.train.checkpoint_integrity: damaged, unreadable, crafted and incomplete checkpoints
are found, named, and skipped when resuming (``gpipe checkpoints``' listing of them:
cli/test_checkpoints.py)."""

from __future__ import annotations

import builtins
import json
import os
import shutil
from pathlib import Path

import pytest

import gpipe.train.checkpoint as ckpt
from gpipe.__main__ import main
from gpipe.train.checkpoint_integrity import choose, listing, problems
from saved_checkpoints import DATA, flip_a_byte, newest, plant, run_of_two_checkpoints


@pytest.fixture
def run(tmp_path):
    return run_of_two_checkpoints(tmp_path)


def test_an_intact_run_resumes_from_its_newest_checkpoint(run):
    assert listing(run) == [(run / "checkpoints" / "step-000010", []), (newest(run), [])]
    assert choose(run) == (newest(run), [])
    manifest = json.loads((newest(run) / ckpt.MANIFEST).read_text())
    assert sorted(manifest["files"]) == [".metadata", DATA]
    assert all(len(digest) == 64 for digest in manifest["files"].values())


@pytest.mark.parametrize(
    ("damage", "found"),
    [
        (lambda f: flip_a_byte(f / DATA), f"{DATA} is not the file saved"),
        (
            lambda f: (f / DATA).write_bytes((f / DATA).read_bytes()[:100]),
            f"{DATA} is not the file saved",
        ),
        (
            lambda f: shutil.copy(f.parent / "step-000010" / DATA, f / DATA),
            f"{DATA} is not the file saved",
        ),
        (lambda f: (f / DATA).unlink(), f"{DATA} is missing"),
        (lambda f: flip_a_byte(f / ".metadata", 50), ".metadata is not the file saved"),
        (
            lambda f: (f / ckpt.MANIFEST).write_text(
                (f / ckpt.MANIFEST).read_text().replace('"step": 20', '"step": 30')
            ),
            "manifest.json was edited",
        ),
        (
            lambda f: (f / ckpt.MANIFEST).write_text(
                (f / ckpt.MANIFEST).read_text().replace('"stages": 1', '"pipes": 1')
            ),
            "manifest.json was edited",
        ),
    ],
    ids=[
        "flipped-byte",
        "truncated",
        "file-of-another-step",
        "missing-file",
        "metadata",
        "edited-step",
        "edited-layout",
    ],
)
def test_a_damaged_newest_checkpoint_is_named_and_skipped(run, damage, found):
    damage(newest(run))
    assert any(found in p for p in problems(newest(run)))
    folder, notes = choose(run)
    assert folder.name == "step-000010"
    assert len(notes) == 1 and found in notes[0] and "resuming from step-000010" in notes[0]
    with pytest.raises(ckpt.CheckpointError, match=r"--resume .*step-000010"):
        choose(run, strict=True)
    with pytest.raises(ckpt.CheckpointError, match="step-000020 is damaged"):
        choose(newest(run))  # asked for by name: no fallback


def test_a_checkpoint_without_its_manifest_is_incomplete_not_silently_skipped(run):
    (newest(run) / ckpt.MANIFEST).unlink()  # `latest` still names it
    folder, notes = choose(run)
    assert folder.name == "step-000010"
    assert "step-000020 is skipped: incomplete" in notes[0]


def test_resume_folder_without_a_checkpoint_or_with_a_damaged_one(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert f"no complete checkpoint in {tmp_path}" in capsys.readouterr().err
    step = tmp_path / "checkpoints" / "step-000004"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_resume_falls_back_from_a_damaged_checkpoint_with_a_warning(tiny_run, in_process, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(tiny_run[0], out)
    shard = out / "checkpoints" / "step-000010" / "__1_0.distcp"  # rank 1's file
    data = bytearray(shard.read_bytes())
    data[300] ^= 0xFF
    shard.write_bytes(bytes(data))
    strict = in_process("train", "--resume", str(out), "--steps", "11", "--strict-resume")
    assert strict.returncode == 2 and "drop --strict-resume" in strict.stderr
    done = in_process("train", "--resume", str(out), "--steps", "11", "--sample-tokens", "0")
    assert done.returncode == 0, done.stderr
    assert "warning:" in done.stderr and "__1_0.distcp is not the file saved" in done.stderr
    assert "resumed from step 5" in done.stdout


def test_a_crafted_newest_checkpoint_is_refused_listed_and_skipped(run, capsys):
    """Its .metadata carries a payload and the manifest's SHA-256 are recomputed, as an
    attacker would: resume, export and the listing refuse it and nothing of it runs."""
    marker = run / "marker"
    plant(newest(run), marker)
    refused = ".metadata refers to pathlib.Path.touch, which a DCP checkpoint never holds"
    assert any(refused in p for p in problems(newest(run)))
    folder, notes = choose(run)
    assert folder.name == "step-000010" and refused in notes[0] and "resuming from" in notes[0]
    assert main(["checkpoints", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "intact" in lines[0] and refused in lines[1] and "intact" not in lines[1]
    assert main(["export", str(newest(run)), "-o", str(run / "out.pt")]) == 2
    assert refused in capsys.readouterr().err and not (run / "out.pt").exists()
    assert not marker.exists()


def unreadable_by_permission(path: Path, monkeypatch) -> None:
    """chmod 000 as a user (root reads anyway): opening ``path`` raises PermissionError."""
    real_open = builtins.open

    def open_(file, *args, **kwargs):
        if os.fspath(file) == os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)


def unreadable_by_io_error(path: Path, monkeypatch) -> None:
    """A regular file whose read fails, for root too: this process's memory at offset 0."""
    path.unlink()
    path.symlink_to("/proc/self/mem")


@pytest.mark.parametrize("make", [unreadable_by_permission, unreadable_by_io_error])
@pytest.mark.parametrize("file", [DATA, ".metadata"])
def test_an_unreadable_newest_checkpoint_falls_back_with_a_warning(
    run, make, file, monkeypatch, capsys
):
    if make is unreadable_by_io_error and not Path("/proc/self/mem").exists():
        pytest.skip("needs Linux's /proc")
    make(newest(run) / file, monkeypatch)
    found = problems(newest(run))
    assert len(found) == 1 and found[0].startswith(f"{file} is unreadable (")
    skipped = f"{newest(run)} is skipped: {found[0]}; resuming from step-000010"
    folder, notes = choose(run)
    assert folder.name == "step-000010" and len(notes) == 1 and notes[0].startswith(skipped)
    assert main(["checkpoints", str(run)]) == 0
    assert f"{file} is unreadable" in capsys.readouterr().out
    # gpipe train says so in one line, then stops: these checkpoints hold no run to resume.
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"warning: {skipped}" in err and "holds no run configuration" in err
    assert "Traceback" not in err


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_resume_skips_a_crafted_checkpoint_and_runs_nothing_of_it(tiny_run, in_process, tmp_path):
    out, marker = tmp_path / "copy", tmp_path / "marker"
    shutil.copytree(tiny_run[0], out)
    plant(out / "checkpoints" / "step-000010", marker)
    refused = ".metadata refers to pathlib.Path.touch, which a DCP checkpoint never holds"
    listed = in_process("checkpoints", str(out))
    assert listed.returncode == 0 and refused in listed.stdout.splitlines()[1]
    exported = in_process("export", str(out / "checkpoints" / "step-000010"))
    assert exported.returncode == 2 and refused in exported.stderr
    done = in_process("train", "--resume", str(out), "--steps", "11", "--sample-tokens", "0")
    assert done.returncode == 0, done.stderr
    assert "warning:" in done.stderr and refused in done.stderr
    assert "resumed from step 5" in done.stdout
    assert not marker.exists()
