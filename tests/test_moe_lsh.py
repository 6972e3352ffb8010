"""LSH-MoE: exact with one token per bucket; compresses and errs more with fewer buckets."""

import pytest
import torch

from minipar.moe import MoELayer
from minipar.moe.lsh import LSHMoE, lsh_buckets


def _clustered(tokens=64, hidden=8, clusters=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    centres = 3 * torch.randn(clusters, hidden, generator=gen, dtype=torch.float64)
    which = torch.randint(0, clusters, (tokens,), generator=gen)
    return centres[which] + 0.1 * torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)


def _pair(bits, compensate=True):
    kw = dict(num_experts=4, k=2, capacity_factor=2.0, seed=4, dtype=torch.float64)
    return LSHMoE(8, 16, bits=bits, compensate=compensate, **kw), MoELayer(8, 16, **kw)


@pytest.mark.parametrize("compensate", [False, True])
def test_one_token_per_bucket_is_exact(compensate):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lsh, exact = _pair(40, compensate)
    assert len(set(lsh_buckets(x, 40).tolist())) == len(x)
    assert torch.allclose(lsh(x), exact(x)) and lsh.compression == 1.0


def test_fewer_buckets_compress_more_and_err_more():
    x = _clustered()
    results = {}
    for bits in (1, 3, 8):
        lsh, exact = _pair(bits)
        err = ((lsh(x) - exact(x)).norm() / exact(x).norm()).item()
        results[bits] = (lsh.compression, err)
    assert results[1][0] > results[3][0] > results[8][0] >= 1
    assert results[1][1] > results[8][1]


def test_bits_are_checked():
    with pytest.raises(ValueError, match="bits must be between 1 and 62"):
        lsh_buckets(torch.zeros(2, 3), 0)
