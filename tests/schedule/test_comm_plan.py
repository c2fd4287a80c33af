"""When receives are posted: the NCCL plan never deadlocks, receiving ahead would.

The model is the strictest a backend can be: each process runs its sends and receives
one at a time in issue order, and a transfer happens only when the sender's and the
receiver's next operations are that transfer (a rendezvous). NCCL, which runs a
process's operations on a stream in issue order and may hold a large send until its
receive starts, is no stricter than that.
"""

from __future__ import annotations

import pytest

from gpipe.engine.skip import SkipLayout
from gpipe.models import unet
from gpipe.schedule import Kind, build_schedule
from gpipe.schedule.comm_plan import receive_points
from gpipe.schedule.routes import Routes

CASES = [
    ("gpipe", 2, 8, 1),
    ("gpipe", 4, 4, 1),
    ("1f1b", 2, 8, 1),
    ("1f1b", 4, 6, 1),
    ("zb-h1", 2, 5, 1),
    ("zb-h1", 4, 8, 1),
    ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 4, 8, 2),
    ("zb-v", 2, 4, 2),  # the turn of the V stays on one rank: no transfer there
    ("zb-v", 4, 8, 2),
    ("dualpipe-v", 3, 6, 2),
    ("dualpipe-v", 4, 10, 2),
    ("zb-auto", 4, 8, 1),
]


def unet_routes() -> Routes:
    """Four stages with skips from stage 0 to 3 and from 1 to 2."""
    layout = SkipLayout.of(list(unet()))
    stage_of_layer = [0, 0, 1, 1, 2, 3, 3]
    return Routes(4, {s: layout.stage_view(stage_of_layer, s) for s in range(4)})


def operations(schedule, routes, training, receives_before):
    """Each rank's transfers in issue order: receives due before an action, then its sends."""
    s2r = schedule.stage_to_rank
    program = []
    for rank, actions in enumerate(schedule.actions):
        ops = []
        for action in actions:
            if not training and action.kind is not Kind.FORWARD:
                continue
            ops += [("recv", m) for m in receives_before(rank, action)]
            ops += [("send", m) for m in routes.outgoing(action) if s2r[m.stage] != rank]
        program.append(ops)
    return program


def run_in_issue_order(program, schedule, routes):
    """Pair up rendezvous transfers until none can happen; the operations left over."""
    s2r = schedule.stage_to_rank
    heads = [0] * len(program)
    progressed = True
    while progressed:
        progressed = False
        for rank, ops in enumerate(program):
            if heads[rank] == len(ops) or ops[heads[rank]][0] != "send":
                continue
            message = ops[heads[rank]][1]
            dst = s2r[message.stage]
            if heads[dst] < len(program[dst]) and program[dst][heads[dst]] == ("recv", message):
                heads[rank] += 1
                heads[dst] += 1
                progressed = True
    return [ops[heads[rank] :] for rank, ops in enumerate(program)]


def plan_of(schedule, routes, training):
    points = {
        rank: receive_points(schedule, routes, rank, training) for rank in range(schedule.num_ranks)
    }
    return lambda rank, action: [message for _, message in points[rank].get(action, ())]


@pytest.mark.parametrize(("name", "ranks", "microbatches", "virtual"), CASES)
@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_receive_points_never_deadlock_in_issue_order(name, ranks, microbatches, virtual, training):
    schedule = build_schedule(
        name, num_ranks=ranks, num_microbatches=microbatches, virtual_stages=virtual
    )
    routes = Routes(schedule.num_stages)
    program = operations(schedule, routes, training, plan_of(schedule, routes, training))
    assert run_in_issue_order(program, schedule, routes) == [[]] * ranks


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_receive_points_with_skip_connections(name):
    schedule = build_schedule(name, num_ranks=4, num_microbatches=4)
    routes = unet_routes()
    program = operations(schedule, routes, True, plan_of(schedule, routes, True))
    assert run_in_issue_order(program, schedule, routes) == [[]] * 4


@pytest.mark.parametrize(("name", "ranks", "microbatches", "virtual"), CASES)
def test_every_message_is_received_once_before_the_action_that_needs_it(
    name, ranks, microbatches, virtual
):
    schedule = build_schedule(
        name, num_ranks=ranks, num_microbatches=microbatches, virtual_stages=virtual
    )
    routes = Routes(schedule.num_stages)
    for rank, actions in enumerate(schedule.actions):
        points = receive_points(schedule, routes, rank, True)
        posted = set()
        for action in actions:
            for _, message in points.get(action, ()):
                assert message not in posted
                posted.add(message)
            for message in routes.incoming(action):
                if schedule.stage_to_rank[routes.sender(message)] != rank:
                    assert message in posted, (rank, action, message)
        expected = {
            m
            for r, acts in enumerate(schedule.actions)
            if r != rank
            for a in acts
            for m in routes.outgoing(a)
            if schedule.stage_to_rank[m.stage] == rank
        }
        assert posted == expected


def test_receiving_ahead_would_deadlock_in_issue_order():
    """Why NCCL gets the plan: gloo's early receives would hold back the sends behind them.

    Receiving ahead posts the first message from each peer at the start of the step and
    the next one as each arrives. For GPipe, rank 0's receive of the first gradient then
    sits in front of all its activation sends.
    """
    schedule = build_schedule("gpipe", num_ranks=2, num_microbatches=4)
    routes = Routes(schedule.num_stages)
    s2r = schedule.stage_to_rank

    def ahead(rank, action):
        incoming = [
            m
            for r, acts in enumerate(schedule.actions)
            if r != rank
            for a in acts
            for m in routes.outgoing(a)
            if s2r[m.stage] == rank
        ]
        first_action = schedule.actions[rank][0]
        consumed = [m for m in routes.incoming(action) if s2r[routes.sender(m)] != rank]
        early = incoming[:1] if action == first_action else []
        follow = [incoming[incoming.index(m) + 1] for m in consumed if m != incoming[-1]]
        return early + follow

    program = operations(schedule, routes, True, ahead)
    stuck = run_in_issue_order(program, schedule, routes)
    assert stuck[0][0][0] == "recv" and stuck[1][0][0] == "recv"
