"""ZeRO-Offload (Ren et al. 2021): ZeRO's sharded optimizer step runs on the host.

Each rank keeps its slices of the optimizer state (Adam's moments) and a master copy of
its parameter slices in host memory, never on the device. A step copies each slice's
averaged gradient down to the host, steps the host optimizer on it, and copies the
updated slice back up, where ZeRO all-gathers it as usual. The copies run on a
`CopyStream`, so slice j+1's gradient travels while slice j steps, and slice j's
parameters go back while slice j+1 steps.

It plugs into `ZeroDataParallel` (or FSDP) where an optimizer does, as its factory:
`ZeroDataParallel(model, host_optimizer(adam))`; the trainer does not know.
"""

from __future__ import annotations

from concurrent.futures import Future

from torch import nn

from ..runtime import host_empty_like
from .swap import CopyStream, copy_into
from .zero import OptimizerFactory


class HostOptimizer:
    """An optimizer over device parameter slices whose state and step live on the host:
    one host optimizer per slice (elementwise optimizers such as Adam step each tensor on
    its own, so this equals one optimizer over all of them). `state` is what the device
    holds of it: nothing."""

    def __init__(self, params: list[nn.Parameter], optimizer: OptimizerFactory,
                 prefetch: bool = True) -> None:
        self.device_params = list(params)
        self.stream = CopyStream(background=prefetch)
        self.host = [nn.Parameter(copy_into(host_empty_like(p), p.detach()))
                     for p in self.device_params]
        self.optimizers = [optimizer([h]) for h in self.host]
        self.state: dict = {}  # no optimizer state on the device

    @property
    def param_groups(self) -> list[dict]:
        """The host optimizers' groups: a learning-rate schedule changes them here."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def _down(self, j: int) -> None:
        grad = self.device_params[j].grad
        self.host[j].grad = None if grad is None else copy_into(host_empty_like(grad), grad)

    def _up(self, j: int) -> None:
        copy_into(self.device_params[j].data, self.host[j].detach())

    def step(self) -> None:
        """Gradients down, host step, parameters up: slice by slice, copies overlapped."""
        size = lambda j: self.host[j].numel() * self.host[j].element_size()  # noqa: E731
        down: list[Future] = [self.stream.submit(f"grads {j}", size(j), self._down, j)
                              for j in range(len(self.host))]
        for j, opt in enumerate(self.optimizers):
            self.stream.wait(down[j], f"wait grads {j}")
            opt.step()
            self.stream.submit(f"params {j}", size(j), self._up, j)
        self.stream.join()  # the updated slices are on the device before ZeRO gathers them

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params + self.host:
            p.grad = None


def host_optimizer(optimizer: OptimizerFactory, prefetch: bool = True) -> OptimizerFactory:
    """ZeRO-Offload as an optimizer factory: `optimizer`'s step on host copies of the slices."""
    return lambda params: HostOptimizer(params, optimizer, prefetch)
