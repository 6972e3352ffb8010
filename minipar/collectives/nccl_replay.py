"""NCCL's rules, replayed over the messages gloo ranks recorded (collectives/message_log.py).

gloo matches a message by its peer and tag over one connection per pair, and every
request makes progress on its own. NCCL does not, and a test on gloo ranks cannot see
the difference: a pipeline or a ring that completes on gloo can hang on GPUs. This
module replays each rank's log under the rules of torch 2.13's ProcessGroupNCCL and
says whether the run would complete, and if not, why, with the lines involved.

The rules, and where they come from:
1. A batch (`batch_isend_irecv`) and every collective go on the group's communicator.
   A message posted on its own (`dist.isend`, `dist.send`) goes, in "lazy" mode, on a
   2-rank communicator for that pair, made at first use (ProcessGroupNCCL.cpp,
   `pointToPoint`: the key is `getKeySendRecv(rank, peer)`, "for single P2P, preserve
   the old two-rank behavior"). In "eager" mode, when `init_process_group` was given a
   `device_id`, it goes on the group's communicator too (the communicator is bound
   before any message, so `pointToPoint` reuses it). Messages on different
   communicators never meet.
2. Each communicator has one stream, and its operations run in the order they were
   posted (ProcessGroupNCCL's per-device `ncclStreams_`; NCCL's documentation,
   "Point-to-point communication": operations on a communicator are ordered).
3. A send completes only while its receive runs: sends and receives that must progress
   together must be in one group (NCCL's documentation, "Group calls"; NVIDIA/nccl
   issues 479 and 783). One batch is one group: its operations run together. This is
   the safe side: NCCL may finish a small send early from its buffers, so a hang the
   replay finds may depend on the message's size on real GPUs.
4. Making a communicator blocks the host until every member joins (`ncclCommInitRank`
   "implicitly synchronizes with other ranks"; pytorch/pytorch#108378). In "lazy" mode
   each communicator is made at its first use; in "eager" mode the group's exist
   before the first message.
5. `work.wait()` does not block the host: it makes the calling thread's stream wait,
   and an operation posted after it on that stream starts only when the waited one is
   done (ProcessGroupNCCL enqueues on its stream after the current stream). A host sync
   (`.item()`, a copy to the host, a barrier) blocks the host until every request its
   thread waited for is done.

Signals outside the network (a key in the rendezvous store, "publish" and "await") block
only the host that awaits them.

Limits: each rank's threads are replayed in the order they were logged, a thread
stands for a stream of its own, and sizes are not modelled (rule 3's safe side).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from .message_log import Entry

MODES = ("lazy", "eager")


@dataclass
class _Op:
    rank: int
    direction: str  # "send", "recv" or "collective"
    peer: int
    key: tuple  # what it meets: (comm, src, dst, n) or (comm, "collective", n)
    where: str
    done: bool = False


@dataclass
class _Batch:
    rank: int
    comm: tuple
    request: int
    ops: list[_Op]
    deps: frozenset  # requests this batch's stream waited for before it was posted
    where: str


@dataclass
class Outcome:
    """How a replay ended: `completes`, or the `pattern` that stopped it ("different
    communicators", "communicator creation cycle", "crossing" or "deadlock") and one
    line per stuck rank. `mismatched` counts messages whose two ends went on different
    communicators."""

    mode: str
    completes: bool
    pattern: str
    mismatched: int
    lines: list[str] = field(default_factory=list)
    # each stuck message whose match is queued behind another batch on the peer:
    # (rank, its batch's entry index, "send" or "recv", peer, the entry index of the
    # peer's batch holding the match), what a scheduler may move (pipeline/message_plan.py)
    crossed: list[tuple[int, int, str, int, int]] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"{self.mode}: {'completes' if self.completes else self.pattern}"
        if self.mismatched:
            head += f" ({self.mismatched} message(s) on different communicators)"
        return "\n  ".join([head, *self.lines])


def _comm(entry: Entry, rank: int, mode: str) -> tuple:
    if entry.kind == "post" and not entry.batched and mode == "lazy":
        peer = entry.messages[0].peer
        return ("pair", entry.group, min(rank, peer), max(rank, peer))
    return ("group", entry.group)


def _members(comm: tuple) -> set[int]:
    return set(comm[2:]) if comm[0] == "pair" else set(comm[1])


def _describe(comm: tuple) -> str:
    if comm[0] == "pair":
        return f"the pair communicator ({comm[2]}, {comm[3]})"
    return f"the communicator of group {list(comm[1])}"


def mismatches(logs: list[list[Entry]], mode: str = "lazy") -> list[str]:
    """Messages whose sender and receiver put them on different communicators: the
    n-th message from a to b, on each end."""
    ends: dict[tuple, list] = defaultdict(list)
    for rank, log in enumerate(logs):
        for e in log:
            if e.kind != "post":
                continue
            for m in e.messages:
                pair = (rank, m.peer) if m.direction == "send" else (m.peer, rank)
                ends[(*pair, m.direction)].append((_comm(e, rank, mode)[0], e.where))
    lines = []
    for (src, dst, direction), sent in ends.items():
        if direction != "send":
            continue
        for (kind_s, where_s), (kind_r, where_r) in zip(sent, ends[(src, dst, "recv")],
                                                             strict=False):
            if kind_s != kind_r:
                lines.append(f"rank {src} sends at {where_s} on its {kind_s} communicator; "
                             f"rank {dst} receives at {where_r} on its {kind_r}'s")
    return lines


def replay(logs: list[list[Entry]], mode: str = "lazy") -> Outcome:
    """Run every rank's log under NCCL's rules (the module docstring); say how it ends."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    k = len(logs)
    at = [0] * k  # the next entry of each rank's host
    created: set[tuple] = set()
    joined: dict[tuple, set[int]] = defaultdict(set)
    queues: dict[tuple, deque[_Batch]] = defaultdict(deque)  # (comm, rank) -> batches
    counts: dict[tuple, int] = defaultdict(int)
    waited: dict[tuple, set] = defaultdict(set)  # (rank, thread) -> requests waited for
    done: set[tuple] = set()  # (rank, request)
    blocked: list[str | None] = [None] * k
    published: set[str] = set()

    def post(rank: int, index: int, e: Entry, comm: tuple) -> None:
        ops = []
        if e.kind == "collective":
            n = counts[(comm, rank, "collective")]
            counts[(comm, rank, "collective")] += 1
            ops.append(_Op(rank, "collective", -1, (comm, "collective", n), e.where))
        for m in e.messages:
            src, dst = (rank, m.peer) if m.direction == "send" else (m.peer, rank)
            n = counts[(comm, src, dst, m.direction)]
            counts[(comm, src, dst, m.direction)] += 1
            ops.append(_Op(rank, m.direction, m.peer, (comm, src, dst, n), e.where))
        queues[(comm, rank)].append(
            _Batch(rank, comm, index, ops, frozenset(waited[(rank, e.thread)]), e.where))

    def host(rank: int) -> bool:
        moved = False
        log = logs[rank]
        while at[rank] < len(log):
            e = log[at[rank]]
            if e.kind in ("post", "collective"):
                comm = _comm(e, rank, mode)
                needs_making = comm not in created and (mode == "lazy" or comm[0] == "pair")
                if needs_making:
                    joined[comm].add(rank)
                    if not _members(comm) <= joined[comm]:
                        missing = sorted(_members(comm) - joined[comm])
                        blocked[rank] = (f"rank {rank}: making {_describe(comm)} at {e.where}, "
                                         f"waiting for rank(s) {missing} to join")
                        return moved
                    created.add(comm)
                post(rank, at[rank], e, comm)
            elif e.kind == "wait":
                waited[(rank, e.thread)].add(e.request)
            elif e.kind == "publish":
                published.add(e.name)
            elif e.kind == "await" and e.name not in published:
                blocked[rank] = f"rank {rank}: waits at {e.where} for {e.name!r} to be published"
                return moved
            elif e.kind == "sync":
                pending = waited[(rank, e.thread)] - {r for q, r in done if q == rank}
                if pending:
                    first = logs[rank][min(pending)]
                    blocked[rank] = (f"rank {rank}: host sync ({e.name}) at {e.where} waits "
                                     f"for the request posted at {first.where}")
                    return moved
            blocked[rank] = None
            at[rank] += 1
            moved = True
        return moved

    def head(comm: tuple, rank: int) -> _Batch | None:
        q = queues.get((comm, rank))
        if not q:
            return None
        b = q[0]
        return b if all((b.rank, r) in done for r in b.deps) else None

    def device() -> bool:
        moved = False
        for (comm, rank), q in list(queues.items()):
            b = head(comm, rank)
            if b is None:
                continue
            for op in b.ops:
                if op.done:
                    continue
                if op.direction == "collective":
                    heads = [head(comm, r) for r in comm[1]]
                    if all(h is not None and any(o.key == op.key for o in h.ops)
                           for h in heads):
                        for h in heads:
                            for o in h.ops:
                                o.done = o.done or o.key == op.key
                        moved = True
                    continue
                peer = head(comm, op.peer)
                match = None if peer is None else next(
                    (o for o in peer.ops if o.key == op.key and o.direction != op.direction),
                    None)
                if match is not None:
                    op.done = match.done = moved = True
            if all(op.done for op in b.ops):
                q.popleft()
                done.add((rank, b.request))
                moved = True
        return moved

    while True:
        progressed = any([host(r) for r in range(k)])
        progressed = device() or progressed
        if not progressed:
            break
    unmatched = mismatches(logs, mode)
    stuck = [r for r in range(k) if at[r] < len(logs[r])] + \
        [r for (_, r), q in queues.items() if q]
    if not stuck:
        return Outcome(mode, True, "completes", len(unmatched))
    return _diagnose(mode, logs, blocked, queues, unmatched)


def _diagnose(mode: str, logs, blocked, queues, unmatched: list[str]) -> Outcome:
    lines, crossed = [], []
    for line in blocked:
        if line is not None:
            lines.append(line)
    for (comm, rank), q in sorted(queues.items(), key=lambda kv: kv[0][1]):
        if not q:
            continue
        b = q[0]
        for op in (o for o in b.ops if not o.done):
            if op.direction == "collective":
                lines.append(f"rank {rank}: collective at {op.where} on {_describe(comm)} "
                             "waits for a member")
                continue
            theirs = queues.get((comm, op.peer), deque())
            way = f"{op.direction} {'to' if op.direction == 'send' else 'from'} rank {op.peer}"
            ahead = next((i for i, pb in enumerate(theirs)
                          if any(o.key == op.key for o in pb.ops)), None)
            if ahead:
                crossed.append((rank, b.request, op.direction, op.peer, theirs[ahead].request))
                lines.append(f"rank {rank}: {way} at {op.where} waits for its match at "
                             f"{theirs[ahead].where}, queued behind rank {op.peer}'s "
                             f"{theirs[0].where} on {_describe(comm)}")
            elif ahead is None:
                lines.append(f"rank {rank}: {way} at {op.where} on {_describe(comm)}: no match "
                             "was posted there")
    if unmatched:
        pattern = "different communicators"
        lines = unmatched[:4] + lines
    elif any(line and "making" in line for line in blocked) and \
            all(line is None or "making" in line for line in blocked):
        pattern = "communicator creation cycle"
    elif crossed:
        pattern = "crossing"
    else:
        pattern = "deadlock"
    return Outcome(mode, False, pattern, len(unmatched), lines, crossed)
