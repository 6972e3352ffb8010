"""The faked device (issue 69, runtime/faked_device.py): rank code computes on a device
that is not the host, an op of the library's that mixes the two fails there as on a GPU
and names its line, and the audit's findings 1 and 5 are caught when put back."""

import pytest
import torch

import minipar
from minipar import nccl_rehearsal
from minipar.runtime import faked_device
from minipar.runtime.device import FAKED_ENV, faked_for_task


def test_its_tensors_are_on_the_device_and_leave_it_only_by_a_copy():
    with faked_for_task(True, 0):
        d = minipar.device()
        x = torch.randn(3, 4, device=d)
        w = torch.nn.Linear(4, 2, dtype=torch.float32).to(d)
        assert d.type == "fakegpu" and x.device == d and w.weight.device == d
        assert isinstance(w.weight, torch.nn.Parameter)
        w(x).sum().backward()
        assert w.weight.grad.device == d
        assert x.cpu().device.type == "cpu" and type(x.cpu()) is torch.Tensor
        with pytest.raises(TypeError, match="can't convert fakegpu:0"):
            x.numpy()
        before = faked_device.syncs
        x.sum().item()
        assert faked_device.syncs == before + 1
    assert minipar.device().type == "cpu"


def test_a_library_op_that_mixes_host_and_device_names_its_line():
    from minipar.decoder import DecoderConfig, decoder

    with faked_for_task(True, 0):
        model = decoder(DecoderConfig(layers=1, hidden=16, heads=2, kv_heads=1, seq_len=8))
        ids = torch.zeros(2, 8, dtype=torch.int64)  # host ids: an embedding on a GPU refuses
        with pytest.raises(faked_device.DeviceMixError, match=r"decoder\.py:\d+: aten::"):
            model(ids)
        assert model(ids.to(minipar.device())).device == minipar.device()
        # a test's (or a learner's) own mix is theirs to make: only library lines fail
        assert (torch.ones(2, device=minipar.device()) + torch.ones(2)).device.type \
            == "fakegpu"


def _trainer_with_host_batches(put_back: bool):
    """Finding 1 put back: the sampler's batch left on the host."""
    from minipar.train import data

    if put_back:
        original = data.BatchSampler.next
        data.BatchSampler.next = lambda self: tuple(t.cpu() for t in original(self))
    try:
        nccl_rehearsal.trainer({"pp": 2, "microbatches": 2}, {"layers": 2})
        return "finished"
    except faked_device.DeviceMixError as err:
        return str(err)
    finally:
        if put_back:
            data.BatchSampler.next = original


def test_finding_1_put_back_is_caught_and_named(cluster2, monkeypatch):
    monkeypatch.setenv(FAKED_ENV, "1")
    caught = cluster2.run(_trainer_with_host_batches, True)
    assert all(c.startswith("train/model_part.py:") and "host tensor indexed" in c
               for c in caught), caught
    assert cluster2.run(_trainer_with_host_batches, False) == ["finished"] * 2


def _offload_step(put_back: bool) -> str:
    """Finding 5 put back: the host adds the gradients right after their non-blocking copy."""
    from minipar.models import mse
    from minipar.sharded import swap
    from minipar.sharded.offload import Offload
    from minipar.sharded.offload_bench import batch, offload_model

    landed = swap.copies_landed
    if put_back:
        swap.copies_landed = lambda: None
    try:
        model, (x, y) = offload_model(16, 2, torch.float64, seed=3), batch(4, 16, torch.float64)
        off = Offload(model, lambda p: torch.optim.Adam(p, lr=1e-2), "keep", "host")
        mse(off(x), y).backward()
        off.step()
        return "finished"
    except faked_device.DeviceMixError as err:
        return str(err)
    finally:
        swap.copies_landed = landed


def test_finding_5_put_back_is_caught_and_named():
    with faked_for_task(True, 0):
        caught = _offload_step(True)
        assert caught.startswith("sharded/swap.py:") and "non-blocking copy" in caught, caught
        assert _offload_step(False) == "finished"


def _layouts() -> list[str]:
    """Trainer layouts beyond the NCCL rehearsal's (which also runs on the faked device):
    ZeRO 1-3, recomputation, fp16, bf16, fp8, untied weights."""
    done = []
    for parallel, train in [({"dp": 2, "zero": 1}, {}), ({"dp": 2, "zero": 3}, {}),
                            ({"dp": 2, "zero": 2}, {"recompute": "full", "precision": "fp16"}),
                            ({"pp": 2}, {"precision": "bf16", "recompute": "selective"}),
                            ({"dp": 2}, {"precision": "fp8"})]:
        nccl_rehearsal.trainer(parallel, {"tied": "precision" in train}, train)
        done.append(str(parallel))
    return done


def test_trainer_layouts_run_on_the_faked_device(cluster2, monkeypatch):
    monkeypatch.setenv(FAKED_ENV, "1")
    assert all(len(r) == 5 for r in cluster2.run(_layouts))


def _ddp_and_fsdp_streams(put_back: bool) -> dict:
    """Finding 6: where DDP's bucket all-reduces and FSDP's prefetched all-gathers queue
    their work, and what the streams waited for. Put back: a CommThread with no stream of
    its own, whose results are read as they are."""
    from minipar.collectives import background
    from minipar.data_parallel import DataParallel
    from minipar.models import mlp, mse, regression_data
    from minipar.sharded.fsdp import FullyShardedDataParallel

    made, handed, used = background.side_stream, background.handed_over, background.used_on
    if put_back:
        background.side_stream, background.handed_over = lambda: None, lambda v, e: v
        background.used_on = lambda v, s: None
    try:
        default = faked_device.current_stream()
        waited_before, used_before = len(default.waited), len(faked_device.used_on)
        ddp = DataParallel(mlp([32, 64, 64, 1], seed=1, dtype=torch.float64),
                           bucket_bytes=1 << 14)
        streams = []
        launch = ddp._all_reduce
        ddp._all_reduce = lambda bucket: (streams.append(faked_device.current_stream()),
                                          launch(bucket))
        x, y = regression_data(8, 32, seed=2, dtype=torch.float64)
        mse(ddp(x), y).backward()
        comm = {s for s in streams if not s.default}
        fsdp = FullyShardedDataParallel(mlp([32, 64, 64, 1], seed=1, dtype=torch.float64),
                                        lambda p: torch.optim.SGD(p, lr=0.1), prefetch=True)
        mse(fsdp(x), y).backward()
        fsdp.step()
        return {
            "buckets": len(streams),
            "on a stream of their own": len(streams) > 1 and len(comm) == 1
            and all(not s.default for s in streams),
            "the side stream waited for compute": bool(comm) and all(
                any(e.stream is default for e in s.waited) for s in comm),
            "compute waited for the side stream": any(
                e.stream in comm for e in default.waited[waited_before:]),
            "handed-over tensors recorded on compute": any(
                s is default for _, s in faked_device.used_on[used_before:]),
            # FSDP's gradients, made by compute and reduced on its thread's stream
            "given tensors recorded on a side stream": any(
                not s.default for _, s in faked_device.used_on[used_before:])}
    finally:
        background.side_stream, background.handed_over, background.used_on = made, handed, used


def test_finding_6_communication_threads_queue_on_their_own_streams(cluster2, monkeypatch):
    monkeypatch.setenv(FAKED_ENV, "1")
    fixed, old = cluster2.run(_ddp_and_fsdp_streams, False)[0], \
        cluster2.run(_ddp_and_fsdp_streams, True)[0]
    assert fixed["buckets"] > 1 and all(fixed.values()), fixed
    # put back, the all-reduces queue behind compute on its stream, and nothing is handed over
    assert not any(v for k, v in old.items() if k != "buckets"), old


def _devices_background_threads_open() -> list[int]:
    from minipar.collectives.background import CommThread
    from minipar.sharded.swap import CopyStream

    faked_device.opened.clear()  # this process's earlier tasks are not this test's
    CopyStream(background=True).submit("copy", 0, lambda: None).result()
    CommThread().submit(lambda: None).result()
    return sorted(faked_device.opened)


def test_finding_10_background_threads_work_on_their_ranks_device(cluster2, monkeypatch):
    """A thread that never set its device works on device 0: on a GPU, a context on GPU 0
    for every rank that offloads or communicates in the background (the audit's finding
    10). Put back (a copy thread entering its stream first), rank 1 opens device 0."""
    monkeypatch.setenv(FAKED_ENV, "1")
    assert cluster2.run(_devices_background_threads_open) == [[0], [1]]
    assert cluster2.run(_stream_entered_first) == [[0], [0, 1]]


def _stream_entered_first() -> list[int]:
    import threading

    faked_device.opened.clear()
    stream = faked_device.Stream(minipar.device())

    def copy_thread():
        with faked_device.stream(stream):
            pass

    thread = threading.Thread(target=copy_thread)
    thread.start()
    thread.join()
    return sorted(faked_device.opened)
