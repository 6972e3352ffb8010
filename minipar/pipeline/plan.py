"""A pipeline plan as data: which rank does which stage's work on which micro-batch, when.

An `Action` is (stage, kind, micro-batch) and prints like torch.distributed.pipelining:
`2F0` is stage 2's forward of micro-batch 0; `Action.parse` reads that form back. Kinds
(`ActionKind`): F forward, B full backward, I input-gradient and W weight-gradient (B
split in two, as zero-bubble schedules do), and the communication SEND_F / RECV_F
(activations) and SEND_B / RECV_B (gradients). A `Schedule` holds each rank's ordered
actions; `add_communication` inserts the sends and receives a compute order needs;
`check_structure` checks placement, counts and send/receive matching
(`simulate.validate` adds the deadlock check: a replay).

Placement: with v stages per rank there are p·v stages. Megatron-LM's interleaved
placement loops them over the ranks (stage j on rank j % p); a V (ZB-V, DualPipeV: two
stages per rank) goes down the ranks and back up, so rank r holds stages r and 2p-1-r
and the first and last stages meet on rank 0.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum


class ActionKind(str, Enum):
    """What an action does. Its value is its printed form (torch.distributed.pipelining's),
    so `str(ActionKind.SEND_F)` is "SEND_F" and a kind equals its string."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741  # the zero-bubble paper's B: the input gradient only (PyTorch's I)
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)

    @property
    def carries(self) -> str:
        """A message's direction: "F" for activations (downstream), "B" for gradients."""
        return self.value[-1]


_COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
# longest first, so "SEND_F" is not read as a stage number followed by "S..."
_PRINTED = re.compile(r"(\d+)(" + "|".join(sorted((k.value for k in ActionKind), key=len,
                                                   reverse=True)) + r")(\d+)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: `kind` on `stage` for `microbatch`. A kind given as its
    printed string ("F") is read as that ActionKind."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))  # frozen: set once, here

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action printed as `text` ("2F0", "1SEND_F0"): the inverse of str()."""
        found = _PRINTED.fullmatch(text)
        if found is None:
            raise ValueError(f"{text!r} is not an action: expected stage, kind, micro-batch "
                             f"like '2F0' or '1SEND_F0' (kinds: "
                             f"{', '.join(k.value for k in ActionKind)})")
        return cls(int(found[1]), ActionKind(found[2]), int(found[3]))

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @property
    def peer_stage(self) -> int:
        """The stage a message goes to or comes from: activations flow to stage + 1 and
        gradients to stage - 1."""
        downstream = self.kind in (ActionKind.SEND_F, ActionKind.RECV_B)
        if not (self.kind.is_send or self.kind.is_recv):
            raise ValueError(f"{self} is a computation, not a message: it has no peer")
        return self.stage + 1 if downstream else self.stage - 1


@dataclass
class Schedule:
    """`actions[rank]` is that rank's ordered list of actions; `name` is the schedule
    family that wrote them (`schedules.SCHEDULES`)."""

    name: str
    ranks: int
    microbatches: int
    virtual: int
    actions: list[list[Action]] = field(default_factory=list)
    split_backward: bool = False  # a backward may be I then W instead of B
    placement: str = "loop"  # "loop": stage j on rank j % p; "v": down the ranks and back
    # (F, B) pairs a machine that overlaps them runs as one F&B chunk (DualPipe's); on one
    # CPU thread they run one after the other, with their messages around the pair
    overlapped: frozenset[tuple[Action, Action]] = frozenset()

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        if self.placement == "v":  # down the ranks, then back up: 0, 1, .., p-1, p-1, .., 0
            return stage if stage < self.ranks else 2 * self.ranks - 1 - stage
        return stage % self.ranks  # stage j on rank j % p: Megatron-LM's interleaved placement

    def __str__(self) -> str:
        width = max((len(str(a)) for acts in self.actions for a in acts if a.is_compute),
                    default=3)
        return "\n".join(f"rank {r}: " + " ".join(str(a).ljust(width) for a in acts
                                                   if a.is_compute)
                         for r, acts in enumerate(self.actions))


def add_communication(plan: Schedule, compute: list[list[Action]]) -> list[list[Action]]:
    """Receive what a compute action needs just before it; send what it produced just after.
    An overlapped (F, B) pair (`plan.overlapped`) is one chunk: both receives before it,
    both sends after, as DualPipe's overlapped chunk communicates. Receives then follow
    their sender's order (`_in_send_order`)."""
    out = []
    for r, order in enumerate(compute):
        actions, i = [], 0
        while i < len(order):
            pair = order[i:i + 2] if tuple(order[i:i + 2]) in plan.overlapped else order[i:i + 1]
            for a in pair:
                actions += _messages(plan, r, a, receives=True)
            actions += pair
            for a in pair:
                actions += _messages(plan, r, a, receives=False)
            i += len(pair)
        out.append(actions)
    return _in_send_order(plan, out)


def _in_send_order(plan: Schedule, actions: list[list[Action]]) -> list[list[Action]]:
    """Messages between two ranks match in the order they were posted, whatever they
    carry (NCCL ignores tags; minipar's tags number a message's segments), so each rank
    receives from a peer in the order that peer sends. Where a compute action needs a
    message the peer sent after others not yet received (in a V, activations and
    gradients cross between the same two ranks out of step), those earlier messages
    are received first and held until their actions."""
    sent: dict[tuple[int, int], list[Action]] = defaultdict(list)  # (src, dst) -> receives
    for r, acts in enumerate(actions):
        for a in acts:
            if a.kind.is_send:
                kind = ActionKind.RECV_F if a.kind == ActionKind.SEND_F else ActionKind.RECV_B
                sent[(r, plan.rank_of(a.peer_stage))].append(Action(a.peer_stage, kind,
                                                                    a.microbatch))
    out = []
    for r, acts in enumerate(actions):
        queue = {src: list(sent[(src, r)]) for src in range(plan.ranks)}
        done: set[Action] = set()
        mine = []
        for a in acts:
            if not a.kind.is_recv:
                mine.append(a)
                continue
            if a in done:
                continue
            line = queue[plan.rank_of(a.peer_stage)]
            upto = line.index(a) + 1 if a in line else 0  # absent: left for the check to name
            mine += line[:upto] or [a]
            done.update(line[:upto])
            del line[:upto]
        out.append(mine)
    return out


def _messages(plan: Schedule, r: int, a: Action, receives: bool) -> list[Action]:
    """The receives compute action `a` on rank r needs, or the sends it makes."""
    last = plan.stages - 1
    # I, like B, produces the input gradient the previous stage waits for; W sends nothing
    backward = a.kind in (ActionKind.B, ActionKind.I)
    forward = a.kind == ActionKind.F
    upstream = a.stage > 0 and plan.rank_of(a.stage - 1) != r
    downstream = a.stage < last and plan.rank_of(a.stage + 1) != r
    if receives:
        wanted = [(forward and upstream, ActionKind.RECV_F),
                  (backward and downstream, ActionKind.RECV_B)]
    else:
        wanted = [(forward and downstream, ActionKind.SEND_F),
                  (backward and upstream, ActionKind.SEND_B)]
    return [Action(a.stage, kind, a.microbatch) for needed, kind in wanted if needed]


def check_structure(plan: Schedule) -> None:
    """Raise ValueError unless every stage does each micro-batch's F before its backward
    (B, or I before W where the plan splits backward), exactly once, on the right rank,
    and sends match receives in order."""
    allowed = (["F", "B"], ["F", "I", "W"]) if plan.split_backward else (["F", "B"],)
    seen: dict[tuple[int, int], list[str]] = defaultdict(list)
    for r, actions in enumerate(plan.actions):
        for a in actions:
            if plan.rank_of(a.stage) != r:
                raise ValueError(f"rank {r} has {a}, but stage {a.stage} lives on rank "
                                 f"{plan.rank_of(a.stage)}")
            if a.is_compute:
                seen[(a.stage, a.microbatch)].append(a.kind.value)
    for stage in range(plan.stages):
        for mb in range(plan.microbatches):
            kinds = seen.get((stage, mb), [])
            if kinds not in allowed:
                raise ValueError(f"stage {stage}, micro-batch {mb}: expected "
                                 f"{' or '.join(' then '.join(k) for k in allowed)}, got "
                                 f"{kinds or 'nothing'}")
    extra = [k for k in seen if not (0 <= k[0] < plan.stages and 0 <= k[1] < plan.microbatches)]
    if extra:
        raise ValueError(f"actions for stages/micro-batches that do not exist: {extra[:3]}")
    # (sender, receiver) -> what it sends, in order: messages between two ranks match in
    # the order posted, activations and gradients alike
    channels: dict[tuple[int, int], list[str]] = defaultdict(list)
    for r, actions in enumerate(plan.actions):
        for a in actions:
            if a.kind.is_send:
                channels[(r, plan.rank_of(a.peer_stage))].append(_message(a.peer_stage, a))
    for r, actions in enumerate(plan.actions):
        for src in range(plan.ranks):
            got = [_message(a.stage, a) for a in actions
                   if a.kind.is_recv and plan.rank_of(a.peer_stage) == src]
            want = channels.get((src, r), [])
            if got != want:
                raise ValueError(f"rank {src} sends rank {r} {want} but rank {r} receives "
                                 f"{got}: sends and receives must match in order")


def _message(stage: int, a: Action) -> str:
    """A message as both ends name it: what it carries, for which stage and micro-batch."""
    what = "activations" if a.kind.carries == "F" else "gradients"
    return f"{what} for stage {stage}, micro-batch {a.microbatch}"


def peak_in_flight(plan: Schedule) -> list[int]:
    """Per rank, the most (stage, micro-batch) activations held at once (after F, until
    the backward that frees them: B, or W where backward is split)."""
    peaks = []
    for actions in plan.actions:
        held = peak = 0
        for a in actions:
            if a.kind == ActionKind.F:
                held += 1
                peak = max(peak, held)
            elif a.kind in (ActionKind.B, ActionKind.W):
                held -= 1
        peaks.append(peak)
    return peaks
