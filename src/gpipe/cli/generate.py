"""Continue a prompt with a model through a pipeline of K processes, with its tokenizer.

    gpipe generate runs/gpt-small-20250101-120000 --prompt "def "        # greedy
    gpipe generate ./my-qwen --prompt "Once upon" --temperature 0.8 --top-p 0.9 --samples 3
    gpipe generate runs/.../best --prompt "x" --max-tokens 100 -K 4 --seed 1

The model is a run's checkpoint (its newest intact one, or the one named), a Hugging Face
folder (save_pretrained's, or gpipe export's); the text is tokenized by the model's own
tokenizer (bytes for gpipe's GPT). Greedy decoding (the default, --temperature 0) writes the
tokens ``model.generate(do_sample=False)`` writes; generation stops at --max-tokens or once
every sample has written the tokenizer's end of text. A Hugging Face causal LM decodes with a
key-value cache in each stage (the prompt in one forward, then one token's forward per token)
when the prompt and --max-tokens fit in --seq; otherwise, and for gpipe's own GPT, each token
runs the whole window, and a line on stderr says why. gpipe train prints samples of its model
at its end by the same code (``gpipe.train.generation``).
"""

from __future__ import annotations

import argparse
import json
import sys

from gpipe.cli.eval import add_model_argument
from gpipe.cli.train import add_config_options, config_of
from gpipe.train import TrainingError
from gpipe.train.generate_job import GenerateConfig, resolve_generate, run_generate

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    add_config_options(parser, GenerateConfig)
    parser.add_argument(
        "--json", action="store_true", help="print the token ids and texts as one JSON line"
    )


def run(args: argparse.Namespace) -> int:
    options = config_of(args, GenerateConfig)
    config = resolve_generate(options)
    try:
        result = run_generate(config, options)
    except TrainingError as error:
        print(f"gpipe generate: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    for i, text in enumerate(result["texts"]):
        if len(result["texts"]) > 1:
            print(f"--- sample {i} ---")
        print(text)
    return 0
