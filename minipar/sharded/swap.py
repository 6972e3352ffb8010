"""Host memory behind the device: the one mechanism offloading (KARMA, ZeRO-Offload) and
model swapping (ATOM) share.

- `CopyStream`: copies between host and device in the background, in the order they were
  submitted, each recorded as a "copy" event. On a GPU they run on a second CUDA stream
  (the background thread's own, or `runtime.on_copy_stream`); on CPU the background
  thread itself stands for the copy engine. `background=False` runs each copy at once,
  on the caller's thread: offloading without prefetch.
- `SwappedLayer`: a layer whose parameters live in host memory (`host`, a flat vector:
  the master copy the optimizer updates) and visit the device as views of one flat buffer
  (`device`) only while the layer computes. Evicting shrinks that buffer's storage to
  nothing rather than pointing the parameters elsewhere, as FSDP frees a unit: views
  autograd saved (a linear layer's weight) lose their memory too and see the values
  again when the layer is loaded. Its gradients go to the host as soon as they are done.

Device memory is only allocated and freed on the compute's thread (a copy into it is
submitted after it is allocated, and it is freed only once its copies have landed), so
on a GPU it stays in the compute stream's pool and every copy waits for the compute
queued before it: no stream ever reuses memory another still reads.
- `SavedBox`: what autograd holds for a saved activation a layer swaps out: the host copy
  and, while it is on the device, the device tensor.

A driver calls, per layer: `load` (or `prefetch` a step ahead), compute, `evict`; then
`send_gradients` when backward has produced them. `Offload` drives it for training; a
model that lives entirely in host memory is the same loop over all its layers.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import nn

from ..collectives.background import CommThread
from ..runtime import compute_ready, copies_landed, host_empty_like, on_copy_stream
from ..trace import record


class CopyStream:
    """Host<->device copies in submission order, in the background (or at once)."""

    def __init__(self, background: bool = True) -> None:
        # a CommThread is a FIFO of jobs on one thread: exactly a copy stream's semantics
        self.thread = CommThread("minipar-copy") if background else None

    def submit(self, label: str, nbytes: int, fn: Callable, *args) -> Future:
        """Run the copy `fn(*args)`; its Future is done when the copy has landed. On a GPU
        the copy starts after what compute queued so far: in the background, the thread's
        own stream waits for it (collectives/background.py); at once, the copy stream."""
        if self.thread is not None:
            def job():
                with record("copy", label, bytes=nbytes):
                    out = fn(*args)
                    copies_landed()  # the thread's stream: the Future is done once they are
                return out

            return self.thread.submit(job)
        done: Future = Future()
        with record("copy", label, bytes=nbytes), on_copy_stream(compute_ready()):
            done.set_result(fn(*args))
        return done

    def wait(self, future: Future, label: str) -> object:
        """The copy's result; the time the caller spends blocked is a "wait" event (the
        copy the compute could not hide)."""
        if future.done():
            return future.result()
        with record("wait", label):
            return future.result()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        # non_blocking: a pinned host buffer lets the copy engine run beside the compute
        return dst.copy_(src, non_blocking=True)


class SwappedLayer:
    """One layer's parameters: master in host memory, a device copy only while it is in."""

    def __init__(self, module: nn.Module, index: int) -> None:
        self.module, self.index = module, index
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"layer {index} has no trainable parameter to swap")
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.host = nn.Parameter(copy_into(host_empty_like(flat), flat))  # the master
        self.host_grad = torch.zeros_like(self.host)
        self.device = flat
        self.nbytes = flat.untyped_storage().nbytes()
        start = 0
        for p in self.params:
            # .data: the module and autograd keep the same Parameter objects, now views of flat
            p.data = flat[start:start + p.numel()].view(p.shape)
            start += p.numel()
        self.resident = True
        self.pending: Future | None = None
        self.grads_owed = len(self.params)

    def _fill(self) -> None:
        copy_into(self.device, self.host.detach())

    def prefetch(self, stream: CopyStream) -> None:
        """Start copying the parameters in, if they are neither in nor on their way."""
        if not self.resident and self.pending is None:
            # the storage regrows in place (the parameters and autograd's saved views see it),
            # here on the compute's thread: see the module docstring
            self.device.untyped_storage().resize_(self.nbytes)
            self.pending = stream.submit(f"load L{self.index}", self.nbytes, self._fill)

    def load(self, stream: CopyStream) -> None:
        """Make the parameters resident: wait for a prefetch, or copy them in now."""
        if self.resident:
            return
        self.prefetch(stream)
        stream.wait(self.pending, f"wait L{self.index}")
        self.pending, self.resident = None, True

    def evict(self) -> None:
        """Free the device copy (the host master is the truth: nothing to write back)."""
        if self.pending is not None:  # a prefetch in flight must land before its memory goes
            self.pending.result()
            self.pending = None
        self.device.untyped_storage().resize_(0)
        self.resident = False

    def arrived(self) -> bool:
        """One more parameter's gradient is complete; True when it was the layer's last."""
        self.grads_owed -= 1
        return self.grads_owed == 0

    def send_gradients(self, stream: CopyStream) -> Future:
        """Add the layer's gradients into the host's, in the background, and drop them from
        the device (the copy job holds them until it has read them)."""
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self.grads_owed = len(self.params)
        return stream.submit(f"grads L{self.index}", self.nbytes, self._add_grads, grads)

    def _add_grads(self, grads: list[torch.Tensor | None]) -> None:
        # into host buffers first, then added: a host add never reads device memory. The
        # copies are non-blocking, so the adds wait until they have landed (the audit's
        # finding 5: added at once, they read buffers the copy engine was still writing)
        landed = [None if g is None else copy_into(host_empty_like(g), g) for g in grads]
        copies_landed()
        start = 0
        for p, g in zip(self.params, landed, strict=True):
            if g is not None:
                self.host_grad[start:start + p.numel()].add_(g.reshape(-1))
            start += p.numel()

    def hand_gradient_to_optimizer(self) -> None:
        """The accumulated host gradient becomes the master's .grad; the sum starts over."""
        self.host.grad, self.host_grad = self.host_grad, torch.zeros_like(self.host)


class SavedBox:
    """A saved activation of a swapped layer: `tensor` while on the device (None once the
    copy out has landed), `host` its copy, `pending` a copy in on its way."""

    __slots__ = ("tensor", "host", "pending", "layer", "__weakref__")

    def __init__(self, tensor: torch.Tensor, layer: int | None) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.pending: Future | None = None
        self.layer = layer

    def swap_out(self, stream: CopyStream) -> Future:
        self.host = host_empty_like(self.tensor)
        return stream.submit(f"save L{self.layer}", self.tensor.untyped_storage().nbytes(),
                      self._out, self.tensor)

    def _out(self, tensor: torch.Tensor) -> None:
        copy_into(self.host, tensor)
        self.tensor = None  # the device copy is free once nothing else holds it

    def prefetch(self, stream: CopyStream, device: torch.device) -> None:
        if self.pending is None and self.host is not None and self.tensor is None:
            # allocated here, on the compute's thread: see the module docstring
            buffer = torch.empty_like(self.host, device=device)
            self.pending = stream.submit(f"fetch L{self.layer}", self.host.nbytes, self._in,
                                         buffer)

    def _in(self, buffer: torch.Tensor) -> torch.Tensor:
        self.tensor = copy_into(buffer, self.host)
        return self.tensor

    def unpack(self, stream: CopyStream, device: torch.device) -> torch.Tensor:
        """The tensor for backward: already here, prefetched, or copied in now."""
        if self.tensor is None or self.pending is not None:
            self.prefetch(stream, device)
            stream.wait(self.pending, f"wait L{self.layer}")
            self.pending = None
        return self.tensor

