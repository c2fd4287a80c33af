"""Transports: move activations forward and gradients backward between stages.

* ``local``: stages of one process (device copies, nothing serialized);
* ``peers``: one rank of a pipeline spread over processes: the one sequencing of the wire
  protocol (``framing``: frames, messages, the step's rows, failure notices) over the carrier
  ``choice`` picks, which only moves bytes: ``sockets`` (one machine) or ``distributed`` (the
  process group: gloo, NCCL);
* ``codec``: the plain values everything that crosses processes is made of (no pickle);
  ``handshake``: who may connect to the sockets; ``failures`` and ``inquest``: who stopped.
"""

from gpipe.transport.local import LocalTransport
from gpipe.transport.peers import PeerTransport

__all__ = ["LocalTransport", "PeerTransport"]
