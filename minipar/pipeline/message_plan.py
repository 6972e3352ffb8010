"""When a pipeline rank posts its messages, so that NCCL can run them.

A plan lists each rank's sends and receives between its compute actions. gloo lets
every message make progress on its own, so any order that gloo completes is fine
there. NCCL runs a rank's batches one after another on one stream, and a send
completes only while its receive runs (collectives/nccl_replay.py). Posting each gap
of the plan as one batch, as Megatron pairs "send forward, receive backward", is
enough for GPipe, 1F1B and ZB-H1. The interleaved, looped and V schedules are not
written in matching rounds: on ZB-V with 2 ranks, rank 0 sends B1 on its own, then
posts "send F3, receive B0", while rank 1 sends B0 on its own, then posts "send F2,
receive B1". Each first batch waits for a receive queued behind the other's.

`message_batches` starts from the gaps, replays the plan under NCCL's rules, and while
a batch is stuck because its send's receive sits behind another batch on the peer,
moves that batch's sends into the rank's next batch. A send may always go later (its
data is ready), a receive may not (the next compute action needs it). The replay
models what the engine does: each batch's receives waited for before the next
compute action (the losses are read after the step), and on the first step
with a batch shape each activation's shape, published by its sender after the
forward and awaited by its receiver before it posts (messages.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..collectives.message_log import Entry, LoggedMessage
from ..collectives.nccl_replay import replay
from .plan import Action, ActionKind, Schedule

Batches = dict[int, list[Action]]  # compute index (or len(actions): the end) -> messages


def gaps(actions: Sequence[Action]) -> Batches:
    """The plan's own grouping: the messages between two compute actions, posted before
    the second (the step's last ones at its end)."""
    out: Batches = {}
    gap: list[Action] = []
    for i, a in enumerate(actions):
        if a.kind.is_compute:
            if gap:
                out[i], gap = gap, []
        else:
            gap.append(a)
    if gap:
        out[len(actions)] = gap
    return out


def shape_key(a: Action) -> str:
    """The name of the activation a SEND_F or RECV_F carries: its sender's stage and
    micro-batch ("0F3" is stage 0's output for micro-batch 3)."""
    stage = a.stage if a.kind == ActionKind.SEND_F else a.peer_stage
    return f"{stage}F{a.microbatch}"


def _logs(plan: Schedule, actions: Sequence[Sequence[Action]], batches: list[Batches],
          shapes_known: bool) -> list[list[Entry]]:
    group = tuple(range(plan.ranks))
    logs = []
    for r, mine in enumerate(actions):
        log: list[Entry] = []
        for i in range(len(mine) + 1):
            batch = batches[r].get(i, [])
            if batch:
                if not shapes_known:
                    log += [Entry("await", "main", "", name=shape_key(a))
                            for a in batch if a.kind == ActionKind.RECV_F]
                messages = tuple(LoggedMessage("send" if a.kind.is_send else "recv",
                                         plan.rank_of(a.peer_stage), 1) for a in batch)
                log.append(Entry("post", "main", f"{r}:{i}", group=group, messages=messages))
                if any(a.kind.is_recv for a in batch):  # the receives, before the compute
                    log.append(Entry("wait", "main", "", request=len(log) - 1))
            if i == len(mine):
                break
            a = mine[i]
            if a.kind == ActionKind.F and a.stage < plan.stages - 1 and not shapes_known:
                log.append(Entry("publish", "main", "", name=f"{a.stage}F{a.microbatch}"))
        logs.append(log)
    return logs


def _move(batches: Batches, at: int, to: int, moving: Sequence[Action]) -> None:
    """Move `moving` from the batch before compute action `at` to the one before `to`."""
    batches[at] = [a for a in batches[at] if a not in moving]
    if not batches[at]:
        del batches[at]
    batches[to] = batches.get(to, []) + list(moving)


def message_batches(plan: Schedule, actions: Sequence[Sequence[Action]] | None = None,
                    tries: int = 400) -> list[Batches] | None:
    """Per rank, the messages to post together before each compute action (index into
    `actions`, the plan's own by default), such that NCCL completes the step with and
    without shapes to learn; None if no such grouping turns up within `tries` replays
    (a depth-first search over the moves each stuck crossing offers)."""
    actions = plan.actions if actions is None else actions
    seen: set = set()
    stack = [[gaps(mine) for mine in actions]]
    while stack and tries > 0:
        batches = stack.pop()
        state = tuple(tuple(sorted((i, tuple(map(str, b))) for i, b in rank.items()))
                      for rank in batches)
        if state in seen:
            continue
        seen.add(state)
        tries -= 1
        moves = _moves(plan, actions, batches)
        if moves is None:
            return batches
        for r, at, to, moving in reversed(moves):  # the first move is tried first
            moved = [dict(rank) for rank in batches]
            _move(moved[r], at, to, moving)
            stack.append(moved)
    return None


def _moves(plan: Schedule, actions: Sequence[Sequence[Action]], batches: list[Batches]
           ) -> list[tuple[int, int, int, list[Action]]] | None:
    """None if the step completes both ways; else the moves that may unstick it: (rank,
    from the batch before compute action, to the one before, the messages moved)."""
    for shapes_known in (False, True):
        logs = _logs(plan, actions, batches, shapes_known)
        outcome = replay(logs, "eager")
        if not outcome.completes:
            break
    else:
        return None
    position = {(r, i): int(e.where.split(":")[1])
                for r, log in enumerate(logs) for i, e in enumerate(log) if e.kind == "post"}
    early, late = [], []
    for q, _, direction, r, wanted in outcome.crossed:
        # rank q's message waits for its match in rank r's batch `wanted`, queued behind
        # r's stuck head batch `mine`
        heads = [position[(r, b)] for rr, b, *_ in outcome.crossed if rr == r]
        if not heads:
            continue
        mine, target = heads[0], position[(r, wanted)]
        match = [a for a in batches[r][target] if plan.rank_of(a.peer_stage) == q
                 and a.kind.is_recv == (direction == "send")]
        if direction == "send" and match and _may_post_at(actions[r], match[0], mine):
            # a receive may be posted earlier, beside r's stuck batch
            early.append((r, target, mine, match[:1]))
        sends = [a for a in batches[r][mine] if a.kind.is_send]
        if sends:
            # a send may go later (its data is ready), into the batch the cycle waits for
            late.append((r, mine, target, sends))
    return early + late


def _may_post_at(actions: Sequence[Action], a: Action, at: int) -> bool:
    """A receive posted before compute action `at`: a gradient's buffer takes the shape of
    its forward's output, which must exist by then."""
    if a.kind != ActionKind.RECV_B:
        return True
    return any(b.kind == ActionKind.F and b.stage == a.stage and b.microbatch == a.microbatch
               for b in actions[:at])
