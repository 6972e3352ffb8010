"""Run a pipeline schedule on real ranks: stages of a model, activations forward,
gradients back, with minipar's metered point-to-point and a recorded Timeline.

Every rank builds the same model, `split_model` cuts it into stages, and each rank
keeps the stages the schedule places on it (stage j on rank j % p). `train_step` then
executes this rank's actions in order: one loop, moving tensors between the actions
(`StepState`) and the ranks (`messages.Messages`), while a `stage.Stage` decides what
each F, B, I and W computes. The schedule's family builds the stages, so a variant
(PipeDream's stashed weights, TeraPipe's carried state) lives in its own file; extra
work between actions (PipeFisher's K-FAC) comes in through `fill_bubbles`.

Data parallelism inside the pipeline (`reduce_gradients_with`): a stage's backward adds
into .grad, so a data-parallel wrapper's hooks fire in it. Each stage's gradients are
reduced once per optimizer step: every B or W of the stage runs under the wrapper's
`no_sync(stage)` except the stage's last one in a step called with `sync=True`, where
the reduction starts inside that backward (Megatron-LM and picotron do the same per
model chunk). Zero-bubble's I computes no weight gradient, so it needs no such care.

Loss-scaling convention (as in data_parallel): the batch is split into micro-batches
with torch.tensor_split, and micro-batch i's mean loss is weighted by n_i / N, so the
summed loss is the mean over the whole batch and every gradient equals the
single-process gradient of that mean (exact up to float rounding; tests use float64
and rtol 1e-10).

Each stage's input is a detached leaf that requires grad, so a backward pass stops
at the stage boundary and its input gradient is what travels back. With the backward
split (zero bubble), I computes only that input gradient and W only the weight
gradients, both from the same retained graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import rank, world_size
from ..trace import record
from .family import SCHEDULES, ScheduleFamily
from .message_plan import gaps, message_batches
from .messages import Messages
from .plan import Action, ActionKind, Schedule
from .stage import SavedActivationMeter, Stage

_BATCHES: dict = {}  # every rank's actions -> message_plan's grouping of their messages
# Pipelines this process has built: with the group's ranks, the same name on every rank
# of one pipeline (each builds the same ones, in the same order), where shapes are published
_BUILT = itertools.count()

Key = tuple[int, int]  # (stage, micro-batch)


def split_model(model: nn.Sequential | Sequence[nn.Module], stages: int,
                boundaries: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut a sequence of layers into `stages` contiguous stages.

    `boundaries` gives the index of each stage's first layer after the first (len
    stages - 1); without it, stages are balanced by parameter count (the split
    minimizing the largest stage, by dynamic programming).
    """
    layers = list(model)
    n = len(layers)
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= n:
        raise ValueError(f"stages must be an int from 1 to the number of layers ({n}); "
                         f"got {stages!r}")
    if boundaries is None:
        boundaries = _balanced_boundaries([sum(p.numel() for p in layer.parameters())
                                           for layer in layers], stages)
    cuts = [0, *boundaries, n]
    if len(cuts) != stages + 1 or any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):
        raise ValueError(f"boundaries must be {stages - 1} increasing layer indices in 1..{n - 1}; "
                         f"got {list(boundaries)}")
    return [nn.Sequential(*layers[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]


def _balanced_boundaries(weights: list[int], stages: int) -> list[int]:
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][i]: first i layers, k stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        bounds.append(i)
    return sorted(bounds)


class ExtraWork(Protocol):
    """Work a rank does between its actions (PipeFisher's K-FAC in the bubbles,
    `pipefisher.BubbleWork`): `before(index, action)` runs before each action."""

    def before(self, index: int, action: Action) -> None: ...


class GradientSync(Protocol):
    """A data-parallel wrapper over each stage (`mesh.StageDataParallel`): under
    `no_sync(stage)` a backward of that stage accumulates without reducing."""

    def no_sync(self, stage: int) -> AbstractContextManager: ...


@dataclass
class StepState:
    """What one train_step keeps between actions, keyed by (stage, micro-batch), named by
    the way the data flows: activations come in and go out, gradients come in from
    downstream and go up to the previous stage."""

    inputs: Sequence[torch.Tensor]  # the micro-batches (stage 0's inputs)
    targets: Sequence[torch.Tensor]
    loss_weights: list[float]  # n_i / N: the loss-scaling convention above
    # received from the previous stage's rank (or handed on by it here), awaiting F
    activations_in: dict[Key, torch.Tensor] = field(default_factory=dict)
    stage_inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # F's input, a leaf
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # F's output: B's root
    losses: dict[Key, torch.Tensor] = field(default_factory=dict)  # last stage: B's root
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # d loss / d output
    grads_to_send: dict[Key, torch.Tensor] = field(default_factory=dict)  # d loss / d input
    loss_values: list[torch.Tensor] = field(default_factory=list)  # read after the step
    reduce_at: set[int] = field(default_factory=set)  # actions whose backward reduces (dp)


class Pipeline:
    """This rank's stages of a model and the schedule that drives them. With `group` (a
    mesh's pipeline dimension) the schedule's ranks are the ranks of that group.

    The schedule's family makes each Stage (`lr` is for families whose stages update
    their weights themselves, as PipeDream's); `make_stage(module, index)` replaces it
    (e.g. a Stage subclass wrapping forward for recomputation). Messages: see
    messages.py: the messages between two compute actions go as one batch."""

    def __init__(self, stage_modules: Sequence[nn.Module], plan: Schedule,
                 lr: float | None = None, group: dist.ProcessGroup | None = None,
                 make_stage: Callable[[nn.Module, int], Stage] | None = None,
                 measure_activations: bool = False) -> None:
        if len(stage_modules) != plan.stages:
            raise ValueError(f"the schedule has {plan.stages} stages but {len(stage_modules)} "
                             "stage modules were given; split the model into that many")
        if make_stage is None:  # a plan written by hand (an exercise's) runs plain stages
            family = SCHEDULES.get(plan.name, ScheduleFamily())
            make_stage = lambda module, index: family.stage(module, index, lr)  # noqa: E731
        self.plan, self.rank, self.group = plan, rank(group), group
        if world_size(group) != plan.ranks:
            raise ValueError(f"the schedule places its stages on {plan.ranks} ranks but the "
                             f"pipeline group has {world_size(group)}; build the schedule for "
                             f"{world_size(group)} ranks")
        self.modules = {s: m for s, m in enumerate(stage_modules) if plan.rank_of(s) == self.rank}
        self.stages = {s: make_stage(m, s) for s, m in self.modules.items()}
        self.dtype = next((p.dtype for m in self.modules.values() for p in m.parameters()),
                          torch.float32)
        self.activations = SavedActivationMeter({p.untyped_storage().data_ptr()
                                                 for p in self.parameters()})
        # opt-in: the meter's hooks run on every tensor autograd saves, a cost each timed
        # step would pay (the trainer turns it on for its memory step alone)
        self.measure_activations = measure_activations
        self.extra_work: ExtraWork | None = None
        self.gradient_sync: GradientSync | None = None
        self._shapes: dict = {}  # (batch shape, dtype, sizes) -> message shapes (Messages)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD) \
            if dist.is_initialized() else [0]
        self.serial = f"{next(_BUILT)}@{'-'.join(map(str, ranks))}"

    def fill_bubbles(self, work: ExtraWork | None) -> None:
        """Run `work.before(index, action)` before each of this rank's actions: extra work
        in the time the rank would otherwise wait (PipeFisher). None turns it off."""
        self.extra_work = work

    def reduce_gradients_with(self, sync: GradientSync | None) -> None:
        """Let `sync` (data parallelism over each stage) reduce each stage's gradients in
        the stage's last backward of a step called with sync=True (module docstring)."""
        self.gradient_sync = sync

    def parameters(self) -> list[nn.Parameter]:
        return [p for s in sorted(self.modules) for p in self.modules[s].parameters()]

    def train_step(self, batch: torch.Tensor, target: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   sizes: Sequence[int] | None = None, sync: bool = True) -> float | None:
        """Run this rank's actions for one batch; gradients accumulate into .grad (unless
        the stages update the weights themselves, as PipeDream's do with lr). `sizes` cuts
        the batch (dim 0) into micro-batches of those lengths instead of tensor_split's
        even ones. `sync=False` holds the data-parallel reduction (an accumulation step
        before the optimizer's last one; see `reduce_gradients_with`). Returns the batch's
        mean loss on the rank holding the last stage, else None."""
        return self._step(batch, target, loss_fn, sizes, forward_only=False, sync=sync)

    @torch.no_grad()
    def evaluate(self, batch: torch.Tensor, target: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float | None:
        """The batch's mean loss with no backward and no gradients (a validation loss), on
        the rank holding the last stage, else None: the schedule's forward actions alone,
        in the schedule's order, for synchronous schedules (a stage that updates or stashes
        weights in forward, as PipeDream's, is refused). Dropping the backward actions only
        removes waits, and the forward messages between any two ranks keep their order, so
        it cannot deadlock. Extra work (PipeFisher's) does not run."""
        if not all(stage.pure_forward for stage in self.stages.values()):
            raise ValueError(f"{self.plan.name!r} stages change state in forward; evaluate "
                             "runs synchronous schedules' plain stages only")
        return self._step(batch, target, loss_fn, None, forward_only=True, sync=False)

    def _step(self, batch: torch.Tensor, target: torch.Tensor,
              loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              sizes: Sequence[int] | None, forward_only: bool, sync: bool) -> float | None:
        m = self.plan.microbatches
        if batch.shape[0] < m:
            raise ValueError(f"a batch of {batch.shape[0]} samples cannot make {m} micro-batches")
        if sizes is not None and (len(sizes) != m or sum(sizes) != batch.shape[0]
                                  or min(sizes) < 1):
            raise ValueError(f"sizes must be {m} positive lengths adding up to the batch's "
                             f"{batch.shape[0]}; got {list(sizes)}")
        inputs = torch.split(batch, list(sizes)) if sizes else torch.tensor_split(batch, m)
        targets = torch.split(target, list(sizes)) if sizes else torch.tensor_split(target, m)
        state = StepState(inputs, targets, [len(x) / len(batch) for x in inputs])
        every = self.plan.actions
        if forward_only:
            every = [[a for a in mine if a.kind in (ActionKind.F, ActionKind.SEND_F,
                                                    ActionKind.RECV_F)] for mine in every]
        actions = every[self.rank]
        batches = self._message_batches(every)
        if sync and self.gradient_sync is not None:
            # each stage's last weight-gradient action: where its reduction starts
            last = {a.stage: i for i, a in enumerate(actions)
                    if a.kind in (ActionKind.B, ActionKind.W)}
            state.reduce_at = set(last.values())
        # the message shapes learnt depend on the batch and on which actions run
        key = (tuple(batch.shape), batch.dtype, tuple(sizes) if sizes else None, forward_only)
        messages = Messages(self.plan, self.group, self.dtype, self._shapes.get(key),
                            f"{self.serial}/{len(self._shapes)}")
        for index, action in enumerate(actions):
            if self.extra_work is not None and not forward_only:
                self.extra_work.before(index, action)
            if index in batches:
                self._exchange(batches[index], state, messages)
            if action.kind.is_compute:
                self._run(index, action, state, loss_fn, messages)
        if len(actions) in batches:
            self._exchange(batches[len(actions)], state, messages)
        self._shapes[key] = messages.finish()
        # read on the host once the step's messages are done: an .item() per micro-batch
        # would stop the host mid-step until the device caught up
        return sum(v.item() for v in state.loss_values) if state.loss_values else None

    def _message_batches(self, every: list[list[Action]]) -> dict[int, list[Action]]:
        """This rank's messages to post together before each compute action (its index;
        the step's last ones at len(actions)): message_plan.py's grouping for NCCL, found
        once per plan and kept."""
        key = tuple(tuple(map(str, mine)) for mine in every)
        if key not in _BATCHES:
            found = message_batches(self.plan, every)
            if found is None and dist.is_initialized() and \
                    dist.get_backend(self.group) == "nccl":
                raise ValueError(f"no grouping of schedule {self.plan.name!r}'s messages "
                                 f"on {self.plan.ranks} ranks with {self.plan.microbatches} "
                                 "micro-batches that NCCL can run was found; run it on gloo "
                                 "or pick another schedule")
            _BATCHES[key] = found or [gaps(mine) for mine in every]  # gloo runs any order
        return _BATCHES[key][self.rank]

    @staticmethod
    def _exchange(gap: list[Action], st: StepState, messages: Messages) -> None:
        """One batch of messages: what it sends, taken from the step's state, and what
        it receives, filed there for the compute actions that follow."""
        outgoing, likes = {}, {}
        for a in gap:
            key = (a.stage, a.microbatch)
            if a.kind == ActionKind.SEND_F:
                outgoing[a] = st.outputs[key].detach()
            elif a.kind == ActionKind.SEND_B:
                outgoing[a] = st.grads_to_send.pop(key)
            elif a.kind == ActionKind.RECV_B:
                likes[a] = st.outputs[key]
        for a, tensor in messages.exchange(gap, outgoing, likes).items():
            key = (a.stage, a.microbatch)
            store = st.activations_in if a.kind == ActionKind.RECV_F else st.output_grads
            store[key] = tensor

    def _run(self, index: int, a: Action, st: StepState,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             messages: Messages) -> None:
        if a.kind == ActionKind.F:
            with record(a.kind.value, str(a), stage=a.stage, microbatch=a.microbatch):
                self._forward(a, st, loss_fn)
            if a.stage < self.plan.stages - 1 and self.plan.rank_of(a.stage + 1) != self.rank:
                messages.publish(a, st.outputs[(a.stage, a.microbatch)])
        else:
            hold = (self.gradient_sync.no_sync(a.stage)
                    if self.gradient_sync is not None and index not in st.reduce_at
                    else nullcontext())
            with record(a.kind.value, str(a), stage=a.stage, microbatch=a.microbatch), hold:
                self._backward(a, st)

    def _forward(self, a: Action, st: StepState,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        key, last = (a.stage, a.microbatch), self.plan.stages - 1
        if a.stage == 0:
            x = st.inputs[a.microbatch]
        else:  # a leaf: backward stops here, and its gradient is what travels back
            x = st.activations_in.pop(key).requires_grad_(True)
        with self.activations.recording() if self.measure_activations else nullcontext():
            out = self.stages[a.stage].forward(x, a.microbatch)
            if a.stage == last:
                loss = loss_fn(out, st.targets[a.microbatch]) * st.loss_weights[a.microbatch]
                st.loss_values.append(loss.detach())
                st.losses[key] = loss
        st.stage_inputs[key], st.outputs[key] = x, out
        if a.stage < last and self.plan.rank_of(a.stage + 1) == self.rank:
            st.activations_in[(a.stage + 1, a.microbatch)] = out.detach()  # no message

    def _backward(self, a: Action, st: StepState) -> None:
        key, last = (a.stage, a.microbatch), self.plan.stages - 1
        stage = self.stages[a.stage]
        root, grad_out = (st.losses[key], None) if a.stage == last \
            else (st.outputs[key], st.output_grads[key])
        x = st.stage_inputs[key]
        x = x if x.requires_grad else None  # stage 0's input is data: nothing to send back
        if a.kind == ActionKind.B:
            grad_x = stage.backward(a.microbatch, root, grad_out, x)
        elif a.kind == ActionKind.I:
            grad_x = stage.backward_input(a.microbatch, root, grad_out, x)
        else:
            grad_x = stage.backward_weight(a.microbatch, root, grad_out)
        if grad_x is not None:
            if a.stage > 0 and self.plan.rank_of(a.stage - 1) == self.rank:  # previous stage here
                st.output_grads[(a.stage - 1, a.microbatch)] = grad_x
            else:
                st.grads_to_send[key] = grad_x
        if a.kind in (ActionKind.B, ActionKind.W):  # the micro-batch is done on this stage
            for store in (st.outputs, st.stage_inputs, st.output_grads, st.losses):
                store.pop(key, None)
