"""The placement trap (issue 43): on a CPU, catch every tensor minipar would put off the
rank's device on a GPU. The trap watches only minipar's files, so these tests run code
compiled under a file name inside the package."""

import os

import pytest
import torch

import minipar
from minipar.runtime import device
from minipar.runtime.placement import (
    TRAP_ENV,
    PlacementError,
    host_allocations,
    placement_trap,
)

FAKE = os.path.join(os.path.dirname(minipar.__file__), "fake_module.py")


def as_minipar(source: str, **names) -> dict:
    """Run `source` as if it were a file of the package; returns its namespace."""
    scope = {"torch": torch, "device": device, "host_allocations": host_allocations, **names}
    exec(compile(source, FAKE, "exec"), scope)
    return scope


def test_a_tensor_made_without_a_device_is_caught_with_its_file_and_line():
    with placement_trap(), pytest.raises(PlacementError,
                                         match=r"minipar/fake_module.py:2: torch.zeros made a "
                                               r"tensor without device="):
        as_minipar("x = 1\ny = torch.zeros(3)\n")


def test_a_device_written_out_is_caught_and_the_ranks_device_passes():
    with placement_trap():
        with pytest.raises(PlacementError, match="device='cpu', written out"):
            as_minipar("y = torch.ones(2, device='cpu')\n")
        scope = as_minipar("y = torch.ones(2, device=device())\n"
                           "z = torch.arange(3, device=y.device)\n"
                           "m = torch.empty(4, device='meta')\n")
    assert scope["z"].tolist() == [0, 1, 2]


def test_host_allocations_is_the_stated_allow_list():
    with placement_trap():
        scope = as_minipar("with host_allocations():\n    y = torch.randn(2)\n")
    assert scope["y"].shape == (2,)


def test_torch_places_its_own_tensors_but_a_module_is_traced_to_who_built_it():
    with placement_trap():
        p = torch.nn.Parameter(torch.ones(3, device=device()))
        opt = torch.optim.Adam([p])  # its step counters are torch's to place
        p.grad = torch.ones(3, device=device())
        opt.step()
        with pytest.raises(PlacementError, match=r"fake_module.py:1: torch.empty .*building a "
                                                 r"module"):
            as_minipar("layer = torch.nn.Linear(2, 2)\n")
        with host_allocations():
            layer = as_minipar("layer = torch.nn.Linear(2, 2)\n")["layer"]
    assert layer.weight.shape == (2, 2)


def test_the_survey_mode_lists_each_place_once_and_carries_on(capsys):
    with placement_trap(strict=False):
        as_minipar("for _ in range(3):\n    y = torch.zeros(1)\n")
    err = capsys.readouterr().err
    assert err.count("placement: minipar/fake_module.py:2") == 1


def test_the_decoder_and_the_twins_build_on_the_ranks_device_under_the_trap():
    from minipar.decoder import Decoder, DecoderConfig
    from minipar.models import mlp, regression_data

    with placement_trap():
        model = Decoder(DecoderConfig(layers=1, hidden=32, heads=2, kv_heads=1, seq_len=16))
        model(torch.zeros(1, 16, dtype=torch.long, device=device())).sum().backward()
        x, y = regression_data(4, 3)
        mlp([3, 4, 1])(x)
    # drawn in float32 on the host whatever the default dtype: the same weights as before
    torch.set_default_dtype(torch.float64)
    try:
        again = Decoder(DecoderConfig(layers=1, hidden=32, heads=2, kv_heads=1, seq_len=16))
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.equal(again.embed.weight, model.embed.weight)


def test_ranks_run_under_the_trap_when_the_launcher_asks(monkeypatch):
    def stray():
        as_minipar("y = torch.zeros(1)\n")  # a stray allocation in "minipar"

    monkeypatch.setenv(TRAP_ENV, "1")
    with pytest.raises(minipar.RankError, match="PlacementError"):
        minipar.launch(stray, 1, timeout=60)


def test_a_tensor_someone_elses_code_makes_is_theirs_even_when_minipar_calls_it():
    """A learner's function, a test's or a notebook cell's, run by minipar (a rank runs
    every task from worker.py): the trap judges only minipar's own lines."""
    with placement_trap():
        scope = as_minipar("y = make()\n", make=lambda: torch.zeros(3))
    assert scope["y"].shape == (3,)
