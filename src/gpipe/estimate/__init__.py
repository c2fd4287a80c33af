"""Estimates from profiles: measure a model's layers once, then predict what any cut costs
(its modules, one line each: docs/architecture.md).

Nothing here builds a ``Pipe``: the planner over whole configurations (stages ×
micro-batches × schedule × remat, and capacity) is :mod:`gpipe.planner`, a layer above the
Pipe it verifies with.
"""
