"""What ``gpipe.frontend.capture`` costs: the seconds of one capture (export in ``train()`` and
in ``eval()``, then the cuts) of tiny Hugging Face models, as the tests and ``gpipe train
--model`` capture them.

    PYTHONPATH=src python benchmarks/capture_cost.py [--repeats 5]

Each model is captured once to warm up (imports, first-call caches), then ``--repeats`` times;
the median and the fastest of the CPU seconds this process spent (one thread: other processes'
load changes them far less than the wall clock) are printed. Run it on two trees
(``PYTHONPATH``) to compare them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from gpipe.frontend import capture


def _models() -> dict[str, tuple[torch.nn.Module, tuple, str]]:
    ids = torch.randint(0, 64, (2, 8))
    gpt2 = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=16,
        n_layer=4,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    llama = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    bart = transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
        max_position_embeddings=64,
    )  # fmt: skip
    return {
        "gpt2 (4 blocks)": (transformers.GPT2LMHeadModel(gpt2), (ids,), "transformer.h"),
        "llama (4 blocks)": (transformers.LlamaForCausalLM(llama), (ids,), "model.layers"),
        "bart (2+2 blocks)": (
            transformers.BartForConditionalGeneration(bart),
            {"input_ids": ids, "decoder_input_ids": ids},
            ["model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1"],
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'model':<20} {'median CPU s':>13} {'fastest':>8}")
    for name, (model, example, split) in _models().items():
        capture(model.train(), example, split=split)  # warm-up
        seconds = []
        for _ in range(args.repeats):
            began = time.process_time()
            capture(model, example, split=split)
            seconds.append(time.process_time() - began)
        print(f"{name:<20} {statistics.median(seconds):13.2f} {min(seconds):8.2f}")


if __name__ == "__main__":
    main()
