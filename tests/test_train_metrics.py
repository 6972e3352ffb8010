"""A run's metrics as TensorBoard scalars: every step's numbers reach the event writer
(a fake one, so this holds without TensorBoard installed), and a real run leaves event
files in tb/ holding every step's loss when it is installed."""

import math
import threading
import time

import pytest
import torch

import minipar
from minipar.decoder import DecoderConfig
from minipar.train.config import DataConfig, LoopConfig, OptimConfig, TrainConfig
from minipar.train.loop import train
from minipar.train.metrics import SCALARS, MetricsLog, StepClock, read_metrics


class FakeWriter:
    """Records add_scalar calls the way SummaryWriter takes them."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_every_steps_scalars_reach_the_writer(tmp_path):
    """Each number of each record, under its metrics.jsonl name and step; a grad_norm of
    None (an fp16 overflow) is left out, not written as a number."""
    fake = FakeWriter()
    folders = []
    log = MetricsLog(tmp_path / "metrics.jsonl", writer=lambda f: folders.append(f) or fake)
    records = [
        {"step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 2.0, "tokens_per_s": 900.0,
         "mfu": 0.3, "seconds": 1.0, "loss_scale": 1024.0, "skipped": False},
        {"step": 2, "loss": 4.5, "lr": 2e-3, "grad_norm": None, "tokens_per_s": 950.0,
         "mfu": 0.31, "seconds": 1.0, "loss_scale": 512.0, "skipped": True, "val_loss": 4.7},
    ]
    for record in records:
        log.write(record)
    log.close()
    assert folders == [tmp_path / "tb"] and fake.closed
    expected = [(name, r[name], r["step"]) for r in records for name in SCALARS
                if r.get(name) is not None]
    assert sorted(fake.scalars) == sorted(expected)
    assert ("grad_norm", None, 2) not in fake.scalars
    assert ("val_loss", 4.7, 2) in fake.scalars and len(fake.scalars) == 12
    assert read_metrics(tmp_path / "metrics.jsonl") == records  # the JSON log unchanged


def test_no_writer_means_only_the_json_log(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl", writer=lambda folder: None)
    log.write({"step": 1, "loss": 1.0})
    log.close()
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_a_run_leaves_event_files_with_every_steps_scalars(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("torch.utils.tensorboard")
    corpus = tmp_path / "corpus"  # split by document: a few files
    corpus.mkdir()
    gen = torch.Generator().manual_seed(0)
    for d in range(4):
        picks = torch.randint(0, 6, (600,), generator=gen).tolist()
        (corpus / f"doc{d}.py").write_text(
            " ".join(["def", "return", "class", "self", "yield", "for"][i] for i in picks))
    config = TrainConfig(
        model=DecoderConfig(layers=1, hidden=16, heads=2, kv_heads=1, seq_len=16),
        data=DataConfig(path=str(corpus), val_fraction=0.2),
        optim=OptimConfig(warmup_steps=1),
        train=LoopConfig(batch_size=4, steps=4, eval_every=2, eval_batches=1, log_every=4))
    out = tmp_path / "run"
    minipar.launch(train, 1, config, out)
    board = event_accumulator.EventAccumulator(str(out / "tb"))
    board.Reload()
    records = read_metrics(out / "metrics.jsonl")
    assert set(board.Tags()["scalars"]) == {"loss", "val_loss", "lr", "grad_norm",
                                            "tokens_per_s", "mfu"}
    for name in ("loss", "lr", "grad_norm", "mfu"):
        events = board.Scalars(name)
        assert [e.step for e in events] == [1, 2, 3, 4], name
        assert all(math.isclose(e.value, r[name], rel_tol=1e-6)  # stored as float32
                   for e, r in zip(events, records, strict=True)), name
    assert [e.step for e in board.Scalars("val_loss")] == [2, 4]
    # every step's split: the training thread computed, so its CPU time is never zero
    assert all(r["cpu_seconds"] > 0 and r["other_cpu_seconds"] >= 0 and r["idle_seconds"] >= 0
               for r in records)


def _spin(seconds: float) -> None:
    """Compute on this thread until it has had `seconds` of CPU (however busy the cores)."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


@pytest.mark.parametrize("work", ["own thread", "other thread", "sleep"])
def test_a_steps_time_is_split_into_its_threads_cpu_other_threads_and_neither(work):
    with StepClock() as clock:
        if work == "own thread":
            _spin(0.05)
        elif work == "other thread":
            helper = threading.Thread(target=_spin, args=(0.05,))
            helper.start()
            helper.join()
        else:
            time.sleep(0.05)
    assert clock.seconds >= 0.05
    by_part = {"own thread": clock.cpu_seconds, "other thread": clock.other_cpu_seconds,
               "sleep": clock.idle_seconds}
    assert by_part[work] >= 0.05  # the part that did the work holds all of it
    # the other parts hold what starting a thread and waking up cost: far from the work
    assert all(seconds < 0.025 for part, seconds in by_part.items() if part != work), by_part
