"""Transports: move activations forward and gradients backward between stages.

* ``local``: stages of one process (device copies, nothing serialized);
* ``distributed``: one rank of a pipeline spread over processes;
* ``framing``: how a message looks on the wire; ``codec``: the plain values everything that
  crosses processes is made of (no pickle); ``handshake``: who may connect to the sockets;
  ``sender``: sends that never block.
"""

from gpipe.transport.distributed import DistributedTransport
from gpipe.transport.local import LocalTransport

__all__ = ["DistributedTransport", "LocalTransport"]
