"""Plan a pipeline: choose K, M, schedule, re-materialization and cuts for the user.

Given a model, a sample mini-batch, the number of devices and a memory budget per device,
:func:`plan` profiles the model (``gpipe.profile``) at each micro-batch size it considers,
and for every candidate configuration

    (stages K ≤ devices, virtual stages v, micro-batches M, schedule, checkpoint mode)

1. cuts the model with the exact time balance (``gpipe.estimate.balance``), honouring the budget;
2. simulates the schedule (``gpipe.simulate``) with the profiled per-stage costs — forward,
   backward (input and weight parts for zero-bubble schedules), one more forward per
   re-materialized micro-batch, a per-action overhead, and a transfer time for each
   hand-over between devices (``latency + bytes / bandwidth``);
3. predicts the step time (the makespan), the throughput (samples/s), the bubble, and the
   peak memory of each device (parameters, gradients, optimizer state, and the
   activations the simulated schedule holds; see ``gpipe.estimate.memory_model``).

Candidates that fit the budget are ranked by predicted throughput; ties (equal to nine
significant digits) go to fewer stages, then fewer micro-batches, then a hand-made schedule
before ``zb-auto``, then the schedule's name, the checkpoint mode and fewer virtual stages.
``zb-auto`` is built for each candidate's own costs (see :func:`plan_from_profiles`).
:func:`verify` runs the top ones for real, one process per device (``gpipe.launch``), and
puts measured next to predicted::

    result = gpipe.plan(model, x, devices=4, memory_budget=8 * 2**30, target=y,
                        loss_fn=F.cross_entropy, verify=3)
    print(result.table())
    pipe = gpipe.Pipe(model, **result.best.pipe_kwargs(), devices=[...])

``gpipe plan`` is the command-line front end, for the preset models.

What the prediction leaves out: the optimizer step, the per-step agreement (a small
all-reduce) and contention between processes sharing a machine's cores or memory bandwidth.
Times measured in one process are used for every stage's process: profile with the thread
count each process will have (the CLI uses one thread, as :func:`verify` runs).

Capacity — the largest model of a family that trains within a budget per process, and the
layout that achieves it — is :func:`capacity` (``gpipe.planner.capacity``, no model run
beyond one small profile) and :func:`verify_capacity` (trains it for real and measures each
process's peak; ``gpipe.planner.measured``).

``gpipe.plan`` is this module's :func:`plan`; its other names come from here, e.g.
``from gpipe.planner import Plan, plan_from_profiles, verify`` (the module was
``gpipe.plan`` before the redesign).
"""

from gpipe.layout import Layout
from gpipe.planner.calibration import calibrate
from gpipe.planner.capacity import capacity
from gpipe.planner.families import Family
from gpipe.planner.machine import Link, Machine
from gpipe.planner.measured import CapacityCheck, Measured, verify_capacity
from gpipe.planner.results import Candidate, Capacity, Fit, Plan, Verified
from gpipe.planner.search import plan, plan_from_profiles, verify

__all__ = [
    "Capacity",
    "CapacityCheck",
    "Candidate",
    "Family",
    "Fit",
    "Layout",
    "Link",
    "Machine",
    "Measured",
    "Plan",
    "Verified",
    "calibrate",
    "capacity",
    "plan",
    "plan_from_profiles",
    "verify",
    "verify_capacity",
]
