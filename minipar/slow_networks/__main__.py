"""Trainers for slow networks on one small regression task: local SGD, CO2, Hogwild!, top-k
compression with error feedback, and gossip (SGP, grouped all-reduce). Local SGD with H=1
and SGP on the complete graph are checked against one process; the others are
approximate by design and show their loss going down. Runs on CPU processes it spawns
(--ranks), or under torchrun (NCCL on GPUs); --cases picks some."""

from ..demo import run_demo
from .demo import CASES, demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=2, cases=CASES)
