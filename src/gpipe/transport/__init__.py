"""Transports: move activations forward and gradients backward between stages: ``local`` in
one process, ``peers`` between processes over the carrier ``choice`` picks (what each module
does: docs/architecture.md)."""

from gpipe.transport.local import LocalTransport
from gpipe.transport.peers import PeerTransport

__all__ = ["LocalTransport", "PeerTransport"]
