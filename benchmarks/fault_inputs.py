"""Bad input to every command: refused in one line, before any process starts, leaving
nothing behind; and no file gpipe did not write overwritten. Rows of the fault matrix
(``benchmarks/faults.py``); alone::

    python benchmarks/fault_inputs.py

Each case runs the command as a user would (``python -m gpipe ...``) and checks its exit
code, that it printed one line (no traceback), and that nothing was made or changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMISE = "exit 2 with one line naming the file (and line) or value and the remedy, before any "
PROMISE += "process starts; nothing made or changed"

# What each case printed or did before (the session that filed issue 40).
_BEFORE = {
    "empty.jsonl": "`ValueError … no documents`, a traceback from the ranks",
    "missing.jsonl": "a traceback from the ranks",
    "number.jsonl": "`no text in field ('text',)` although the field is there",
    "malformed.jsonl": "`JSONDecodeError`, naming neither file nor line",
    "empty.txt": "found after both ranks started (162 s), not saying it is empty",
    "model.bin": "trained on, silently",
    "latin1.txt": "trained on, its bad bytes replaced silently",
    "short.txt": "a traceback from the ranks",
}
_DATA = {
    "empty.jsonl": b"",
    "missing.jsonl": b'{"text": "a"}\n{"body": "b"}\n',
    "number.jsonl": b'{"text": 3}\n',
    "malformed.jsonl": b'{"text": "a"}\n{"text": "b",}\n',
    "empty.txt": b"",
    "model.bin": b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8,
    "latin1.txt": "naïve café, encoded as Latin-1\n".encode("latin-1") * 100,
    "short.txt": b"a short text",
}


def _gpipe(*argv: str, cache: Path) -> tuple[subprocess.CompletedProcess, float, int]:
    """(what the command did, its seconds, its processes left)."""
    env = {**os.environ, "GPIPE_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT / "src")}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    started = time.monotonic()
    job = subprocess.Popen([sys.executable, "-m", "gpipe", *argv], env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)  # fmt: skip
    out, err = job.communicate(timeout=600)
    seconds = time.monotonic() - started
    found = subprocess.run(["pgrep", "-s", str(job.pid)], capture_output=True, text=True)
    done = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    return done, seconds, len(found.stdout.split())


def _row(name, done, seconds, left, *, expected: str, unchanged: bool, work: Path) -> tuple:
    err = done.stderr
    one_line = err.count("\n") == 1 and "Traceback" not in err
    held = done.returncode == 2 and one_line and expected in err and unchanged and left == 0
    said = err.strip().replace(str(work), "<tmp>").replace("|", "/")[:220]
    return (name, PROMISE, seconds, seconds, f"exit {done.returncode}: {said}", left, held)


def rows_inputs(work: Path) -> list[tuple]:
    cache, rows = work / "cache", []
    for name, content in _DATA.items():
        data = work / name
        data.write_bytes(content)
        out = work / f"run-{name}"
        result = _gpipe("train", "--size", "tiny", "--data", str(data), "--out", str(out),
                        cache=cache)  # fmt: skip
        rows.append(_row(f"gpipe train --data {name} (before: {_BEFORE[name]})", *result,
                         expected=str(data), unchanged=not out.exists(), work=work))  # fmt: skip
    model = work / "my-qwen"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}\n')
    result = _gpipe("train", "--size", "tiny", "--out", str(model), cache=cache)
    rows.append(_row("gpipe train -o a model's folder (before: its config.json overwritten, "
                     "the model no longer loaded)", *result, expected="is not a gpipe run",
                     unchanged=[p.name for p in model.iterdir()] == ["config.json"],
                     work=work))  # fmt: skip
    rows += _export_rows(work, cache)
    for argv, before in [(("--search-chunks", "0"), "a traceback"),
                         (("--search-schedules", "fifo"), "a traceback")]:  # fmt: skip
        result = _gpipe("plan", *argv, cache=cache)
        rows.append(_row(f"gpipe plan {' '.join(argv)} (before: {before})", *result,
                         expected=argv[0], unchanged=True, work=work))  # fmt: skip
    rows.append(_too_large(work, cache))
    return rows


def _export_rows(work: Path, cache: Path) -> list[tuple]:
    run = work / "exported-run"
    _gpipe("train", "--size", "tiny", "--steps", "2", "--save-every", "2", "--sample-tokens",
           "0", "--out", str(run), cache=cache)  # fmt: skip
    rows = []
    notes = work / "notes.json"
    notes.write_text("the user's notes\n")
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for out, before, expected in [
        (work / "notes.pt", "notes.json overwritten", "notes.json exists and gpipe export did not"),
        (run / "config.pt", "the run's config.json overwritten", "is a file of the run"),
        (run / "checkpoints" / "step-000002" / "m.pt", "the checkpoint damaged", "is a checkpoint"),
    ]:  # fmt: skip
        result = _gpipe("export", str(run), "-o", str(out), cache=cache)
        same = notes.read_text() == "the user's notes\n" and not out.exists() and all(
            p.read_bytes() == data for p, data in files.items())  # fmt: skip
        rows.append(_row(f"gpipe export -o {out.relative_to(work)} (before: {before})", *result,
                         expected=expected, unchanged=same, work=work))  # fmt: skip
    victim, out = work / "victim", work / "m.pt"
    victim.write_text("precious\n")
    (work / "m.pt.tmp").symlink_to(victim)  # the temporary name export used
    done, seconds, left = _gpipe("export", str(run), "-o", str(out), cache=cache)
    kept = victim.read_text() == "precious\n" and out.is_file() and not out.is_symlink()
    rows.append(("gpipe export -o m.pt with a link planted at m.pt.tmp (before: followed, the "
                 "file it named overwritten)", "the export is written; the link not followed",
                 seconds, seconds, f"exit {done.returncode}" + (", the file linked unchanged"
                 if kept else ""), left, done.returncode == 0 and kept and left == 0))  # fmt: skip
    return rows


def _too_large(work: Path, cache: Path) -> tuple:
    """The README's example on a Qwen2.5-14B configuration: 2.7 B parameters at 4 layers."""
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
              "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 8,
              "num_hidden_layers": 48, "vocab_size": 152064, "max_position_embeddings": 32768,
              "tie_word_embeddings": False}  # fmt: skip
    (work / "my-qwen.json").write_text(json.dumps(config))
    (work / "notes.txt").write_text("Some notes of mine.\n" * 2000)
    out = work / "run-qwen"
    result = _gpipe("train", "--model", str(work / "my-qwen.json"), "--data",
                    str(work / "notes.txt"), "--model-config", "num_hidden_layers=4", "--out",
                    str(out), cache=cache)  # fmt: skip
    return _row("the README's --model ./my-qwen.json --model-config num_hidden_layers=4 (a "
                "14 B Qwen's configuration; before: OOM-killed after 1m43s)", *result,
                expected="at its peak", unchanged=not out.exists(), work=work)  # fmt: skip


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="gpipe-inputs-") as folder:
        for row in rows_inputs(Path(folder)):
            name, promise, worst, wall, outcome, left, held = row
            print(f"| {name} | {promise} | {worst:.2f} | {wall:.2f} | {outcome} | {left} | "
                  f"{'yes' if held else '**no**'} |", flush=True)  # fmt: skip
