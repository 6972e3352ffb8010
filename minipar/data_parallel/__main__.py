"""Every data-parallel trainer on one small regression task: all-reduce data parallelism,
ZeRO stages 1-3, a parameter server, local SGD, CO2, Hogwild!, top-k compression and
gossip (SGP, grouped all-reduce). The exact ones are checked against one process (SGD;
Adam for ZeRO); the others are approximate by design and show their loss going down.
Runs on CPU processes it spawns (--ranks), or under torchrun (NCCL on GPUs); --cases
picks some."""

from ..demo import run_demo
from .demo import CASES, demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=2, cases=CASES)
