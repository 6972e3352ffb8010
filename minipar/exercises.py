"""Exercise checks and learners' copies of the lessons.

A lesson's exercise is a function whose body sits between ``### BEGIN SOLUTION`` and
``### END SOLUTION``. `minipar lessons --student DIR` writes copies where that part
is replaced by a stub raising NotImplementedError that names the exercise. The
`check_*` functions run the learner's function on real ranks against a
single-process reference and say what is wrong, rank by rank.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch

from .runtime import RankError, launch

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


class ExerciseError(AssertionError):
    """The learner's function ran but gave a wrong answer; the message says where."""


def _run_on_ranks(name: str, fn: Callable, world_size: int, *args) -> list:
    try:
        return launch(fn, world_size, *args, backend="gloo", timeout=30)
    except RankError as err:
        if "NotImplementedError" in str(err):
            raise ExerciseError(f"{name}: not written yet. Replace the `raise "
                                "NotImplementedError` line with your code.") from None
        raise


# --- lesson 00: a global mean over ranks that hold different amounts of data ---

def _local_losses(rank: int) -> torch.Tensor:
    """Rank r holds r+1 per-sample losses: the shards are deliberately uneven."""
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.rand(rank + 1, generator=generator, dtype=torch.float64)


def _call_global_mean(fn: Callable) -> float:
    import minipar

    return float(fn(_local_losses(minipar.rank())))


def check_global_mean_loss(global_mean_loss: Callable, world_size: int = 4) -> str:
    """Run `global_mean_loss(local_losses)` on `world_size` ranks with uneven shards.

    Every rank must return the mean over all samples of all ranks, the number one
    process would compute on the whole batch.
    """
    got = _run_on_ranks("global_mean_loss", _call_global_mean, world_size, global_mean_loss)
    shards = [_local_losses(r) for r in range(world_size)]
    everything = torch.cat(shards)
    expected = float(everything.mean())
    hints = {
        "the mean of the ranks' means: ranks hold different numbers of samples, so weight "
        "each rank by its count (all-reduce the sum and the count)":
            float(torch.stack([s.mean() for s in shards]).mean()),
        "the sum over all samples: divide by the total number of samples":
            float(everything.sum()),
    }
    for rank, value in enumerate(got):
        if math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-12):
            continue
        why = next((hint for hint, v in hints.items() if math.isclose(value, v, rel_tol=1e-9)),
                   None)
        if why is None and math.isclose(value, float(shards[rank].mean()), rel_tol=1e-9):
            why = "this rank's own mean: combine the ranks with dist.all_reduce"
        raise ExerciseError(
            f"global_mean_loss: rank {rank} returned {value:.6f}, expected {expected:.6f} "
            f"(the mean of all {everything.numel()} samples)."
            + (f" {value:.6f} is {why}." if why else ""))
    return (f"global_mean_loss: correct on all {world_size} ranks "
            f"({expected:.6f} = mean of {everything.numel()} samples)")


# --- learners' copies ---

def strip_solutions(source: str, cell_label: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION block with a stub naming its exercise."""
    lines, out, inside = source.split("\n"), [], False
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError(f"{cell_label}: {BEGIN} inside another solution block")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            name = _exercise_name(lines[:i], indent) or cell_label
            out.append(f'{indent}raise NotImplementedError("exercise {name}: '
                       'write your code here")')
        elif stripped.startswith(END):
            if not inside:
                raise ValueError(f"{cell_label}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{cell_label}: {BEGIN} without {END}")
    return "\n".join(out)


def _exercise_name(before: list[str], indent: str) -> str | None:
    """The innermost enclosing `def` above the solution block."""
    for line in reversed(before):
        match = re.match(r"(\s*)def (\w+)", line)
        if match and len(match.group(1)) < len(indent):
            return match.group(2)
    return None


def student_notebook(notebook: dict) -> dict:
    """A learner's copy of a notebook: solutions stubbed, every output cleared."""
    copy = json.loads(json.dumps(notebook))
    for index, cell in enumerate(copy["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if BEGIN in source:
            source = strip_solutions(source, f"cell {index}")
        cell["source"] = source.splitlines(keepends=True)
        cell["outputs"], cell["execution_count"] = [], None
    return copy


def write_student_copies(source_dir: str | Path, dest_dir: str | Path) -> list[Path]:
    """Write a learner's copy of every lesson notebook in `source_dir` into `dest_dir`."""
    source_dir, dest_dir = Path(source_dir), Path(dest_dir)
    notebooks = sorted(source_dir.glob("[0-9][0-9]_*.ipynb"))
    if not notebooks:
        raise ValueError(f"no lesson notebooks (NN_name.ipynb) in {source_dir}; "
                         "pass --source with the lessons folder of a minipar checkout")
    if dest_dir.resolve() == source_dir.resolve():
        raise ValueError("the student folder must differ from the lessons folder, "
                         "or the solutions would be overwritten")
    dest_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks:
        target = dest_dir / path.name
        copy = student_notebook(json.loads(path.read_text()))
        target.write_text(json.dumps(copy, indent=1, ensure_ascii=False) + "\n")
        written.append(target)
    return written
