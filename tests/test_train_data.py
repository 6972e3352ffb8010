"""The trainer's data: the corpus, the byte tokenizer, the token cache, the split by
document and the seeded, dp-sharded, resumable sampler. A small corpus written in
tmp_path stands in for the standard library everywhere but one file-list test."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from minipar.train.data import BatchSampler, ByteTokenizer, corpus_files, load_tokens

DOCUMENTS = {f"doc{i:02d}.txt": f"document {i}: " + "abcdefghij" * (i + 3) for i in range(20)}


class CountingTokenizer(ByteTokenizer):
    """A ByteTokenizer that counts the documents it encodes (reading the corpus means encoding)."""

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text):
        self.encoded += 1
        return super().encode(text)


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A folder of 20 small documents; the cache goes to tmp_path too."""
    monkeypatch.setenv("MINIPAR_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in DOCUMENTS.items():
        (folder / name).write_text(text)
    return folder


def one_line_error(call, *names: str) -> str:
    with pytest.raises(ValueError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    for name in names:
        assert name in message, (name, message)
    return message


def test_the_stdlib_corpus_is_its_python_files_without_installed_packages():
    files = corpus_files(None)
    assert len(files) > 500
    assert all(f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "dist-packages", "__pycache__")
                   for f in files for part in f.parts)


def test_a_folder_skips_hidden_files_and_caches(corpus):
    (corpus / ".hidden").write_text("secret")
    (corpus / "__pycache__").mkdir()
    (corpus / "__pycache__" / "x.pyc").write_bytes(b"\0")
    names = [f.name for f in corpus_files(str(corpus))]
    assert names == sorted(DOCUMENTS)
    assert corpus_files(str(corpus / "doc03.txt")) == [corpus / "doc03.txt"]


def test_byte_round_trip_including_non_ascii():
    tok = ByteTokenizer()
    text = "naïve café — 日本語 🐍\n"
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.encode(text.encode()) == ids
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode(ids[:-2]).endswith("\ufffd")  # a cut character is replaced, not an error


def test_the_second_load_reads_nothing(corpus):
    first = CountingTokenizer()
    data = load_tokens(str(corpus), val_fraction=0.2, tokenizer=first)
    assert first.encoded > len(DOCUMENTS)  # every document (and the separator) was encoded
    again = CountingTokenizer()
    cached = load_tokens(str(corpus), val_fraction=0.2, tokenizer=again)
    assert again.encoded == 0
    assert np.array_equal(cached.train, data.train) and np.array_equal(cached.val, data.val)
    assert cached.train.dtype == np.uint8 and not cached.train.flags.writeable
    folder = next((corpus.parent / "cache" / "tokens").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_a_changed_file_or_split_is_a_new_cache(corpus):
    load_tokens(str(corpus))
    (corpus / "doc05.txt").write_text("changed")
    counting = CountingTokenizer()
    data = load_tokens(str(corpus), tokenizer=counting)
    assert counting.encoded > 0
    assert b"changed" in bytes(data.train) + bytes(data.val)
    counting = CountingTokenizer()
    load_tokens(str(corpus), seed=1, tokenizer=counting)
    assert counting.encoded > 0
    assert len(list((corpus.parent / "cache" / "tokens").iterdir())) == 3


def test_an_interrupted_build_is_not_trusted(corpus, monkeypatch):
    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        load_tokens(str(corpus))
    folder = next((corpus.parent / "cache" / "tokens").iterdir())
    assert list(folder.iterdir()) == []  # the half-written split was removed
    monkeypatch.undo()
    monkeypatch.setenv("MINIPAR_CACHE", str(corpus.parent / "cache"))
    counting = CountingTokenizer()
    load_tokens(str(corpus), tokenizer=counting)
    assert counting.encoded > 0


def test_train_and_val_split_the_documents(corpus):
    data = load_tokens(str(corpus), val_fraction=0.1, seed=3)
    train, val = data.meta["train"]["documents"], data.meta["val"]["documents"]
    assert len(val) == 2 and not set(train) & set(val)
    assert sorted(train + val) == sorted(str(corpus / n) for n in DOCUMENTS)
    for split, docs in (("train", train), ("val", val)):
        # the split's tokens are its documents in the shuffled order, newline-separated
        expected = b"\n".join(open(d, "rb").read() for d in docs)
        assert bytes(getattr(data, split)) == expected
        assert data.meta[split]["tokens"] == len(expected)
    tiny = load_tokens(str(corpus), val_fraction=1e-6)
    assert len(tiny.meta["val"]["documents"]) == 1  # at least one document for validation
    big = load_tokens(str(corpus), val_fraction=0.999999)
    assert len(big.meta["train"]["documents"]) == 1  # at least one left for training


def test_bad_inputs_are_one_line_naming_the_parameter(corpus, tmp_path):
    one_line_error(lambda: load_tokens(str(tmp_path / "missing")), "data", "missing")
    (tmp_path / "empty").mkdir()
    one_line_error(lambda: load_tokens(str(tmp_path / "empty")), "data", "empty")
    (tmp_path / "blank.txt").write_text("")
    one_line_error(lambda: load_tokens(str(tmp_path / "blank.txt")), "data", "blank.txt")
    one_line_error(lambda: load_tokens(str(corpus / "doc01.txt")), "data", "one document")
    one_line_error(lambda: load_tokens(str(corpus), val_fraction=0), "val_fraction")
    tokens = np.arange(10, dtype=np.uint8)
    one_line_error(lambda: BatchSampler(tokens, seq_len=10, batch_size=2, seed=0), "seq_len")
    one_line_error(lambda: BatchSampler(tokens, 4, batch_size=2, seed=0, dp_size=3),
                   "batch_size", "dp")
    one_line_error(lambda: BatchSampler(tokens, 4, 2, seed=0, dp_rank=2, dp_size=2), "dp_rank")
    one_line_error(lambda: BatchSampler(tokens, 4, 2, 0).load_state_dict({}), "state")


TOKENS = np.arange(1000, dtype=np.int64) % 251  # every window is distinguishable by its start


@pytest.mark.parametrize("batch_size", [6, 7])
def test_dp_shards_concatenate_to_the_dp1_batch(batch_size):
    whole = BatchSampler(TOKENS, 8, batch_size, seed=5)
    shards = {dp: [BatchSampler(TOKENS, 8, batch_size, 5, r, dp) for r in range(dp)]
              for dp in (2, 3)}
    for _ in range(3):
        inputs, targets = whole.next()
        assert inputs.shape == (batch_size, 8) and inputs.dtype == torch.int64
        for dp, ranks in shards.items():
            batches = [r.next() for r in ranks]
            assert [len(b[0]) for b in batches] == [len(t) for t in
                                                    torch.tensor_split(inputs, dp)]
            assert torch.equal(torch.cat([b[0] for b in batches]), inputs)
            assert torch.equal(torch.cat([b[1] for b in batches]), targets)


def test_targets_are_the_next_tokens_of_the_corpus():
    tokens = np.random.default_rng(0).integers(0, 256, 500).astype(np.uint8)
    inputs, targets = BatchSampler(tokens, 16, 8, seed=1).next()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for row, target in zip(inputs, targets, strict=True):
        start = next(s for s in range(len(tokens) - 16)
                     if np.array_equal(tokens[s:s + 16], row.numpy()))
        assert np.array_equal(tokens[start + 1:start + 17], target.numpy())


def test_same_seed_same_batches_and_a_resume_continues_exactly():
    a, b, other = (BatchSampler(TOKENS, 8, 4, seed=s) for s in (0, 0, 1))
    for _ in range(3):
        batch = a.next()
        assert torch.equal(batch[0], b.next()[0])
        assert not torch.equal(batch[0], other.next()[0])
    state = a.state_dict()
    assert state == {"step": 3}
    resumed = BatchSampler(TOKENS, 8, 4, seed=0, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    uninterrupted = BatchSampler(TOKENS, 8, 4, seed=0, dp_rank=1, dp_size=2)
    for _ in range(3):
        uninterrupted.next()
    assert torch.equal(resumed.next()[0], uninterrupted.next()[0])
