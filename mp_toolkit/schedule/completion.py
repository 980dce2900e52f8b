"""When a rank may wait for a send of its own to complete: a plan read off the schedule.

A posted send may still be in flight for a while, and the transport has no cheap way to ask:
gloo's send ``Work`` reports ``is_completed()`` only once ``wait()`` has run, and gloo sends
rendezvous (the bytes move once the peer has posted the matching receive). Waiting on a send whose
receive the peer has *not* posted yet could deadlock a schedule the validator proved under
non-blocking sends (`mp_toolkit.schedule.validate`). Waiting on one whose receive is *known* to be
posted cannot: the transfer finishes without anyone doing anything else.

A rank knows that much from what it receives. Executing a batch (a run of consecutive comm
actions, posted together in one ``batch_isend_irecv``; see ``actions``) posts all of its
operations at once, and a message carries what its sender knew when it posted it. With vector
clocks (Lamport 1978; Mattern 1989), ``clock[p]`` being the number of actions of rank ``p`` known
to be posted, a rank that completed the receives of a batch can wait, without blocking on anything
but the transfer itself, on each earlier send of its own whose matching receive lies within
``clock[peer]``. That proof often comes late, though: a warm-up forward's send is known received
only when the first gradient comes back.

`send_waits` therefore first tries Megatron-LM's order, each forward send waited for at the end of
the batch that posts it (the compute after it then starts once the peer has taken the message),
and keeps it when the schedule still runs to the end with those waits (`runs_with_waits`, the
validator's sweep with one more blocking condition); otherwise it falls back to the waits the
clocks prove, which never block on a peer. The pipeline engine uses it to free stage outputs once
their send has completed (`mp_toolkit.engine.executor`).
"""
from __future__ import annotations

from collections import defaultdict

from .actions import Action, Kind, Schedule

__all__ = ["comm_batches", "runs_with_waits", "send_waits", "sends_known_received"]

Plan = list[dict[int, list[int]]]  # per rank: {last position of a comm batch: send positions to wait for}


def comm_batches(actions: tuple[Action, ...] | list[Action]) -> list[tuple[int, int]]:
    """``(first, last)`` positions of each maximal run of consecutive comm actions."""
    out, i = [], 0
    while i < len(actions):
        j = i
        while j < len(actions) and actions[j].kind.is_comm:
            j += 1
        if j > i:
            out.append((i, j - 1))
            i = j
        else:
            i += 1
    return out


def _pairs(schedule: Schedule) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((sending rank, position), (receiving rank, position)) of every message, paired in FIFO
    order per channel."""
    owner = schedule.stage_to_rank
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, acts in enumerate(schedule.actions):
        for pos, a in enumerate(acts):
            if a.kind.is_send:
                sends[(rank, owner[a.peer_stage])].append(pos)
            elif a.kind.is_recv:
                recvs[(owner[a.peer_stage], rank)].append(pos)
    return [((src, s), (dst, r)) for (src, dst), ss in sends.items() for s, r in zip(ss, recvs[(src, dst)])]


def send_waits(schedule: Schedule) -> Plan:
    """Per rank: {last position of a comm batch: positions of its forward sends (``SEND_F``) to wait
    for once that batch's receives are done}, deadlock-free by construction (module docstring)."""
    eager: Plan = []
    for acts in schedule.actions:
        plan = {}
        for first, last in comm_batches(acts):
            sends = [p for p in range(first, last + 1) if acts[p].kind is Kind.SEND_F]
            if sends:
                plan[last] = sends
        eager.append(plan)
    if runs_with_waits(schedule, eager):
        return eager
    proven = []
    for acts, plan in zip(schedule.actions, sends_known_received(schedule)):
        forward = {last: [p for p in sends if acts[p].kind is Kind.SEND_F] for last, sends in plan.items()}
        proven.append({last: sends for last, sends in forward.items() if sends})
    return proven


def runs_with_waits(schedule: Schedule, plan: Plan) -> bool:
    """Whether every rank reaches its end when, besides waiting for its receives, it leaves a batch
    only once the receives matching the sends ``plan`` names for it have been posted."""
    pairs = _pairs(schedule)
    receiver, sender = dict(pairs), {r: s for s, r in pairs}
    posted: set[tuple[int, int]] = set()  # (rank, position) of every operation posted so far

    def post(rank: int, positions: range) -> None:
        posted.update((rank, p) for p in positions)

    def ready(rank: int, positions: range) -> bool:
        acts = schedule.actions[rank]
        needs = [sender[(rank, p)] for p in positions if acts[p].kind.is_recv]
        needs += [receiver[(rank, p)] for p in plan[rank].get(positions[-1], ())]
        return all(op in posted for op in needs)

    return _sweep(schedule, post, ready, lambda rank, positions: None)


def sends_known_received(schedule: Schedule) -> Plan:
    """Per rank: {position of a batch's last action: positions of this rank's sends whose matching
    receive is known posted once that batch's receives have completed}.

    A send not listed (no proof before the rank's last batch) is waited for at the end of the step,
    as before. The schedule is assumed valid (`validate`).
    """
    n = schedule.num_ranks
    pairs = _pairs(schedule)
    receiver, sender = dict(pairs), {r: s for s, r in pairs}
    clock = [[0] * n for _ in range(n)]
    carried: dict[tuple[int, int], list[int]] = {}  # send -> its rank's clock when it was posted
    pending: list[list[int]] = [[] for _ in range(n)]  # send positions not yet known received
    plan: Plan = [{} for _ in range(n)]

    def post(rank: int, positions: range) -> None:  # with what is known now
        clock[rank][rank] = positions[-1] + 1
        for p in positions:
            if schedule.actions[rank][p].kind.is_send:
                carried[(rank, p)] = list(clock[rank])
                pending[rank].append(p)

    def senders(rank: int, positions: range) -> list[tuple[int, int]]:
        return [sender[(rank, p)] for p in positions if schedule.actions[rank][p].kind.is_recv]

    def leave(rank: int, positions: range) -> None:
        for s in senders(rank, positions):
            clock[rank] = [max(a, b) for a, b in zip(clock[rank], carried[s])]
        known = [p for p in pending[rank] if receiver[(rank, p)][1] < clock[rank][receiver[(rank, p)][0]]]
        if known:
            plan[rank][positions[-1]] = known
            pending[rank] = [p for p in pending[rank] if p not in known]

    _sweep(schedule, post, lambda rank, positions: all(s in carried for s in senders(rank, positions)), leave)
    return plan


def _sweep(schedule: Schedule, post, ready, leave) -> bool:
    """`simulate_order`'s sweep, one comm batch at a time: a rank reaching a batch posts all of its
    operations (``post(rank, positions)``), stays while ``ready(rank, positions)`` is false, then
    leaves it (``leave(rank, positions)``). Returns whether every rank reached its end."""
    batches = [comm_batches(acts) for acts in schedule.actions]
    cursor, posted = [0] * schedule.num_ranks, [False] * schedule.num_ranks
    progressed = True
    while progressed:
        progressed = False
        for rank in range(schedule.num_ranks):
            while cursor[rank] < len(batches[rank]):
                first, last = batches[rank][cursor[rank]]
                positions = range(first, last + 1)
                if not posted[rank]:
                    post(rank, positions)
                    posted[rank] = progressed = True
                if not ready(rank, positions):
                    break
                leave(rank, positions)
                cursor[rank] += 1
                posted[rank] = False
    return all(c == len(b) for c, b in zip(cursor, batches))
