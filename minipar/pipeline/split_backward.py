"""The zero-bubble split of a stage's backward, without doing the work twice.

I (the input gradient, which the previous stage waits for) walks the stage's graph from
its output back to its input. W (the weight gradients) needs much less: for each weight,
the gradient that arrives where the weight joins that path (the matmul that multiplies
the activations by it, the multiply of a norm's scale), then the weight's own few nodes
(a transpose, say). Walking from the output again, as a plain
`torch.autograd.backward(root, inputs=weights)` does, recomputes every activation
gradient on the way down: on a CPU that made W cost about a whole backward, so a
zero-bubble step did half again the arithmetic of 1F1B's.

So I keeps, with a hook on each of those junction nodes, the gradient that reached it
(`Junctions.keep`), and W starts from the junctions (`GradientEdge`s) with what I kept
(`Junctions.weights_backward`), one group of weights at a time: a backward started at
every junction at once with every weight as its target would walk from the upper
junctions down the activations' path to the lower blocks' weights, which is the very
work being saved. A weight used twice is the exception: its group walks the path
between its two uses (in a stage that repeats one block, W costs about a whole B).
torch.distributed.pipelining splits its backward the same way (`stage_backward_input` /
`stage_backward_weight`, its "param groups").

Two costs stay. From I to W each junction's gradient is held (an activation-sized tensor
per matmul and norm, per micro-batch), which the activation meter (stage.py) does not
count. And hooks on activations fire where the walk goes: all of them in I, only the
junctions' (again) in W, none below them.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _towards_root(root: torch.Tensor) -> dict[Node, list[Node]]:
    """root's graph read upwards: each node -> the nodes that consume its output (autograd
    stores only the other direction, `next_functions`)."""
    consumers: dict[Node, list[Node]] = defaultdict(list)
    start = root.grad_fn
    seen, queue = {start}, deque([start])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _reachable(starts: list[Node], consumers: dict[Node, list[Node]],
               stop: set[Node] = frozenset()) -> tuple[set[Node], set[Node]]:
    """Nodes reached from `starts` towards the root (not entering `stop`), and the nodes
    of `stop` met on the way."""
    seen, met, queue = set(starts), set(), deque(starts)
    while queue:
        for node in consumers.get(queue.popleft(), ()):
            if node in stop:
                met.add(node)
            elif node not in seen:
                seen.add(node)
                queue.append(node)
    return seen, met


class Junctions:
    """Where the weights' subgraphs join the path from a stage's input `x` to its output
    `root`, grouped: weights that share a junction go together. A weight this micro-batch
    does not use (an expert no token chose) gets no gradient, as in a plain backward.
    `found` is False when a weight it uses joins that path nowhere, which happens only
    when the output does not depend on the input: W must then walk from the root."""

    def __init__(self, root: torch.Tensor, x: torch.Tensor,
                 weights: Sequence[torch.Tensor]) -> None:
        consumers = _towards_root(root)
        on_path, _ = _reachable([get_gradient_edge(x).node], consumers)
        self.groups: list[tuple[set[Node], list[torch.Tensor]]] = []
        self.found = True
        for w in weights:
            node = get_gradient_edge(w).node
            if node not in consumers:  # not used by this micro-batch's graph
                continue
            _, met = _reachable([node], consumers, on_path)
            self.found &= bool(met)
            nodes, mine = set(met), [w]
            for group in [g for g in self.groups if g[0] & nodes]:  # merge what it touches
                self.groups.remove(group)
                nodes |= group[0]
                mine += group[1]
            self.groups.append((nodes, mine))
        self.nodes = {node for nodes, _ in self.groups for node in nodes}
        self.kept: dict[Node, tuple] = {}

    @contextmanager
    def keep(self) -> Iterator[None]:
        """Inside, each junction keeps the gradient that reaches it (run I inside)."""
        def hook(node: Node):
            def keep(grads: tuple) -> None:
                self.kept[node] = grads
                return None  # a prehook that returns a value replaces the gradients
            return keep
        handles = [node.register_prehook(hook(node)) for node in self.nodes]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def weights_backward(self) -> None:
        """W: each group's weight gradients from its junctions' kept gradients, added
        into .grad (their hooks fire, as in `loss.backward()`). Within a group one
        junction may lie below another (a weight used twice); what reaches it from above
        is replaced by what it kept, so nothing is counted twice."""
        # the prehook's return value replaces what arrives at the junction
        handles = [node.register_prehook(lambda _arrived, kept=kept: kept)
                   for node, kept in self.kept.items()]
        try:
            for nodes, weights in self.groups:
                edges, grads = [], []
                for node in nodes:
                    for i, g in enumerate(self.kept.get(node, ())):
                        if g is not None:
                            edges.append(GradientEdge(node, i))
                            grads.append(g)
                if edges:
                    # retain_graph: a weight used twice walks the path between its uses,
                    # and another group's junction there must still have its saved
                    # tensors; the graph goes when the engine drops the step's output
                    torch.autograd.backward(edges, grads, inputs=weights, retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()
        self.kept.clear()
