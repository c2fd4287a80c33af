"""Any model as it is: capture its forward, cut it at named modules, train it with ``Pipe``.

``gpipe.frontend.capture`` turns a model (a Hugging Face or torchvision network, anything
``torch.export`` can capture) into a ``CapturedModel``, the ``nn.Sequential`` of units that
``Pipe`` takes; ``Pipe.from_model`` does both in one call. The Pipe keeps the model's
behaviour: its forward hooks run (gradient hooks are refused, ``gpipe.frontend.hooks``), it
follows the model's ``train()``/``eval()`` and lists its tensors in the model's order
(``gpipe.frontend.original``).
"""

from gpipe.frontend.capture import capture, fit_devices, split_points
from gpipe.frontend.cut import CaptureError
from gpipe.frontend.files import Checkpoint, CheckpointError
from gpipe.frontend.names import ModelNames
from gpipe.frontend.original import Original
from gpipe.frontend.report import LoadReport, WeightsError
from gpipe.frontend.units import CapturedModel, Unit
from gpipe.frontend.weights import Origin, materialize_units, on_meta, origin_of

__all__ = [
    "CaptureError",
    "CapturedModel",
    "Checkpoint",
    "CheckpointError",
    "LoadReport",
    "ModelNames",
    "Original",
    "Origin",
    "Unit",
    "WeightsError",
    "capture",
    "fit_devices",
    "materialize_units",
    "on_meta",
    "origin_of",
    "split_points",
]
