"""A pipeline plan as data: which rank does which stage's work on which micro-batch, when.

An `Action` is (stage, kind, micro-batch) and prints like torch.distributed.pipelining:
`2F0` is stage 2's forward of micro-batch 0; `Action.parse` reads that form back. Kinds
(`ActionKind`): F forward, B full backward, I input-gradient and W weight-gradient (B
split in two, as zero-bubble schedules do), and the communication SEND_F / RECV_F
(activations) and SEND_B / RECV_B (gradients). A `Schedule` holds each rank's ordered
actions; `add_communication` inserts the sends and receives a compute order needs;
`check_structure` checks placement, counts and send/receive matching
(`simulate.validate` adds the deadlock check: a replay).
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
    split_backward: bool = False  # backward as I then W instead of B

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks  # stage j on rank j % p: Megatron-LM's interleaved placement

    def __str__(self) -> str:
        width = max((len(str(a)) for acts in self.actions for a in acts if a.is_compute),
                    default=3)
        return "\n".join(f"rank {r}: " + " ".join(str(a).ljust(width) for a in acts
                                                   if a.is_compute)
                         for r, acts in enumerate(self.actions))


def add_communication(plan: Schedule, compute: list[list[Action]]) -> list[list[Action]]:
    """Receive what a compute action needs just before it; send what it produced just after."""
    F, RECV_F, SEND_F = ActionKind.F, ActionKind.RECV_F, ActionKind.SEND_F
    RECV_B, SEND_B = ActionKind.RECV_B, ActionKind.SEND_B
    last = plan.stages - 1
    out = []
    for r, order in enumerate(compute):
        actions = []
        for a in order:
            # I, like B, produces the input gradient the previous stage waits for; W sends nothing
            backward = a.kind in (ActionKind.B, ActionKind.I)
            if a.kind == F and a.stage > 0 and plan.rank_of(a.stage - 1) != r:
                actions.append(Action(a.stage, RECV_F, a.microbatch))
            if backward and a.stage < last and plan.rank_of(a.stage + 1) != r:
                actions.append(Action(a.stage, RECV_B, a.microbatch))
            actions.append(a)
            if a.kind == F and a.stage < last and plan.rank_of(a.stage + 1) != r:
                actions.append(Action(a.stage, SEND_F, a.microbatch))
            if backward and a.stage > 0 and plan.rank_of(a.stage - 1) != r:
                actions.append(Action(a.stage, SEND_B, a.microbatch))
        out.append(actions)
    return out


def check_structure(plan: Schedule) -> None:
    """Raise ValueError unless every stage does each micro-batch's F before its backward
    (I before W), exactly once, on the right rank, and sends match receives in order."""
    backward = ("I", "W") if plan.split_backward else ("B",)
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
            if kinds != ["F", *backward]:
                raise ValueError(f"stage {stage}, micro-batch {mb}: expected "
                                 f"{' then '.join(['F', *backward])}, got {kinds or 'nothing'}")
    extra = [k for k in seen if not (0 <= k[0] < plan.stages and 0 <= k[1] < plan.microbatches)]
    if extra:
        raise ValueError(f"actions for stages/micro-batches that do not exist: {extra[:3]}")
    # (sender, receiver, "F" or "B") -> (stage received at, micro-batch) in send order
    channels: dict[tuple[int, int, str], list[tuple[int, int]]] = defaultdict(list)
    for r, actions in enumerate(plan.actions):
        for a in actions:
            if a.kind.is_send:
                channels[(r, plan.rank_of(a.peer_stage), a.kind.carries)].append(
                    (a.peer_stage, a.microbatch))
    for r, actions in enumerate(plan.actions):
        for direction in ("F", "B"):
            for src in range(plan.ranks):
                got = [(a.stage, a.microbatch) for a in actions
                       if a.kind.is_recv and a.kind.carries == direction
                       and plan.rank_of(a.peer_stage) == src]
                want = channels.get((src, r, direction), [])
                if got != want:
                    what = "activations" if direction == "F" else "gradients"
                    raise ValueError(f"rank {src} sends {what} to rank {r} for (stage, "
                                     f"micro-batch) {want} but rank {r} receives {got}: "
                                     "sends and receives must match in order")


def peak_in_flight(plan: Schedule) -> list[int]:
    """Per rank, the most micro-batches whose activations are held at once (after F,
    until the backward that frees them: B, or W when backward is split)."""
    frees = ActionKind.W if plan.split_backward else ActionKind.B
    peaks = []
    for actions in plan.actions:
        held = peak = 0
        for a in actions:
            if a.kind == ActionKind.F:
                held += 1
                peak = max(peak, held)
            elif a.kind == frees:
                held -= 1
        peaks.append(peak)
    return peaks
