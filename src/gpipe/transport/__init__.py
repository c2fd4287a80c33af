"""Transports: move activations forward and gradients backward between stages: ``local`` in
one process, ``peers`` between processes over the carrier ``choice`` picks (what each module
does: docs/architecture.md)."""
