"""A Hugging Face GPT-2, pipelined as it is: no wrapper, the tied head found, not declared.

    python examples/hf_gpt2.py                          # one process, two stages
    torchrun --nproc-per-node 2 examples/hf_gpt2.py     # one stage per process (gloo)

Needs the hf extra (pip install 'gpipe[hf]'). The model is random and tiny; the data are
bytes of the Python standard library's source, so that nothing is downloaded.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import gpipe
from gpipe.train.data import TokenWindows, stdlib_bytes

# -- the user code, from model to training loop ---------------------------------------------------
torch.set_num_threads(1)  # layers this small: more threads only wait on each other
group = None
if "RANK" in os.environ:  # started by torchrun
    dist.init_process_group("gloo")
    group = dist.group.WORLD
config = GPT2Config(
    vocab_size=256, n_positions=64, n_embd=64, n_layer=4, n_head=4,
    bos_token_id=None, eos_token_id=None,  # bytes: GPT-2's special token 50256 is no byte
)  # fmt: skip
example = torch.zeros(2, 64, dtype=torch.long)  # only its structure and dtypes matter
pipe = gpipe.Pipe.from_model(
    lambda: GPT2LMHeadModel(config), (example,), split="transformer.h",
    balance=[3, 3], chunks=4, group=group,
)  # fmt: skip
optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
loss_fn = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())  # noqa: E731
windows, g = TokenWindows(stdlib_bytes(200_000), seq=64), torch.Generator().manual_seed(0)
for step in range(30):
    x, y = windows[torch.randint(len(windows), (16,), generator=g)]  # 16 windows of 64 bytes
    loss = pipe.step(x, y, loss_fn)
    optimizer.step()
    optimizer.zero_grad()
    if step % 10 == 0 and (group is None or dist.get_rank() == 0):
        print(f"step {step:3d}  loss {loss:.3f}")
# -------------------------------------------------------------------------------------------------
if group is None or dist.get_rank() == 0:
    print(f"final loss {loss:.3f}")
if group is not None:
    dist.destroy_process_group()
