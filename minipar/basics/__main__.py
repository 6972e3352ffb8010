"""Hello world on every rank (an all-reduce of rank+1) and independent work split over
the ranks, each checked against what one process computes. Runs on CPU processes it
spawns (--ranks), or on the ranks torchrun started: torchrun --nproc-per-node 2 -m
minipar.basics."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=4)
