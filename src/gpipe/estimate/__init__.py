"""Estimates from profiles: measure a model's layers once, then predict what any cut costs.

* ``profile``: per-layer times and memory, measured on a sample;
* ``memory_model``: what a stage holds under a schedule (parameters, optimizer state,
  boundary inputs, inner activations) and what a process needs beyond it;
* ``costs``: each stage's forward, backward and weight-gradient time under a schedule;
* ``cuts``: exact contiguous cuts (min-max, within a memory bound, the lightest);
* ``ranges``: sums and maxima over any range of layers in O(1);
* ``balance``: the best cut of a profiled model for time or memory, within a budget;
* ``auto``: ``Pipe(balance="auto")``.

Nothing here builds a ``Pipe``: the planner over whole configurations (stages ×
micro-batches × schedule × remat, and capacity) is :mod:`gpipe.planner`, a layer above the
Pipe it verifies with.
"""
