"""A training script as a user writes it for torchrun; test_distributed.py launches it.

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank N --master-addr 127.0.0.1 \\
        --master-port PORT tests/parallel/torchrun_job.py OUT_DIR
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: distributed_cases
from distributed_cases import train_steps

CASE = {
    "model": "gpt",
    "balance": [3, 3],
    "chunks": 4,
    "checkpoint": "except_last",
    "schedule": "1f1b",
    "lengths": [8, 6],
}

# As in a user's script, the pipe lives on past destroy_process_group() until the
# interpreter exits; that exit must be clean (it once aborted in the send thread).
PIPES: list = []

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = train_steps(rank, [CASE], keep=PIPES)[0]
    torch.save(result, Path(sys.argv[1]) / f"rank{rank}.pt")
    print(f"rank {rank} of {dist.get_world_size()} on node {os.environ.get('GROUP_RANK')} done")
    dist.destroy_process_group()
