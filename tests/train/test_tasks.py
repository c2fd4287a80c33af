"""gpipe.train.tasks: default learning rates and warm-up by the model's own size and whether it
starts from weights (a Hugging Face folder; the built-in models' presets are their sizes')."""

from __future__ import annotations

from gpipe.train import resolve
from gpipe.train.tasks import HF_FOLDER, sized_rates
from train.saved_models import llama, model_folder


def test_smaller_models_take_larger_rates_and_fine_tuning_a_tenth():
    preset = HF_FOLDER.preset("small")
    assert sized_rates(10**6, preset, pretrained=False) == {"lr": 3e-3}  # a tiny model
    assert sized_rates(124 * 10**6, preset, pretrained=False) == {"lr": 6e-4}  # GPT-2's
    assert sized_rates(7 * 10**9, preset, pretrained=False) == {"lr": 1.5e-4}
    tuned = sized_rates(124 * 10**6, preset, pretrained=True)
    assert tuned == {"lr": 6e-5, "warmup": preset["warmup"] // 2}
    assert sized_rates(10**6, preset, pretrained=True)["lr"] == 3e-4


def test_a_tiny_saved_model_gets_its_sizes_rate(tmp_path):
    folder = model_folder(tmp_path / "llama", llama())  # ~50k parameters
    tuned = resolve({"model": str(folder), "size": "tiny", "seq": 32, "out": str(tmp_path / "a")})
    scratch = resolve({"model": str(folder), "size": "tiny", "init": "random", "seq": 32,
                       "out": str(tmp_path / "b")})  # fmt: skip
    assert (scratch.lr, tuned.lr) == (3e-3, 3e-4)
    assert tuned.warmup == HF_FOLDER.preset("tiny")["warmup"] // 2
    given = resolve({"model": str(folder), "lr": 1e-2, "seq": 32, "out": str(tmp_path / "c")})
    assert given.lr == 1e-2  # a given rate wins
