"""Parallelism across processes: the only layer (with ``gpipe.transport``) that imports
``torch.distributed``.

* ``group``: a Pipe's ranks, in one process or many, and what they must agree on;
* ``data_parallel``: gradients averaged over replicas of a stage, bucketed;
* ``tied``: one parameter used by several stages, kept equal;
* ``mesh``: the job's processes (pipeline × data parallel) and small collectives;
* ``launch``: run a function in N local processes forming one group;
* ``store``: the job's store, held by the launcher, on loopback when every process is here;
* ``dcp``: checkpoints written and read by ``torch.distributed.checkpoint``.
"""
