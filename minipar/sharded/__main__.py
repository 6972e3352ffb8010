"""ZeRO stages 1, 2 and 3 (FSDP) on one small regression task, each checked against one
process with Adam (float64): optimizer state, then gradients, then parameters sharded
over the ranks. Runs on CPU processes it spawns (--ranks), or under torchrun (NCCL on
GPUs); --cases picks some. Memory per rank: minipar bench zero."""

from ..demo import run_demo
from .demo import CASES, demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=2, cases=CASES)
