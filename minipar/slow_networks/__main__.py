"""Trainers for slow networks on one small regression task: local SGD, CO2, Hogwild!, top-k
compression with error feedback, and gossip (SGP, grouped all-reduce); a bilinear
saddle-point problem solved by extragradient, uncompressed and with compressed communication
(MASHA1: Rand-k with variance reduction; MASHA2: Top-k with error feedback). Local SGD with
H=1, SGP on the complete graph and uncompressed extragradient are checked against one
process; the others are approximate by design and show their loss (or distance) going
down. Runs on CPU processes it spawns (--ranks), or under torchrun (NCCL on GPUs); --cases
picks some."""

from ..demo import run_demo
from .demo import CASES, demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=2, cases=CASES)
