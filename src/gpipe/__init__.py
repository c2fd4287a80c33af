"""gpipe: micro-batch pipeline-parallel training (GPipe) for PyTorch.

Cut an ``nn.Sequential`` into K stages, split each mini-batch into M micro-batches and
stream them through the stages; one synchronous optimizer step per mini-batch, with the
same gradients as the un-split model::

    pipe = gpipe.Pipe(model, balance=[3, 3], chunks=8, checkpoint="except_last")
    loss = pipe.step(x, y, torch.nn.functional.cross_entropy)
    optimizer.step(); optimizer.zero_grad()
"""

from gpipe.allocator import cpu_allocator
from gpipe.engine.batchnorm import DeferredBatchNorm
from gpipe.engine.memory import measure_activations
from gpipe.engine.skip import pop, skippable, stash
from gpipe.errors import NonFiniteError, PartitionError, PipelineError
from gpipe.estimate.balance import balance_by_size, balance_by_time
from gpipe.estimate.profile import profile
from gpipe.parallel.launch import launch
from gpipe.pipe import Pipe
from gpipe.planner import plan
from gpipe.remat import is_recomputing
from gpipe.schedule.simulate import simulate

__all__ = [
    "DeferredBatchNorm",
    "NonFiniteError",
    "PartitionError",
    "Pipe",
    "PipelineError",
    "balance_by_size",
    "balance_by_time",
    "cpu_allocator",
    "is_recomputing",
    "launch",
    "measure_activations",
    "plan",
    "pop",
    "profile",
    "simulate",
    "skippable",
    "stash",
]
__version__ = "0.1.0"
