"""The vocabulary split over tp (`tensor_parallel/vocab_parallel.py`): embedding, head and
cross-entropy equal one process in float64 (loss and every gradient) on 2 and 4 ranks,
with a vocabulary that tp divides and one it does not; the logits are never gathered;
leaving the padding unmasked (Megatron-LM#1754) makes training drift from one process."""

import pytest
import torch

import minipar
from minipar.collectives import meter
from minipar.decoder import cross_entropy
from minipar.tensor_parallel.vocab_parallel import (
    VocabParallelEmbedding,
    padded_vocab,
    shard_rows,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)

B, S, H = 2, 6, 8


def _twin(vocab):
    torch.manual_seed(4)
    embed = torch.nn.Embedding(vocab, H, dtype=torch.float64)
    head = torch.nn.Linear(H, vocab, bias=False, dtype=torch.float64)
    ids = torch.randint(0, vocab, (B, S + 1), generator=torch.Generator().manual_seed(9))
    return embed, head, ids[:, :-1], ids[:, 1:]


def _one_process(vocab):
    embed, head, ids, targets = _twin(vocab)
    loss = cross_entropy(head(torch.tanh(embed(ids))), targets)
    loss.backward()
    return loss.item(), embed.weight.grad, head.weight.grad


def _vocab_parallel(vocab):
    """The same model split by vocabulary: its loss, gradients, logit width and the bytes
    its loss sent."""
    embed, head, ids, targets = _twin(vocab)
    layer = VocabParallelEmbedding(embed)
    head_rows = torch.nn.Parameter(shard_rows(head.weight.detach()))
    logits = vocab_parallel_logits(torch.tanh(layer(ids)), head_rows)
    with meter() as m:
        loss = vocab_parallel_cross_entropy(logits, targets, vocab)
    loss.backward()
    gathered = [n for n in m.calls if "gather" in n]
    return loss.item(), layer.weight.grad, head_rows.grad, logits.shape[-1], m.sent_bytes, \
        gathered


# 9 over 4 ranks: 3 rows each, and rank 3's slice is all padding
@pytest.mark.parametrize("ranks, vocab", [(2, 11), (4, 11), (4, 12), (4, 9)])
def test_split_vocabulary_equals_one_process(cluster2, cluster4, ranks, vocab):
    cluster = cluster2 if ranks == 2 else cluster4
    loss, embed_grad, head_grad = _one_process(vocab)
    for r, (mine, e, h, width, sent, gathered) in enumerate(cluster.run(_vocab_parallel, vocab)):
        assert width == padded_vocab(vocab, ranks) // ranks
        assert abs(mine - loss) < 1e-12, (r, mine, loss)
        per = width
        real = embed_grad[r * per:(r + 1) * per]
        assert torch.allclose(e[:len(real)], real, atol=1e-12)
        assert torch.allclose(h[:len(real)], head_grad[r * per:(r + 1) * per], atol=1e-12)
        # the padding rows get no gradient at all
        assert (e[len(real):] == 0).all() and (h[len(real):] == 0).all()
        # no logits gathered: the loss all-reduces three [tokens] float64 vectors (max, sum of
        # exponentials, target logit), each a ring's 2(K-1)/K of its bytes
        assert not gathered and sent == 3 * 2 * (ranks - 1) * B * S * 8 // ranks, sent


def _drift(vocab, steps, masked):
    """SGD steps on the split model, against one process: the largest loss gap."""
    embed, head, ids, targets = _twin(vocab)
    layer = VocabParallelEmbedding(embed)
    head_rows = torch.nn.Parameter(shard_rows(head.weight.detach()))
    params = [layer.weight, head_rows, *embed.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    gaps = []
    for _ in range(steps):
        opt.zero_grad()
        logits = vocab_parallel_logits(torch.tanh(layer(ids)), head_rows)
        loss = vocab_parallel_cross_entropy(
            logits, targets, vocab if masked else padded_vocab(vocab, minipar.world_size()))
        reference = cross_entropy(head(torch.tanh(embed(ids))), targets)
        (loss + reference).backward()
        opt.step()
        gaps.append(abs(loss.item() - reference.item()))
    # the padding's rows of the head (none on ranks whose slice is all real tokens)
    padding = head_rows.detach()[max(0, vocab - layer.start):]
    return max(gaps), padding.abs().sum().item()


def test_unmasked_padding_drifts_from_one_process(cluster4):
    # 11 tokens over 4 ranks: 12 rows, the last one padding on rank 3
    masked = cluster4.run(_drift, 11, 5, True)
    unmasked = cluster4.run(_drift, 11, 5, False)
    assert all(gap < 1e-12 and pad == 0 for gap, pad in masked), masked
    # the padding's logit (0 at first) takes probability: the loss is not the model's from
    # step 1, and the padding row learns (its gradient is its softmax share), so it drifts on
    assert all(gap > 1e-3 for gap, _ in unmasked), unmasked
    assert unmasked[3][1] > 0 and all(pad == 0 for _, pad in unmasked[:3]), unmasked


def _bad_targets():
    try:
        vocab_parallel_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), 8)
    except ValueError as err:
        return str(err)


def test_mismatched_targets_are_one_line(cluster2):
    assert all("must match" in e and "\n" not in e for e in cluster2.run(_bad_targets))
