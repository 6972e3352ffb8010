"""A pipeline plan as data: which rank does which stage's work on which micro-batch, when.

An `Action` is (stage, kind, micro-batch) and prints like torch.distributed.pipelining:
`2F0` is stage 2's forward of micro-batch 0. Kinds: F forward, B full backward,
I input-gradient and W weight-gradient (B split in two, as zero-bubble schedules do),
and the communication SEND_F / RECV_F (activations) and SEND_B / RECV_B (gradients).
A `Schedule` holds each rank's ordered actions; `add_communication` inserts the sends
and receives a compute order needs; `check_structure` checks placement, counts and
send/receive matching (`simulate.validate` adds the deadlock check: a replay).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

COMPUTE = ("F", "B", "I", "W")


COMMUNICATION = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of one rank: `kind` on `stage` for `microbatch`."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


@dataclass
class Schedule:
    """`actions[rank]` is that rank's ordered list of actions."""

    name: str
    ranks: int
    microbatches: int
    virtual: int
    actions: list[list[Action]] = field(default_factory=list)
    split_backward: bool = False  # backward as I then W instead of B
    weight_stashing: bool = False  # PipeDream: each backward uses its forward's weights

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.ranks

    def __str__(self) -> str:
        width = max((len(str(a)) for acts in self.actions for a in acts if a.is_compute),
                    default=3)
        return "\n".join(f"rank {r}: " + " ".join(str(a).ljust(width) for a in acts
                                                   if a.is_compute)
                         for r, acts in enumerate(self.actions))


def add_communication(plan: Schedule, compute: list[list[Action]]) -> list[list[Action]]:
    """Receive what a compute action needs just before it; send what it produced just after."""
    last = plan.stages - 1
    out = []
    for r, order in enumerate(compute):
        actions = []
        for a in order:
            if a.kind == "F" and a.stage > 0 and plan.rank_of(a.stage - 1) != r:
                actions.append(Action(a.stage, "RECV_F", a.microbatch))
            if a.kind in ("B", "I") and a.stage < last and plan.rank_of(a.stage + 1) != r:
                actions.append(Action(a.stage, "RECV_B", a.microbatch))
            actions.append(a)
            if a.kind == "F" and a.stage < last and plan.rank_of(a.stage + 1) != r:
                actions.append(Action(a.stage, "SEND_F", a.microbatch))
            if a.kind in ("B", "I") and a.stage > 0 and plan.rank_of(a.stage - 1) != r:
                actions.append(Action(a.stage, "SEND_B", a.microbatch))
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
                seen[(a.stage, a.microbatch)].append(a.kind)
    for stage in range(plan.stages):
        for mb in range(plan.microbatches):
            kinds = seen.get((stage, mb), [])
            if kinds != ["F", *backward]:
                raise ValueError(f"stage {stage}, micro-batch {mb}: expected "
                                 f"{' then '.join(['F', *backward])}, got {kinds or 'nothing'}")
    extra = [k for k in seen if not (0 <= k[0] < plan.stages and 0 <= k[1] < plan.microbatches)]
    if extra:
        raise ValueError(f"actions for stages/micro-batches that do not exist: {extra[:3]}")
    channels: dict[tuple[int, int, str], list[tuple[int, int]]] = defaultdict(list)
    for r, actions in enumerate(plan.actions):
        for a in actions:
            if a.kind == "SEND_F":
                channels[(r, plan.rank_of(a.stage + 1), "F")].append((a.stage + 1, a.microbatch))
            elif a.kind == "SEND_B":
                channels[(r, plan.rank_of(a.stage - 1), "B")].append((a.stage - 1, a.microbatch))
    for r, actions in enumerate(plan.actions):
        for direction in ("F", "B"):
            for src in range(plan.ranks):
                got = [(a.stage, a.microbatch) for a in actions
                       if a.kind == f"RECV_{direction}"
                       and plan.rank_of(a.stage - 1 if direction == "F" else a.stage + 1) == src]
                want = channels.get((src, r, direction), [])
                if got != want:
                    what = "activations" if direction == "F" else "gradients"
                    raise ValueError(f"rank {src} sends {what} to rank {r} for (stage, "
                                     f"micro-batch) {want} but rank {r} receives {got}: "
                                     "sends and receives must match in order")


def peak_in_flight(plan: Schedule) -> list[int]:
    """Per rank, the most micro-batches whose activations are held at once (after F,
    until the backward that frees them: B, or W when backward is split)."""
    frees = "W" if plan.split_backward else "B"
    peaks = []
    for actions in plan.actions:
        held = peak = 0
        for a in actions:
            if a.kind == "F":
                held += 1
                peak = max(peak, held)
            elif a.kind == frees:
                held -= 1
        peaks.append(peak)
    return peaks
