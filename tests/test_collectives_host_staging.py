"""Host staging (issue 43): where gloo meets a GPU tensor (ranks sharing one card), every
message minipar posts goes through host memory. CI has no GPU, so `forced()` stages CPU
tensors too: each path must post from its host copy, land the receive, copy it back on
wait, and give the same numbers as the unstaged run."""

from contextlib import nullcontext

import pytest
import torch

import minipar
from minipar import collectives
from minipar.collectives import host_staging
from minipar.runtime import resolve_device


def _every_path(staged: bool) -> tuple[dict, int]:
    """One of each kind of message: the ring's and the tree's steps, the pipelined ring's
    segments (several: the tensor spans two SEGMENT_BYTES), all-to-all with its counts
    handshake, isend/irecv and recv_any."""
    r, k = minipar.rank(), minipar.world_size()
    gen = torch.Generator().manual_seed(r)
    big = torch.randn(2 * collectives.SEGMENT_BYTES // 8 + 5, dtype=torch.float64, generator=gen)
    small = torch.arange(6, dtype=torch.float64, device=minipar.device()) + 10 * r
    before = host_staging.staged_messages
    with host_staging.forced() if staged else nullcontext():
        out = {
            "ring": collectives.all_reduce(small.clone(), algorithm="ring"),
            "tree": collectives.all_reduce(small.clone(), algorithm="tree"),
            "pipelined": collectives.pipelined_ring_all_reduce(big.clone()),
            "all_to_all": collectives.all_to_all(torch.arange(k * 2, dtype=torch.float64,
                                                              device=minipar.device()) + r,
                                                 send_counts=[2] * k, recv_counts=[2] * k),
        }
        landing = torch.zeros(4, dtype=torch.float64, device=minipar.device())
        pending = collectives.isend(small[:4] * 3, (r + 1) % k)
        out["p2p"] = collectives.irecv(landing, (r - 1) % k).wait()
        pending.wait()
        if r == 0:
            out["recv_any"] = torch.zeros(2, dtype=torch.float64, device=minipar.device())
            out["from"] = collectives.recv_any(out["recv_any"])
        elif r == 1:
            collectives.send(torch.full((2,), 7.0, dtype=torch.float64,
                                        device=minipar.device()), 0)
    return out, host_staging.staged_messages - before


def test_every_message_path_staged_through_host_memory_gives_the_same_numbers(cluster4):
    plain = cluster4.run(_every_path, False)
    staged = cluster4.run(_every_path, True)
    for r, ((mine, _), (theirs, count)) in enumerate(zip(staged, plain, strict=True)):
        assert count == 0  # nothing is staged for CPU tensors unless forced
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(theirs[key])), (r, key)
    assert all(count > 10 for _, count in staged)  # every path really went through the host
    assert staged[0][0]["from"] == 1 and staged[0][0]["recv_any"].tolist() == [7.0, 7.0]


def test_a_device_that_cannot_be_had_is_refused_in_one_line():
    with pytest.raises(ValueError, match="device must be one of 'auto', 'cpu', 'cuda'"):
        resolve_device("gpu", "gloo")
    with pytest.raises(ValueError, match="NCCL moves GPU memory only"):
        resolve_device("cpu", "nccl")
    assert resolve_device("auto", "gloo") == "cpu" and resolve_device("auto", "nccl") == "cuda"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no GPU here"):
            minipar.Cluster(2, backend="gloo", device="cuda")
