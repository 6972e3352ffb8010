"""Run a pipeline schedule on real ranks: stages of a model, activations forward,
gradients back, with minipar's metered point-to-point and a recorded Timeline.

Every rank builds the same model, `split_model` cuts it into stages, and each rank
keeps the stages the schedule places on it (stage j on rank j % p). `train_step` then
executes this rank's actions in order.

Loss-scaling convention (as in data_parallel): the batch is split into micro-batches
with torch.tensor_split, and micro-batch i's mean loss is weighted by n_i / N, so the
summed loss is the mean over the whole batch and every gradient equals the
single-process gradient of that mean (exact up to float rounding; tests use float64
and rtol 1e-10).

Each stage's input is a detached leaf that requires grad, so a backward pass stops
at the stage boundary and its input gradient is what travels back. With the backward
split (zero bubble), I computes only that input gradient and W only the weight
gradients, both from the same retained graph.

A stage whose micro-batches share state (TeraPipe's slices of one sequence share a
key/value cache) may define `carried_state(mb) -> (roots, root_grads, leaves)` and
`take_gradients(mb, grads)`: B then also back-propagates the extra roots and hands the
stage the gradients of the extra leaves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from .. import collectives
from ..runtime import rank, world_size
from ..trace import record
from .plan import Action, Schedule

_HEADER = 9  # ndim + up to 8 dimensions, sent before an activation of unknown shape


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


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivationMeter:
    """Bytes of tensors autograd keeps for backward (parameters excluded; a storage saved
    by several nodes counts once), now and at peak: the activation memory a schedule
    really holds, measured rather than counted."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude, self.now, self.peak = exclude, 0, 0
        self._refs: dict[tuple[int, int], int] = {}

    def pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self.exclude:
            return tensor
        key = (tensor.data_ptr(), tensor.numel())  # a micro-batch view counts its own bytes
        nbytes = tensor.numel() * tensor.element_size()
        if self._refs.get(key, 0) == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self._refs[key] = self._refs.get(key, 0) + 1
        held = _Held(tensor)
        weakref.finalize(held, self._release, key, nbytes)
        return held

    def _release(self, key: tuple[int, int], nbytes: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.now -= nbytes
            del self._refs[key]

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held


class Pipeline:
    """This rank's stages of a model and the schedule that drives them. With `group` (a
    mesh's pipeline dimension) the schedule's ranks are the ranks of that group.

    Messages: the first step with a given batch shape sends each activation's shape
    ahead of it; later steps know every message's shape, send none, and (with
    `post_receives_ahead`) post each receive before the compute action it follows, so
    the data lands while the rank computes instead of while it waits."""

    def __init__(self, stage_modules: Sequence[nn.Module], plan: Schedule,
                 lr: float | None = None, group=None, post_receives_ahead: bool = True) -> None:
        if len(stage_modules) != plan.stages:
            raise ValueError(f"the schedule has {plan.stages} stages but {len(stage_modules)} "
                             "stage modules were given; split the model into that many")
        if plan.weight_stashing and (lr is None or lr <= 0):
            raise ValueError("'pipedream' updates the weights after every micro-batch's "
                             "backward: pass lr > 0 (the SGD learning rate)")
        self.plan, self.rank, self.lr, self.group = plan, rank(group), lr, group
        if world_size(group) != plan.ranks:
            raise ValueError(f"the schedule places its stages on {plan.ranks} ranks but the "
                             f"pipeline group has {world_size(group)}; build the schedule for "
                             f"{world_size(group)} ranks")
        self.version: dict[int, int] = {s: 0 for s in range(plan.stages)}
        self.versions_used: dict[tuple[int, int], tuple[int, int]] = {}
        self.modules = {s: m for s, m in enumerate(stage_modules) if plan.rank_of(s) == self.rank}
        # versions_used[(stage, mb)] = (weights version its forward ran on, live version
        # when its backward ran): the gap is PipeDream's staleness, hidden by the stash
        self.dtype = next((p.dtype for m in self.modules.values() for p in m.parameters()),
                          torch.float32)
        self.activations = SavedActivationMeter({p.untyped_storage().data_ptr()
                                                 for p in self.parameters()})
        self.post_ahead = post_receives_ahead
        self._bubble_work: Callable[[float], float] | None = None
        self._budgets: dict[int, float] = {}
        self._shapes: dict = {}  # (batch shape, dtype, sizes) -> message shapes (_StepState)

    def fill_bubbles(self, work: Callable[[float], float] | None,
                     budgets: dict[int, float] | None = None) -> None:
        """Before each of this rank's actions whose index is in `budgets`, call
        work(seconds): extra work (PipeFisher's K-FAC, `KFAC.work`) in the time the rank
        would otherwise wait there (`bubble_budgets` finds it). None turns it off."""
        self._bubble_work, self._budgets = work, dict(budgets or {})

    def parameters(self) -> list[nn.Parameter]:
        return [p for s in sorted(self.modules) for p in self.modules[s].parameters()]

    def train_step(self, batch: torch.Tensor, target: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   sizes: Sequence[int] | None = None) -> float | None:
        """Run this rank's actions for one batch; gradients accumulate into .grad (under
        'pipedream' each micro-batch's backward instead updates the weights at once with
        lr, using the weights its forward used). `sizes` cuts the batch (dim 0) into
        micro-batches of those lengths instead of tensor_split's even ones. Returns the
        batch's mean loss on the rank holding the last stage, else None."""
        m = self.plan.microbatches
        if batch.shape[0] < m:
            raise ValueError(f"a batch of {batch.shape[0]} samples cannot make {m} micro-batches")
        if sizes is not None and (len(sizes) != m or sum(sizes) != batch.shape[0]
                                  or min(sizes) < 1):
            raise ValueError(f"sizes must be {m} positive lengths adding up to the batch's "
                             f"{batch.shape[0]}; got {list(sizes)}")
        inputs = torch.split(batch, list(sizes)) if sizes else torch.tensor_split(batch, m)
        targets = torch.split(target, list(sizes)) if sizes else torch.tensor_split(target, m)
        weights = [len(x) / len(batch) for x in inputs]
        key = (tuple(batch.shape), batch.dtype, tuple(sizes) if sizes else None)
        state = _StepState(self._shapes.get(key))
        actions = self.plan.actions[self.rank]
        for index, action in enumerate(actions):
            if not state.headers and self.post_ahead:
                self._post_receives(actions, index, state)
            if self._bubble_work is not None and self._budgets.get(index, 0.0) > 0:
                self._bubble_work(self._budgets[index])
            self._run(action, inputs, targets, weights, loss_fn, state)
        for pending in state.sends:
            pending.wait()
        self._shapes[key] = state.shapes
        return sum(state.losses) if state.losses else None

    def _post_receives(self, actions: Sequence[Action], index: int, st: _StepState) -> None:
        """Post (irecv) every receive up to the second compute action from `index`, so each
        message lands while this rank computes the action before it. Receives are posted in
        plan order, the order the peer sends in, so messages match as they did blocking."""
        computes, end = 0, index
        while end < len(actions) and computes < 2:
            computes += not actions[end].kind.startswith(("SEND", "RECV"))
            end += 1
        for a in actions[st.posted:end]:
            if a.kind.startswith("RECV"):
                self._post(a, st)
        st.posted = max(st.posted, end)

    def _post(self, a: Action, st: _StepState) -> None:
        shape, dtype = st.shapes[(a.kind, a.stage, a.microbatch)]
        peer = a.stage - 1 if a.kind == "RECV_F" else a.stage + 1
        st.pending[(a.kind, a.stage, a.microbatch)] = collectives.irecv(
            torch.empty(shape, dtype=dtype), self.plan.rank_of(peer), self.group,
            label=str(a), stage=a.stage, microbatch=a.microbatch)

    def _run(self, a: Action, inputs, targets, weights, loss_fn, st: _StepState) -> None:
        key, last = (a.stage, a.microbatch), self.plan.stages - 1
        if a.kind.startswith(("SEND", "RECV")):  # labelled as the plan and the simulator do
            tag = {"label": str(a), "stage": a.stage, "microbatch": a.microbatch}
        if a.kind.startswith("RECV") and not st.headers:  # shape known: no header
            if (a.kind, *key) not in st.pending:  # not posted ahead
                self._post(a, st)
            store = st.incoming if a.kind == "RECV_F" else st.grads
            store[key] = st.pending.pop((a.kind, *key)).wait()
        elif a.kind == "RECV_F":  # first step with this batch shape: the shape comes first
            src = self.plan.rank_of(a.stage - 1)
            header = collectives.recv(torch.zeros(_HEADER, dtype=torch.int64), src, self.group,
                                      **tag)
            shape = header[1:1 + int(header[0])].tolist()
            st.shapes[(a.kind, *key)] = (shape, self.dtype)
            st.incoming[key] = collectives.recv(torch.empty(shape, dtype=self.dtype), src,
                                                self.group, **tag)
        elif a.kind == "SEND_F":
            out = st.outputs[key].detach()
            dst = self.plan.rank_of(a.stage + 1)
            if st.headers:
                header = torch.zeros(_HEADER, dtype=torch.int64)
                header[0] = out.dim()
                header[1:1 + out.dim()] = torch.tensor(out.shape)
                st.sends.append(collectives.isend(header, dst, self.group, **tag))
            st.sends.append(collectives.isend(out, dst, self.group, **tag))
        elif a.kind == "RECV_B":
            grad = torch.empty_like(st.outputs[key])
            st.shapes[(a.kind, *key)] = (grad.shape, grad.dtype)
            st.grads[key] = collectives.recv(grad, self.plan.rank_of(a.stage + 1), self.group,
                                             **tag)
        elif a.kind == "SEND_B":
            st.sends.append(collectives.isend(st.input_grads.pop(key),
                                              self.plan.rank_of(a.stage - 1), self.group, **tag))
        elif a.kind == "F":
            with record("F", str(a), stage=a.stage, microbatch=a.microbatch):
                if a.stage == 0:
                    x = inputs[a.microbatch]
                elif key in st.incoming:
                    x = st.incoming.pop(key).requires_grad_(True)
                else:  # the previous stage ran on this rank
                    x = st.outputs[(a.stage - 1, a.microbatch)].detach().requires_grad_(True)
                hooks = torch.autograd.graph.saved_tensors_hooks(self.activations.pack,
                                                                 self.activations.unpack)
                hooks.__enter__()
                if self.plan.weight_stashing:  # PipeDream: run on a stashed copy of the weights
                    stash = {n: p.detach().clone().requires_grad_(True)
                             for n, p in self.modules[a.stage].named_parameters()}
                    st.stashes[key] = (stash, self.version[a.stage])
                    out = torch.func.functional_call(self.modules[a.stage], stash, (x,))
                else:
                    out = self.modules[a.stage](x)
                st.stage_inputs[key], st.outputs[key] = x, out
                if a.stage == last:
                    loss = loss_fn(out, targets[a.microbatch]) * weights[a.microbatch]
                    st.losses.append(loss.item())
                    st.loss_tensors[key] = loss
                hooks.__exit__(None, None, None)
        else:
            with record(a.kind, str(a), stage=a.stage, microbatch=a.microbatch):
                self._backward(a, st)

    def _backward(self, a: Action, st: _StepState) -> None:
        key, last = (a.stage, a.microbatch), self.plan.stages - 1
        if a.stage == last:
            root, grad_out = st.loss_tensors[key], None
        elif key in st.grads:
            root, grad_out = st.outputs[key], st.grads[key]
        else:  # the next stage ran on this rank
            root, grad_out = st.outputs[key], st.local_grads.pop((a.stage + 1, a.microbatch))
        x = st.stage_inputs[key]
        params = [p for p in self.modules[a.stage].parameters() if p.requires_grad]
        if self.plan.weight_stashing:
            stash, version = st.stashes.pop(key)
            self.versions_used[key] = (version, self.version[a.stage])
            live = dict(self.modules[a.stage].named_parameters())
            names = [n for n, p in live.items() if p.requires_grad]
            params = [stash[n] for n in names]
        wants_input = x.requires_grad  # stage 0's input is data: nothing to send back
        if a.kind == "B":
            roots, root_grads, leaves = [root], [grad_out], []
            carried = getattr(self.modules[a.stage], "carried_state", None)
            if carried is not None:  # state this micro-batch shares with others (TeraPipe)
                more_roots, more_grads, leaves = carried(a.microbatch)
                roots, root_grads = roots + more_roots, root_grads + more_grads
            wrt = ([x] if wants_input else []) + params + leaves
            grads = list(torch.autograd.grad(roots, wrt, root_grads, allow_unused=True)) \
                if wrt else []
            if leaves:
                self.modules[a.stage].take_gradients(a.microbatch, grads[-len(leaves):])
                del grads[-len(leaves):]
            if wants_input:
                self._hand_back(a, grads.pop(0), st)
            if self.plan.weight_stashing:  # apply this micro-batch's gradient right away
                with torch.no_grad():
                    for n, g in zip(names, grads, strict=True):
                        if g is not None:
                            live[n] -= self.lr * g
                self.version[a.stage] += 1
            else:
                _accumulate(params, grads)
        elif a.kind == "I":  # input gradient only; keep the graph for W
            if wants_input:
                (grad_x,) = torch.autograd.grad(root, [x], grad_out, retain_graph=True)
                self._hand_back(a, grad_x, st)
        elif params:  # W: weight gradients from the retained graph
            _accumulate(params, torch.autograd.grad(root, params, grad_out, allow_unused=True))
        if a.kind in ("B", "W"):
            for store in (st.outputs, st.stage_inputs, st.grads, st.loss_tensors):
                store.pop(key, None)

    def _hand_back(self, a: Action, grad_x: torch.Tensor, st: _StepState) -> None:
        if a.stage > 0 and self.plan.rank_of(a.stage - 1) == self.rank:
            st.local_grads[(a.stage, a.microbatch)] = grad_x
        else:
            st.input_grads[(a.stage, a.microbatch)] = grad_x


def _accumulate(params: list[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    """Add each gradient into .grad in place (as backward() does); a gradient that shares
    memory with another one of this call is copied first, so no two .grads alias."""
    taken: set[int] = set()
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is not None:
            p.grad.add_(g)
        else:
            p.grad = g.clone() if g.untyped_storage().data_ptr() in taken else g
            taken.add(g.untyped_storage().data_ptr())


class _StepState:
    """What one train_step keeps between actions, keyed by (stage, micro-batch)."""

    def __init__(self, shapes: dict | None) -> None:
        # message shapes, learnt from headers on the first step with a batch shape; after
        # that no headers are sent and receives are posted ahead
        self.headers = shapes is None
        self.shapes: dict = {} if shapes is None else shapes
        self.pending: dict = {}  # posted receives, by (kind, stage, micro-batch)
        self.posted = 0  # actions up to here have had their receives posted
        self.incoming: dict = {}
        self.outputs: dict = {}
        self.stage_inputs: dict = {}
        self.grads: dict = {}
        self.local_grads: dict = {}
        self.input_grads: dict = {}
        self.loss_tensors: dict = {}
        self.stashes: dict = {}
        self.losses: list[float] = []
        self.sends: list[collectives.PendingSend] = []
