"""gpipe: micro-batch pipeline-parallel training (GPipe) for PyTorch.

Cut an ``nn.Sequential`` into K stages, split each mini-batch into M micro-batches and
stream them through the stages; one synchronous optimizer step per mini-batch, with the
same gradients as the un-split model::

    pipe = gpipe.Pipe(model, balance=[3, 3], chunks=8, checkpoint="except_last")
    loss = pipe.step(x, y, torch.nn.functional.cross_entropy)
    optimizer.step(); optimizer.zero_grad()

The front end is imported here; the rest of the package on first use, so that ``import
gpipe`` stays quick: ``gpipe.train`` (the main job: its data, checkpoints, timeline pictures),
``gpipe.models``, ``gpipe.planner``, ... are there as attributes (module ``__getattr__``).
"""

from types import ModuleType as _Module

from gpipe.base.allocator import cpu_allocator
from gpipe.base.errors import NonFiniteError, PartitionError, PipelineError
from gpipe.base.remat import is_recomputing
from gpipe.engine.batchnorm import DeferredBatchNorm
from gpipe.engine.memory import measure_activations
from gpipe.engine.skip import pop, skippable, stash
from gpipe.estimate.balance import balance_by_size, balance_by_time
from gpipe.estimate.profile import profile
from gpipe.layout import Layout
from gpipe.parallel.launch import launch
from gpipe.pipe import Pipe
from gpipe.pipe.exactness import check
from gpipe.planner import plan
from gpipe.schedule.simulate import simulate

__all__ = [
    "DeferredBatchNorm",
    "Layout",
    "NonFiniteError",
    "PartitionError",
    "Pipe",
    "PipelineError",
    "balance_by_size",
    "balance_by_time",
    "check",
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


def __getattr__(name: str) -> _Module:
    """A module of the package that ``import gpipe`` did not load (``gpipe.train``),
    imported now; Python then keeps it as an attribute, so this runs once per module."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    import pkgutil

    modules = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    return sorted(set(globals()) | modules)
