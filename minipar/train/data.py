"""The trainer's data: real text with no download, tokens cached on disk, batches by step.

The default corpus is the Python standard library's own source (every `*.py` file of
the interpreter running this), present on every machine. Each file is one document; a
seeded shuffle of the documents sends `val_fraction` of them to validation, so no
document is split between training and validation. Tokens are written once into
memory-mapped files keyed by the files' paths, sizes and modification times, and read
back without touching the corpus again.

`BatchSampler` draws step k's global batch from a generator seeded by (seed, k) alone:
every rank sees the same global batch whatever the dp size, takes its rows with
`torch.tensor_split` (the package's convention, see `data_parallel/ddp.py`), and a
resumed run needs only the step to continue exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..runtime import device

CACHE_DIR_ENV = "MINIPAR_CACHE"
CACHE_FORMAT = 1  # bump when the cache's layout changes, so old caches are never trusted
SKIPPED_FOLDERS = {"site-packages", "dist-packages", "__pycache__"}


def cache_dir() -> Path:
    """Where token caches are kept: $MINIPAR_CACHE, else ~/.cache/minipar/."""
    chosen = os.environ.get(CACHE_DIR_ENV)
    return Path(chosen) if chosen else Path.home() / ".cache" / "minipar"


class Tokenizer(Protocol):
    """What the data needs of a tokenizer; a BPE with these four members plugs in."""

    name: str  # part of the cache key: a different tokenizer never reads another's tokens
    vocab_size: int

    def encode(self, text: str | bytes) -> list[int]: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """One token per byte of UTF-8: 256 tokens, nothing to train, any text round-trips."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str | bytes) -> list[int]:
        """The bytes of `text` (UTF-8 if it is a str) as ids in [0, 256)."""
        return list(text.encode("utf-8") if isinstance(text, str) else bytes(text))

    def decode(self, ids) -> str:
        """The text whose UTF-8 bytes are `ids`; a cut multi-byte character becomes U+FFFD."""
        # a window sampled mid-character is normal, so decoding must not raise
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _stdlib_files() -> list[Path]:
    """Every `*.py` file of this interpreter's standard library, installed packages left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        # pruned in place so os.walk never enters them; sorted so the walk's order is fixed
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_FOLDERS)
        found += [Path(folder, f) for f in sorted(files) if f.endswith(".py")]
    return found


def _folder_files(root: Path) -> list[Path]:
    """Every regular file below `root`, sorted, hidden files and folders and caches skipped."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        found += [Path(folder, f) for f in sorted(files)
                  if not f.startswith(".") and os.path.isfile(os.path.join(folder, f))]
    return sorted(found)


def corpus_files(path: str | None) -> list[Path]:
    """The documents of a corpus: None for Python's standard library, a file, or a folder."""
    if path is None:
        files = _stdlib_files()
        where = "Python's standard library"
    else:
        # absolute, so a relative and an absolute name of one corpus share a cache
        root = Path(path).expanduser().resolve()
        where = repr(str(path))
        if not root.exists():
            raise ValueError(f"data {where} does not exist; name a text file, a folder of them, "
                             "or leave data unset for Python's standard library")
        files = [root] if root.is_file() else _folder_files(root)
    if not files:
        raise ValueError(f"data {where} holds no files; name a text file or a folder of them")
    if all(f.stat().st_size == 0 for f in files):
        raise ValueError(f"data {where} holds no bytes (every file is empty); name a file with "
                         "text in it")
    if path is not None:
        binary = next((f for f in files if _looks_binary(f)), None)
        if binary is not None:
            raise ValueError(f"data {where}: {binary} is not text (it holds a NUL byte); the "
                             "trainer reads text: name text files, or move it out of the folder")
    return files


def _looks_binary(path: Path) -> bool:
    """A NUL byte in the first 8 KiB: git's test for a binary file (text never holds one)."""
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def check_corpus(path: str | None, val_fraction: float, seed: int, seq_len: int) -> TokenData:
    """Before any rank starts: the corpus's tokens (the cache built here, once), each split
    long enough for one sequence; else one line saying what to change."""
    tokens = load_tokens(path, val_fraction, seed)
    where = "Python's standard library" if path is None else repr(str(path))
    for split in ("train", "val"):
        held = len(getattr(tokens, split))
        if held < seq_len + 1:
            raise ValueError(f"data {where}: its {split} split holds {held} tokens, fewer than "
                             f"one sequence of model.seq_len + 1 = {seq_len + 1}; give it more "
                             "text or use a smaller model.seq_len")
    return tokens


@dataclass(frozen=True)
class TokenData:
    """A corpus's tokens: `train` and `val` as read-only memory maps, `meta` as saved."""

    train: np.memmap
    val: np.memmap
    meta: dict


def _token_dtype(tokenizer: Tokenizer) -> type:
    if tokenizer.vocab_size <= 256:
        return np.uint8
    if tokenizer.vocab_size <= 65536:
        return np.uint16
    raise ValueError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens; the cache "
                     "stores ids as uint16, so use a vocabulary of at most 65536")


def _cache_key(files: list[Path], tokenizer: Tokenizer, val_fraction: float, seed: int) -> str:
    """A hash of everything the cached tokens depend on; the corpus is stat'ed, not read."""
    stats = [(str(f), (s := f.stat()).st_size, s.st_mtime_ns) for f in files]
    described = json.dumps([CACHE_FORMAT, tokenizer.name, stats, val_fraction, seed])
    return hashlib.sha256(described.encode()).hexdigest()[:20]


def _write_split(out: Path, documents: list[Path], tokenizer: Tokenizer, dtype: type) -> int:
    """Write the tokens of `documents`, newline-separated, to `out` atomically; their count."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    separator = np.asarray(tokenizer.encode("\n"), dtype=dtype).tobytes()
    count = 0
    try:
        with open(tmp, "wb") as f:
            for i, document in enumerate(documents):
                if i:
                    f.write(separator)
                    count += len(separator) // np.dtype(dtype).itemsize
                tokens = np.asarray(tokenizer.encode(document.read_bytes()), dtype=dtype)
                f.write(tokens.tobytes())
                count += len(tokens)
        # a rename within one folder is atomic: the name is absent or names the whole file
        os.replace(tmp, out)
    except BaseException:  # Ctrl-C included: no half-written file is left behind
        tmp.unlink(missing_ok=True)
        raise
    return count


def _split_documents(files: list[Path], val_fraction: float, seed: int,
                     where: str) -> tuple[list[Path], list[Path]]:
    """(train, val) documents: a seeded shuffle, the first val_fraction of it to validation."""
    # an empty file holds no text, so it is no document (and would leave a split empty)
    documents = [f for f in files if f.stat().st_size > 0]
    if len(documents) < 2:
        raise ValueError(f"data {where} is one document; the split into train and val is by "
                         "document, so name a folder with at least 2 non-empty files")
    random.Random(seed).shuffle(documents)
    # at least one document for validation and at least one left for training
    n_val = min(max(1, round(val_fraction * len(documents))), len(documents) - 1)
    return documents[n_val:], documents[:n_val]


def load_tokens(path: str | None = None, val_fraction: float = 0.01, seed: int = 0,
                tokenizer: Tokenizer | None = None) -> TokenData:
    """The tokens of the corpus at `path` (None: Python's standard library), split by
    document into train and val; built into the cache on first use, memory-mapped after."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1 (e.g. 0.01); got {val_fraction!r}")
    tokenizer = tokenizer or ByteTokenizer()
    dtype = _token_dtype(tokenizer)
    files = corpus_files(path)
    where = "Python's standard library" if path is None else repr(str(path))
    folder = cache_dir() / "tokens" / _cache_key(files, tokenizer, val_fraction, seed)
    meta_file = folder / "meta.json"
    # meta.json is written last: if it is there, both splits were complete before it
    if not meta_file.exists():
        train_docs, val_docs = _split_documents(files, val_fraction, seed, where)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"format": CACHE_FORMAT, "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size, "dtype": np.dtype(dtype).name,
                "val_fraction": val_fraction, "seed": seed, "files": [str(f) for f in files]}
        for split, documents in (("train", train_docs), ("val", val_docs)):
            tokens = _write_split(folder / f"{split}.bin", documents, tokenizer, dtype)
            meta[split] = {"documents": [str(d) for d in documents], "tokens": tokens}
        tmp = folder / f"meta.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, meta_file)
    meta = json.loads(meta_file.read_text())
    splits = {split: np.memmap(folder / f"{split}.bin", dtype=meta["dtype"], mode="r")
              for split in ("train", "val")}
    return TokenData(train=splits["train"], val=splits["val"], meta=meta)


class BatchSampler:
    """Random windows of a token array, the same global batch per step on every rank.

    Step k draws `batch_size` window starts from a generator seeded by (seed, k); rank
    `dp_rank` of `dp_size` takes its rows with torch.tensor_split, so the ranks' batches,
    concatenated in rank order, are the dp=1 batch. `next()` gives (inputs, targets) as
    int64 tensors [local_batch, seq_len], targets one token ahead.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        tokens = np.asarray(tokens)  # a memmap stays a view of the file: nothing is read yet
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array of ids; got shape {tokens.shape}")
        if seq_len < 1 or seq_len + 1 > len(tokens):
            raise ValueError(f"seq_len={seq_len} needs windows of {seq_len + 1} tokens and this "
                             f"split holds {len(tokens)}; use 1 <= seq_len <= {len(tokens) - 1} "
                             "or more data")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size) with dp_size >= 1; got "
                             f"dp_rank={dp_rank}, dp_size={dp_size}")
        if batch_size < dp_size:
            raise ValueError(f"batch_size={batch_size} sequences cannot feed dp={dp_size} ranks "
                             f"(each needs at least one); use batch_size >= {dp_size} or a "
                             "smaller dp")
        if seed < 0:
            raise ValueError(f"seed must be >= 0; got {seed}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.step = 0

    def global_starts(self, step: int) -> np.ndarray:
        """Where step `step`'s windows begin in the token array, for the whole global batch."""
        # seeded by (seed, step) alone: no state carried between steps, so any step can be
        # drawn first, by any rank, at any dp size
        rng = np.random.default_rng([self.seed, step])
        # high is exclusive: the last start leaves room for seq_len + 1 tokens
        return rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of the current step, on the rank's device; then
        moves to the next step."""
        starts = torch.from_numpy(self.global_starts(self.step))
        # tensor_split: the first batch_size mod dp ranks get one sequence more (see ddp.shard)
        local = torch.tensor_split(starts, self.dp_size)[self.dp_rank].tolist()
        windows = np.stack([self.tokens[s:s + self.seq_len + 1] for s in local])
        # drawn on the host, then copied once to where the model is (a GPU's embedding
        # refuses host ids); pinned, so the copy does not wait on pageable memory
        windows = torch.from_numpy(windows.astype(np.int64))
        if device().type == "cuda":
            windows = windows.pin_memory().to(device(), non_blocking=True)
        else:
            windows = windows.to(device())
        self.step += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        """The sampler's part of the training state: the next step to draw."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a `state_dict()`: the next batch is the one it would have drawn."""
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"state must be a BatchSampler.state_dict() like {{'step': 10}}; "
                             f"got {state!r}")
        self.step = step
