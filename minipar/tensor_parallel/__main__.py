"""Tensor parallelism: the decoder's SwiGLU and block (with and without
sequence parallelism) split over the ranks, each rank's output checked against the
one-process twin. Any --ranks runs (the heads and the sequence are rounded up to split
evenly). Runs on CPU processes it spawns, or under torchrun."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=2)
