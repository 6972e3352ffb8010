"""The expert-parallelism demo: an MoE layer's experts spread over the ranks, tokens
dispatched and combined by all-to-all, each rank checking its tokens' outputs against
the one-process layer (drops included), and the experts over an ep dimension of a mesh.
`python -m minipar.moe`, `minipar tour` and the tests run `demo`."""

from __future__ import annotations

import time

import torch

from .. import collectives
from ..demo import Check, Context, Row, skip, start_clock
from ..runtime import device, rank, under_torchrun, world_size
from .adaptive import AdaptiveMoE
from .expert_choice import ExpertChoiceMoE
from .expert_parallel import ExpertParallelMoE
from .hierarchical import HierarchicalAllToAll, node_mesh
from .layer import MoELayer
from .on_mesh import check_moe_against_twin
from .pipeline_moe import PipelineMoE

EXPERTS, TOKENS_PER_RANK, HIDDEN = 4, 8, 16


def _twin() -> MoELayer:
    # the one-process twin: seeded on the host, the reference
    return MoELayer(HIDDEN, 32, num_experts=EXPERTS, k=2, capacity_factor=1.0,
                    shared_expert=True, seed=11, dtype=torch.float64)


def demo() -> list[Check]:
    """On every rank: this rank's experts and tokens, against the whole layer on one process;
    on 4 ranks also Tutel's hierarchical exchange (2 nodes x 2, or torchrun's nodes),
    Pipeline MoE, Tutel's adaptive parallelism at every degree and expert-parallel expert
    choice; on 4 or 8 ranks the experts over ep inside dp=2 (`on_mesh`)."""
    k = world_size()
    title = f"expert parallel MoE (E={EXPERTS}, k=2, shared expert), EP={k}"
    if EXPERTS % k:
        fits = [str(d) for d in range(1, EXPERTS + 1) if EXPERTS % d == 0]
        checks = [skip(title, f"{EXPERTS} experts do not split evenly over {k} ranks; it runs "
                              f"with --ranks {', '.join(fits)}")]
    else:
        checks = [_expert_parallel(title)]
    if k == 4:
        checks += [_hierarchical(), _pipeline_moe(), _adaptive(),
                   _expert_choice()]
    if k in (4, 8):  # a dp dimension of 2, and ep must divide on_mesh's 4 experts
        checks.append(_on_mesh({"dp": 2, "ep": k // 2}))
    return checks


def _on_mesh(dims: dict[str, int]) -> Check:
    """Two Adam steps of the experts over ep (inside dp), against one process."""
    start = start_clock()
    with collectives.meter() as m:
        result = check_moe_against_twin(dims)
    ok = result["loss_gap"] < 1e-12 and not result["wrong_grads"] and not result["wrong_params"]
    note = "2 Adam steps, float64: loss, every gradient and parameter" if ok else (
        f"differs: {(result['wrong_grads'] + result['wrong_params'])[:3]}, loss gap "
        f"{result['loss_gap']:.1e}")
    label = " x ".join(f"{name}={size}" for name, size in dims.items())
    return Check(f"MoE, experts over {label}", ok, time.perf_counter() - start, m.sent_bytes,
                 note=note)


def _hierarchical() -> Check:
    """The expert-parallel layer with Tutel's exchange: across torchrun's nodes when it
    started the ranks (node by node, LOCAL_WORLD_SIZE each), else 2 emulated nodes."""
    mesh = node_mesh(None if under_torchrun() else world_size() // 2)
    nodes = f"{mesh['node']} nodes x {mesh['local']}"
    groups = mesh.connect()
    return _expert_parallel(f"expert parallel MoE, hierarchical, torchrun's {nodes}"
                            if under_torchrun() else
                            f"expert parallel MoE, hierarchical all-to-all ({nodes})",
                            HierarchicalAllToAll(groups.local, groups.node))


def _expert_parallel(title: str, exchange=None) -> Check:
    """`exchange`: the flat all-to-all unless given."""
    me = rank()
    twin, tokens = _twin(), _tokens()
    reference = twin(tokens)[me * TOKENS_PER_RANK:(me + 1) * TOKENS_PER_RANK]
    layer = ExpertParallelMoE(twin, exchange=exchange).to(device())
    x = tokens[me * TOKENS_PER_RANK:(me + 1) * TOKENS_PER_RANK].to(device())
    start = start_clock()
    with collectives.meter() as m:
        y = layer(x)
    seconds = time.perf_counter() - start
    received = collectives.all_gather(torch.tensor([layer.tokens_received], device=device()))
    return Check(title, bool(torch.allclose(y.cpu(), reference, rtol=1e-12)), seconds,
                 m.sent_bytes, note=f"drops {twin.last_routing.drop_rate:.0%}; tokens "
                                    f"received per rank {received.tolist()}")


def _pipeline_moe() -> Check:
    """Every rank holds all tokens (a tensor-parallel group); experts split, one all-reduce."""
    twin, tokens = _twin(), _tokens()
    reference = twin(tokens)
    layer = PipelineMoE(twin).to(device())
    start = start_clock()
    with collectives.meter() as m:
        y = layer(tokens.to(device()))
    seconds = time.perf_counter() - start
    return Check(f"Pipeline MoE, experts in a TP group of {world_size()}",
                 bool(torch.allclose(y.cpu(), reference, rtol=1e-12)), seconds, m.sent_bytes,
                 note=f"index-slice dispatch, one all-reduce; rows on this rank "
                      f"{layer.rows_computed}")


def _tokens() -> torch.Tensor:
    # the twin's input, on the host beside it
    return torch.randn(TOKENS_PER_RANK * world_size(), HIDDEN, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(12))


def _adaptive() -> Check:
    """2 experts on the ranks, each split over K/2 of them: every degree from one layout."""
    # the one-process twin: the reference, on the host
    twin = MoELayer(HIDDEN, 32, num_experts=2, k=1, seed=11, dtype=torch.float64)
    me, tokens = rank(), _tokens()
    mine = slice(me * TOKENS_PER_RANK, (me + 1) * TOKENS_PER_RANK)
    reference = twin(tokens)[mine]
    layer = AdaptiveMoE(twin).to(device())
    start, same, sent = start_clock(), True, {}
    with collectives.meter() as m:
        for degree in layer.degrees:
            y = layer(tokens[mine].to(device()), degree)
            same &= bool(torch.allclose(y.cpu(), reference, rtol=1e-10, atol=1e-12))
            sent[degree] = layer.last_traffic
    parts = ", ".join(f"r={d} {t['weights']:,}/{t['rows']:,}" for d, t in sent.items())
    return Check("Tutel adaptive parallelism, degrees " + "/".join(map(str, layer.degrees)),
                 same, time.perf_counter() - start, m.sent_bytes,
                 note=f"bytes of weights/rows this rank sent: {parts}")


def _expert_choice() -> Check:
    """Experts pick their top tokens of the whole batch, each on its owner rank."""
    me, tokens = rank(), _tokens()
    # the one-process twin: the reference, on the host
    twin = ExpertChoiceMoE(HIDDEN, 32, num_experts=EXPERTS, k=2, capacity_factor=0.75,
                           seed=11, dtype=torch.float64)
    reference = twin(tokens)[me * TOKENS_PER_RANK:(me + 1) * TOKENS_PER_RANK]
    layer = ExpertParallelMoE(twin).to(device())
    start = start_clock()
    with collectives.meter() as m:
        y = layer(tokens[me * TOKENS_PER_RANK:(me + 1) * TOKENS_PER_RANK].to(device()))
    return Check("expert choice, expert-parallel",
                 bool(torch.allclose(y.cpu(), reference, rtol=1e-12)),
                 time.perf_counter() - start, m.sent_bytes,
                 note=f"owners pick over the whole batch; rows this rank computed "
                      f"{layer.tokens_received}")


def tour(ctx: Context) -> list[Row]:
    return ctx.checks(2, demo) + ctx.checks(4, demo)
