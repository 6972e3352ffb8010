"""Sharded checkpoints of a training run: each rank writes only what it holds, one
manifest says where every piece of every tensor lives, and a load onto any mesh reads
the pieces each rank needs.

`RUN/checkpoints/step-N/` holds `rank-R.pt` (the pieces rank R wrote: parameters and
Adam's two moments, `pieces.Piece` keys) and `manifest.json`: the step, Adam's step
count, the loss scale, the config, and for every tensor of the one-process twin its
global shape, dtype and pieces (which rank, which block, which entries). A piece that
several ranks hold alike (data-parallel replicas, tensor-parallel copies, the tied
embedding at both pipeline ends) is written once, by the lowest of them. The protocol
is lesson 10's (`slow_networks.checkpoint_restart`): files written whole or not at all, then,
after every rank has written, `latest` names the step. A checkpoint never completed is
never loaded.

Everything else a run needs to continue bit for bit is a number: the step (the
learning rate's schedule and the sampler's position both follow from it), the loss
scale and its count of clean steps. The trainer draws no random numbers after building
its weights from a seed (no dropout; batches seeded by step), so there is no RNG state
to carry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from ..moe.moe_decoder import moe_decoder
from ..runtime import rank, world_size
from ..slow_networks.checkpoint_restart import commit, latest_step, write_whole
from .checkpoint_pieces import Holding, Piece, fill, holdings
from .config import TrainConfig, from_dict, to_dict
from .model_part import ModelPart
from .precision import LossScaler

MANIFEST = "manifest.json"


def checkpoint_dir(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def _shapes(config: TrainConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the one-process twin, by name, with its global shape."""
    return {name: tuple(p.shape) for name, p in moe_decoder(config.model).named_parameters()}


def _held(part: ModelPart, config: TrainConfig) -> list[Holding]:
    shards = part.sharded.shards if part.sharded is not None else None
    return holdings(list(part.named_parameters()), _shapes(config), part.optimizer,
                    shards, part.tp_rank)


def _everyone(mine: object) -> list:
    if world_size() == 1:
        return [mine]
    out = [None] * world_size()
    dist.all_gather_object(out, mine)
    return out


def _adam_step(optimizer: torch.optim.Optimizer) -> float:
    """Adam's own count of updates (fp16's skipped steps are not in it)."""
    steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return steps[0] if steps else 0.0


def save_checkpoint(part: ModelPart, config: TrainConfig, out: str | Path, step: int,
                    scaler: LossScaler) -> Path:
    """Every rank writes its pieces of the state after `step` steps; rank 0 writes the
    manifest and, once every rank has written, marks the checkpoint the latest."""
    directory = checkpoint_dir(out)
    folder = directory / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    held = _held(part, config)
    everyone = _everyone([h.piece for h in held])
    writer: dict[str, tuple[int, Piece]] = {}
    for r, pieces in enumerate(everyone):  # the lowest rank holding a piece writes it
        for piece in pieces:
            writer.setdefault(piece.key, (r, piece))
    # host copies: a checkpoint written from a GPU loads on any machine
    mine = {h.piece.key: {k: v.detach().to("cpu", copy=True) for k, v in h.values.items()}
            for h in held if writer[h.piece.key][0] == rank()}
    write_whole(folder / f"rank-{rank()}.pt", lambda f: torch.save(mine, f))
    if rank() == 0:
        dtype = str(held[0].values["param"].dtype).removeprefix("torch.")
        tensors: dict[str, dict] = {}
        for r, piece in writer.values():
            entry = tensors.setdefault(piece.name, {"shape": list(piece.shape), "dtype": dtype,
                                                    "pieces": []})
            entry["pieces"].append({"rank": r, "offsets": list(piece.offsets),
                                    "lengths": list(piece.lengths), "start": piece.start,
                                    "stop": piece.stop})
        manifest = {"step": step, "adam_step": _adam_step(part.optimizer),
                    "loss_scale": scaler.scale, "good_steps": scaler.good_steps,
                    "world_size": world_size(), "config": to_dict(config), "tensors": tensors,
                    # the loss-free balance's biases: state, not parameters (every rank's alike)
                    "expert_bias": [ff.balance.bias.tolist() for ff in part.balanced]}
        write_whole(folder / MANIFEST, lambda f: f.write_text(json.dumps(manifest, indent=1)))
    commit(directory, step)  # after every rank's file and the manifest
    return folder


def _saved(name: str, shape: tuple[int, ...], entry: dict) -> Piece:
    """The Piece a manifest's piece entry describes."""
    return Piece(name, shape, tuple(entry["offsets"]), tuple(entry["lengths"]),
                 entry["start"], entry["stop"])


def _latest(out: str | Path) -> tuple[int, Path, dict | None]:
    """The latest complete checkpoint of the run in `out`: (step, folder, manifest);
    (0, folder, None) when there is none."""
    directory = checkpoint_dir(out)
    step = latest_step(directory)
    folder = directory / f"step-{step}"
    return step, folder, _read_manifest(folder / MANIFEST) if step else None


def _sources(manifest: dict, piece: Piece) -> Iterable[tuple[int, Piece]]:
    """The saved pieces of `piece`'s tensor whose entries overlap its (by index range)."""
    wanted = piece.global_indices()
    low, high = int(wanted[0]), int(wanted[-1])
    for p in manifest["tensors"][piece.name]["pieces"]:
        saved = _saved(piece.name, piece.shape, p)
        have = saved.global_indices()
        if int(have[0]) <= high and int(have[-1]) >= low:
            yield p["rank"], saved


def _damaged(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: {what}; the checkpoint is damaged: resume from an earlier "
                      f"step by writing its number into {path.parent.parent / 'latest'}, or "
                      "start again with --force")


def _read_manifest(path: Path) -> dict:
    """The manifest, or one line naming the file and what is wrong with it."""
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise _damaged(path, "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _damaged(path, f"not a readable manifest ({err})") from None
    if not isinstance(manifest, dict) or not {"step", "tensors", "config"} <= set(manifest):
        raise _damaged(path, "not a minipar checkpoint manifest")
    return manifest


def _read_pieces(path: Path) -> dict:
    """A rank's file of pieces (memory-mapped: only the tensors read come off the disk),
    or one line naming the file and what is wrong with it."""
    try:
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise _damaged(path, "missing (a rank's pieces)") from None
    except Exception:  # noqa: BLE001  torch raises RuntimeError, EOFError, zip errors...
        # ...whose words (about mmap and zipfile serialization) would not say what happened
        raise _damaged(path, "unreadable (truncated, or not written by torch.save)") from None


def verify_checkpoint(out: str | Path, config: TrainConfig) -> int:
    """Before any rank starts: the latest complete checkpoint's step (0: none), after
    checking that its manifest is whole, is of this model, and that every piece it names
    is in its rank's file; else one line naming the file and what is wrong."""
    step, folder, manifest = _latest(out)
    if not step:
        return 0
    _same_model(manifest, config, folder / MANIFEST)
    wanted: dict[int, set[str]] = {}
    for name, entry in manifest["tensors"].items():
        for p in entry["pieces"]:
            wanted.setdefault(p["rank"], set()).add(_saved(name, (), p).key)
    for r, keys in sorted(wanted.items()):
        path = folder / f"rank-{r}.pt"
        missing = keys - set(_read_pieces(path))
        if missing:
            raise _damaged(path, f"lacks {len(missing)} piece(s) its manifest names, e.g. "
                                 f"{sorted(missing)[0]}")
    return step


def _same_model(manifest: dict, config: TrainConfig, path: Path) -> None:
    model = to_dict(config)["model"]
    if manifest["config"].get("model") != model:
        saved = manifest["config"].get("model") or {}
        differ = sorted(k for k in model if saved.get(k) != model[k])
        raise ValueError(f"{path} is a checkpoint of another model "
                         f"({', '.join('model.' + k for k in differ)} differ); resume with "
                         "the config it was saved with")


def load_checkpoint(part: ModelPart, config: TrainConfig, out: str | Path,
                    scaler: LossScaler) -> int:
    """Load the latest complete checkpoint of the run in `out` into this rank's part,
    whatever mesh wrote it (reading only the ranks' files holding pieces this rank needs);
    restore the loss scale; return the steps it had done (0: none)."""
    step, folder, manifest = _latest(out)
    if not step:
        return 0
    _same_model(manifest, config, folder / MANIFEST)
    files: dict[int, dict] = {}
    for holding in _held(part, config):
        sources = []
        for r, saved in _sources(manifest, holding.piece):
            if r not in files:
                files[r] = _read_pieces(folder / f"rank-{r}.pt")
            if saved.key not in files[r]:
                raise ValueError(f"{folder / f'rank-{r}.pt'} lacks the piece {saved.key} its "
                                 "manifest names; the checkpoint is damaged: resume from an "
                                 "earlier one (delete this step's folder and its latest)")
            sources.append((saved, files[r][saved.key]))
        with torch.no_grad():
            fill(holding, sources)
    # torch's Adam keeps its step count on the host
    adam_step = torch.tensor(float(manifest["adam_step"]))
    for state in part.optimizer.state.values():
        state["step"] = adam_step.clone()
    if part.sharded is not None and config.parallel.zero in (1, 2):
        # ZeRO-1/2 keep whole parameters: gather the loaded slices (ZeRO-3 gathers each
        # unit from them when it next computes)
        part.sharded.gather_parameters()
    scaler.scale, scaler.good_steps = manifest["loss_scale"], manifest["good_steps"]
    for ff, bias in zip(part.balanced, manifest.get("expert_bias", []), strict=False):
        ff.balance.bias.copy_(torch.tensor(bias))
    return step



def load_whole(part: ModelPart, config: TrainConfig, state: dict[str, torch.Tensor]) -> None:
    """Load one process's state_dict (every tensor whole, under the twin's names: e.g. a
    Hugging Face checkpoint, renamed) into this rank's part, on any mesh: each rank keeps
    the pieces it holds, as if each tensor were one piece of a checkpoint. Adam starts
    fresh."""
    for holding in _held(part, config):
        name, shape = holding.piece.name, holding.piece.shape
        if tuple(state[name].shape) != shape:
            raise ValueError(f"{name} is {list(state[name].shape)} in the weights given, but "
                             f"{list(shape)} in this model")
        whole = Piece(name, shape, (0,) * len(shape), shape, 0, state[name].numel())
        with torch.no_grad():  # the parameter only: Adam's moments stay the zeros they are
            fill(Holding(holding.piece, {"param": holding.values["param"]}),
                 [(whole, {"param": state[name].reshape(-1)})])
    if part.sharded is not None and config.parallel.zero in (1, 2):
        part.sharded.gather_parameters()  # as after a load: ZeRO-1/2 compute with whole ones


def consolidate(out: str | Path) -> tuple[TrainConfig, int, dict[str, torch.Tensor]]:
    """The latest complete checkpoint of the run in `out` as one process's state_dict
    (every tensor whole, the tied head under its own key too), with its config and step:
    what the one-process twin loads with plain `load_state_dict`."""
    step, folder, manifest = _latest(out)
    if not step:
        raise ValueError(f"{out} holds no complete checkpoint ({checkpoint_dir(out) / 'latest'} "
                         "is missing); train with --out there first")
    config = from_dict(manifest["config"], str(folder / MANIFEST))
    verify_checkpoint(out, config)
    files = {r: _read_pieces(folder / f"rank-{r}.pt")
             for r in {p["rank"] for t in manifest["tensors"].values() for p in t["pieces"]}}
    state = {}
    for name, entry in manifest["tensors"].items():
        shape = tuple(entry["shape"])
        # one process's state_dict, in host memory for the file
        whole = torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        target = Holding(Piece(name, shape, (0,) * len(shape), shape, 0, whole.numel()),
                         {"param": whole.view(-1)})
        sources = [(_saved(name, shape, p), files[p["rank"]][_saved(name, shape, p).key])
                   for p in entry["pieces"]]
        fill(target, sources)
        state[name] = whole
    if config.model.tied:  # the twin's state_dict names the shared weight twice
        state["head.weight"] = state["embed.weight"]
    return config, step, state
