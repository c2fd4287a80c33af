"""Transports: move activations forward and gradients backward between stages.

* ``local``: stages of one process (device copies, nothing serialized);
* ``sockets`` (one machine) and ``distributed`` (the process group: gloo, NCCL): one rank of
  a pipeline spread over processes, the carrier ``choice`` picks;
* ``framing``: the one wire protocol of both (frames: messages, the step's rows, failure
  notices); ``codec``: the plain values everything that crosses processes is made of (no
  pickle); ``handshake``: who may connect to the sockets; ``inquest``: who stopped.
"""

from gpipe.transport.distributed import DistributedTransport
from gpipe.transport.local import LocalTransport

__all__ = ["DistributedTransport", "LocalTransport"]
