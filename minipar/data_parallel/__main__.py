"""Data parallelism on one small regression task: all-reduce data parallelism (buckets
overlapped with backward) and a synchronous parameter server, each checked against one
process (SGD, float64). Runs on CPU processes it spawns (--ranks), or under torchrun (NCCL
on GPUs); --cases picks some."""

from ..demo import run_demo
from .demo import CASES, demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=2, cases=CASES)
