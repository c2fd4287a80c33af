"""The engine: runs a schedule's actions on the stages this process holds.

* ``stage``: one stage's forward, re-materialization and backward (B, or B then W);
* ``runtime``: walks the action lists, asking a transport for each input;
* ``split_backward``: input gradients now, weight gradients later (zero-bubble);
* ``skip``: skip connections across stages; ``batchnorm``: micro-batch-exact batch norm;
* ``memory``: what activations each stage holds, measured.
"""
