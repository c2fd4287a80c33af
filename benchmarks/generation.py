"""Generation through the pipeline: the key-value cache against the whole window per token.

    python benchmarks/generation.py [-K 2] [--new-tokens 32] [--rounds 3]

A random Llama (4 layers, hidden 256, its own BPE tokenizer; ``tests/train/saved_models.py``)
saved in a temporary folder is loaded as ``gpipe generate`` loads it, in K processes
(float32), and continues a prompt greedily by ``gpipe.train.generation.generate`` both ways
in alternating rounds: the window (the cache refused, as for a model without one) and the
decode step's cache (its capture counted, and also given apart). Prints the medians in
tokens per second and whether both wrote the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "train"))

import gpipe.train.kv_cache as kv_cache
from gpipe.train.eval_job import launched, load_pipe
from gpipe.train.generate_job import GenerateConfig, resolve_generate
from gpipe.train.generation import generate
from gpipe.train.precision import autocast_of

PROMPT = "def loads(s, *, cls=None, object_hook=None, parse_float=None):\n    "


def _rank(rank: int, config: Any, g: GenerateConfig, rounds: int) -> dict[str, Any]:
    c = config
    (mesh, pipe), task = load_pipe(c), c.task
    prompt = task.encode(g.prompt)
    why_not, decoder = kv_cache.why_not, kv_cache.decoder
    seconds: dict[str, list[float]] = {"window": [], "cache": [], "capture": []}
    written = {}

    def timed_decoder(*args: Any, **kwargs: Any) -> Any:
        tick = time.perf_counter()
        built = decoder(*args, **kwargs)
        seconds["capture"].append(time.perf_counter() - tick)
        return built

    kv_cache.decoder = timed_decoder
    for _ in range(rounds):
        for side in ("window", "cache"):
            kv_cache.why_not = (lambda *a, **k: "measuring the window") if side == "window" \
                else why_not  # fmt: skip
            mesh.everyone.barrier("the barrier before a round")
            tick = time.perf_counter()
            tokens = generate(pipe, mesh, task, prompt, rows=1, new_tokens=g.max_tokens,
                              window=c.seq, sampling=g.sampling, seed=0,
                              autocast=autocast_of(c.dtype))  # fmt: skip
            seconds[side].append(time.perf_counter() - tick)
            written[side] = tokens.tolist()
    return {"seconds": seconds, "same": written["window"] == written["cache"],
            "prompt": len(prompt)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-K", "--stages", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from saved_models import llama, model_folder

    with tempfile.TemporaryDirectory() as folder:
        shape = dict(
            hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=256,
        )  # fmt: skip
        model_folder(Path(folder) / "llama", llama(**shape), seed=0)
        g = GenerateConfig(model=str(Path(folder) / "llama"), prompt=PROMPT,
                           max_tokens=args.new_tokens, stages=args.stages, seq=256)  # fmt: skip
        result = launched(_rank, resolve_generate(g), g, args.rounds)
    s, new = result["seconds"], args.new_tokens
    window, cache = statistics.median(s["window"]), statistics.median(s["cache"])
    capture = statistics.median(s["capture"])
    print(
        f"K={args.stages}, prompt {result['prompt']} tokens + {new} new, greedy, float32, "
        f"median of {args.rounds}: window {new / window:.1f} tokens/s -> cache "
        f"{new / cache:.1f} tokens/s with its capture ({capture:.2f} s), "
        f"{new / (cache - capture):.1f} tokens/s after it; same tokens: {result['same']}"
    )


if __name__ == "__main__":
    main()
