"""DiLoCo (Douillard et al. 2023): local SGD's rounds with an optimizer on each side.

Every worker starts a round from the global parameters theta and takes H inner steps on
its own shard with its own optimizer (AdamW in the paper); that optimizer's state stays
on the worker, across rounds, and never travels. Then the ranks all-reduce one vector:
the outer gradient, delta = theta - mean_k theta_k (how far the workers moved, pointing
back), and an outer optimizer steps theta by it (SGD with Nesterov momentum, lr 0.7 and
momentum 0.9 in the paper). Every worker restarts from the new theta. One all-reduce of
the model's size per H steps, as local SGD; what DiLoCo adds is what the optimizers make
of those rare messages.

Two special cases say what it is:
- Local SGD (`relaxed.local_sgd`) is DiLoCo with an outer SGD of rate 1 and no momentum:
  theta - 1 x (theta - mean) = mean.
- With inner SGD (momentum and weight decay allowed), H = 1 and that outer SGD, DiLoCo is
  synchronous data parallelism exactly: SGD's update, momentum buffer included, is linear
  in the gradients, so the average of K workers' updates is the update of the averaged
  gradient. With inner AdamW it is not: each worker divides by its own second moment,
  and the average of K normalized steps is not the normalized step of the average.

The inner side plugs into relaxed.py's `LocalReplica`: `OptimizerReplica` is a module in
memory trained by any torch optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..data_parallel import shard
from ..trace import record
from .relaxed import LocalReplica, ModuleReplica, RelaxedReport, _average, _check_h

# the paper's outer optimizer (Douillard et al. 2023, section 3): Nesterov, lr 0.7, 0.9
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


class OptimizerReplica(ModuleReplica):
    """A module in memory trained by a torch optimizer: DiLoCo's inner side. The optimizer
    (AdamW, SGD with momentum...) keeps its state here, on this worker, for the whole run."""

    def __init__(self, model: nn.Module, loss_fn: Callable,
                 optimizer: torch.optim.Optimizer) -> None:
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer

    def local_step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        with record("compute", "inner step", step=step):
            self.optimizer.zero_grad()
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            self.optimizer.step()
        return loss.item()


def outer_optimizer(theta: torch.Tensor, lr: float = OUTER_LR,
                    momentum: float = OUTER_MOMENTUM) -> tuple[nn.Parameter, torch.optim.SGD]:
    """The global parameters as one flat Parameter, and the SGD that steps them (Nesterov
    whenever there is momentum, as the paper's)."""
    if not lr > 0 or not 0 <= momentum < 1:
        raise ValueError(f"the outer optimizer needs lr > 0 and 0 <= momentum < 1; got lr={lr}, "
                         f"momentum={momentum}")
    global_ = nn.Parameter(theta.detach().clone())
    return global_, torch.optim.SGD([global_], lr=lr, momentum=momentum,
                                    nesterov=momentum > 0)


def diloco(replica: LocalReplica, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
           local_steps: int, outer_lr: float = OUTER_LR, outer_momentum: float = OUTER_MOMENTUM,
           on_round: Callable[[int, torch.Tensor], None] | None = None) -> RelaxedReport:
    """H = local_steps inner steps on this rank's shard of each batch, then one outer
    step on the all-reduced outer gradient; every rank restarts from the new global
    parameters. `on_round(step, theta)` sees the global parameters after each round (an
    evaluation, say: it costs no message). The replicas must start equal."""
    _check_h(local_steps)
    report = RelaxedReport()
    theta, outer = outer_optimizer(replica.vector(), outer_lr, outer_momentum)
    for step, (x, y) in enumerate(batches):
        report.losses.append(replica.local_step(shard(x), shard(y), step))
        if (step + 1) % local_steps == 0 or step == len(batches) - 1:
            with torch.no_grad():
                # the outer gradient: where the round started minus where this worker ended
                delta = theta.detach() - replica.vector()
            theta.grad = _average(delta)  # the round's one message
            with record("compute", "outer step", step=step):
                outer.step()
            # a copy: vector_to_parameters makes the parameters views of what it is given,
            # and the inner steps must not write into theta
            replica.load_vector(theta.detach().clone())
            report.rounds += 1
            if on_round is not None:
                on_round(step, theta.detach())
    return report
