"""Planning: measure a model, model its memory, and choose where to cut it.

* ``profile``: per-layer times and memory, measured on a sample;
* ``memory_model``: what a stage holds under a schedule (parameters, optimizer state,
  boundary inputs, inner activations);
* ``balance``: the exact best cut for time or memory, within a budget;
* ``auto``: ``Pipe(balance="auto")``.

The planner over whole configurations (stages × micro-batches × schedule × remat) is
:mod:`gpipe.planner`, a layer above the Pipe it can verify.
"""
