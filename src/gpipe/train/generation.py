"""Text written by a model through its pipeline: :func:`generate`, for the samples at the end
of ``gpipe train`` and for ``gpipe generate``.

A Hugging Face causal LM decodes with a key-value cache: a second capture of the model, of
one decode step, cut into the same stages, each holding the cache of its own layers
(:mod:`gpipe.train.kv_cache`); a new token costs one token's forward. Any other model, or a
case the cache cannot make exact (its reason printed in one line), runs the whole window (the
last ``window`` tokens) through the pipeline once per new token. Greedy decoding
(``temperature`` 0) picks the tokens the plain model picks either way
(``model.generate(do_sample=False)``, tests/train/test_generation.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

import gpipe.train.kv_cache as kv_cache
from gpipe.frontend import CaptureError
from gpipe.parallel.mesh import Mesh
from gpipe.pipe import Pipe

__all__ = ["Sampling", "generate", "pick"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits: greedy (``temperature`` 0), else drawn
    from the softmax at ``temperature`` over the ``top_k`` likeliest (0: all) and the
    smallest set of them whose probability reaches ``top_p``."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def problems(self) -> list[str]:
        found = []
        if self.temperature < 0 or self.top_k < 0:
            found.append("--temperature and --top-k must be >= 0 (temperature 0: greedy)")
        if not 0 < self.top_p <= 1:
            found.append(f"--top-p must be in (0, 1], got {self.top_p}")
        return found


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row of ``logits`` (B, vocab): (B, 1)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, descending=True)
        # a token is dropped when the likelier ones already reach top_p (the first never is)
        before = F.softmax(ordered, dim=-1).cumsum(dim=-1) - F.softmax(ordered, dim=-1)
        beyond = before >= sampling.top_p
        dropped = torch.zeros_like(beyond).scatter(-1, order, beyond)
        logits = logits.masked_fill(dropped, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


def generate(
    pipe: Pipe, mesh: Mesh, task: Any, prompt: list[int], *, rows: int, new_tokens: int,
    window: int, sampling: Sampling, seed: int, autocast: Callable[[], Any], cache: bool = True,
) -> torch.Tensor:  # fmt: skip
    """``rows`` continuations of ``prompt`` (rows, prompt + up to ``new_tokens``), the same on
    every rank of the pipeline (collective). The last stage picks each next token and
    broadcasts it; the first feeds it back in. Stops early once every row has written the
    tokenizer's end of text (a row then continues with it, as ``model.generate`` pads).
    ``cache=False``: the window, without a notice."""
    tokens = torch.tensor(prompt or [0], dtype=torch.int64).repeat(rows, 1)
    generator = torch.Generator().manual_seed(seed)
    last_rank = pipe.schedule.stage_to_rank[-1]
    eos = getattr(task.tokenizer, "eos", None)
    ended = torch.zeros(rows, dtype=torch.bool)
    pipe.eval()
    try:
        with torch.no_grad(), autocast():
            logits_of = _decoding(pipe, task, rows, (tokens.shape[1], new_tokens), window, cache)
            for _ in range(new_tokens):
                logits = logits_of(tokens)  # (rows, vocab) on the last stage
                chosen = torch.zeros(rows, 1, dtype=torch.int64)
                if logits is not None:
                    chosen = pick(logits, sampling, generator)
                chosen = mesh.pipeline.broadcast(
                    chosen, "the broadcast of a sampled token", src=last_rank
                )
                if eos is not None:
                    chosen[ended] = eos
                    ended |= chosen[:, 0] == eos
                tokens = torch.cat([tokens, chosen], dim=1)
                if eos is not None and ended.all():
                    break
    finally:
        pipe.train()
    return tokens


def _decoding(
    pipe: Pipe, task: Any, rows: int, lengths: tuple[int, int], window: int, cache: bool
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """The next token's logits of the tokens so far (None off the last stage): through the
    decode step's cache, fed the tokens it has not seen (the prompt at once), else the
    window's pipe. ``lengths``: the prompt's and the new tokens'."""
    prompt, length = lengths[0], sum(lengths)
    reason = kv_cache.why_not(pipe, task, length=length, window=window) if cache else ""
    if reason is None:
        try:
            decoder = kv_cache.decoder(pipe, task, rows=rows, length=length, prompt=prompt)
        except CaptureError as error:
            reason = f"the decode step cannot be captured ({str(error).splitlines()[0]})"
    if reason is not None:
        if reason and pipe.rank in (None, 0):
            print(f"gpipe: generating without a key-value cache: {reason}; each token runs "
                  "the whole window", file=sys.stderr)  # fmt: skip

        def windowed(tokens: torch.Tensor) -> torch.Tensor | None:
            out = pipe(tokens[:, -window:])
            return None if out is None else task.logits(out)[:, -1, :]

        return windowed
    seen = 0

    def cached(tokens: torch.Tensor) -> torch.Tensor | None:
        nonlocal seen
        start, seen = seen, tokens.shape[1]
        return decoder(tokens[:, start:], start)

    return cached
