"""``gpipe plan --model``: the very model ``gpipe train`` trains (a built-in or a Hugging Face
configuration), and ``--write-config``'s file trains exactly the planned model and layout."""

from __future__ import annotations

import json

import pytest

from gpipe.__main__ import main
from gpipe.cli import plan
from gpipe.cli.plan_model import not_ours
from gpipe.train import config_file, resolve

transformers = pytest.importorskip("transformers")


def llama_config(folder) -> str:
    """A tiny Llama's config.json, as a user saves one (trained from scratch)."""
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    path = folder / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    return str(path)


def planned(tmp_path, capsys, model: str, *extra: str):
    file = tmp_path / "plan.toml"
    code = main([
        "plan", "--model", model, "--seq", "16", "--batch", "4", "--processes", "2",
        "--search-chunks", "2", "--profile-repeats", "1", "--profile-warmup", "0", "--top", "2",
        "--write-config", str(file), *extra,
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    return file, out


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_plan_profiles_the_hugging_face_model_train_would_build_and_its_file_trains(
    tmp_path, capsys
):
    file, out = planned(tmp_path, capsys, llama_config(tmp_path))
    assert "gpipe plan: config (small, seq 16, batch 4) (5 layers" in out  # 3 blocks + 2
    config = resolve(config_file.merge(file, {"out": str(tmp_path / "run")}))
    written = config_file.read(file)
    assert config.model == str(tmp_path / "config.json")
    assert config.model_args["config"]["num_hidden_layers"] == 3
    assert (config.seq, config.batch, sum(config.balance)) == (16, 4, 5)
    for name in ("stages", "chunks", "schedule", "virtual_stages", "checkpoint", "balance"):
        assert getattr(config, name) == written[name], name
    trains(file, tmp_path, capsys)  # one plan of the model for both (profiling is its cost)


def test_a_file_plan_did_not_write_is_refused_before_planning(tmp_path, capsys, monkeypatch):
    def planning(config):
        raise AssertionError("planned before refusing the file")

    monkeypatch.setattr(plan, "run_plan", planning)
    mine = tmp_path / "run.toml"
    mine.write_text("steps = 7  # the user's own\n")
    code = main(["plan", "--model", "gpt", "--size", "tiny", "--write-config", str(mine)])
    err = capsys.readouterr().err
    assert code == 2 and mine.read_text() == "steps = 7  # the user's own\n"
    assert err.count("\n") == 1 and "gpipe plan did not write it" in err, err


def test_a_plan_replaces_only_its_own_file(tmp_path):
    assert not_ours(str(tmp_path / "new.toml")) is None
    ours = tmp_path / "plan.toml"
    ours.write_text("# gpipe plan's first choice for gpt (tiny, batch 4) ...\nsteps = 7\n")
    assert not_ours(str(ours)) is None
    link = tmp_path / "link.toml"
    link.symlink_to(ours)  # replacing it would replace the user's link
    assert "did not write it" in not_ours(str(link))
    folder = tmp_path / "folder"
    folder.mkdir()
    assert "did not write it" in not_ours(str(folder))


def test_capacity_plans_families_only(capsys):
    assert main(["plan", "--capacity", "--memory", "1GiB", "--model", "hf-llama"]) == 2
    assert "gpt or resnet: --model hf-llama is not one" in capsys.readouterr().err


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_a_written_plan_trains(tmp_path, capsys):
    # README: gpipe plan ... --write-config run.toml, then gpipe train --config run.toml
    file, _ = planned(tmp_path, capsys, "gpt", "--size", "tiny")
    trains(file, tmp_path, capsys)


def trains(file, tmp_path, capsys) -> None:
    """``gpipe train --config FILE`` runs 2 steps with finite losses (at --size tiny's
    evaluation and checkpoint intervals: a file of --size small's runs the same model)."""
    out = tmp_path / "run"
    code = main(["train", "--config", str(file), "--size", "tiny", "--steps", "2", "--out",
                 str(out)])  # fmt: skip
    assert code == 0, capsys.readouterr()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
