"""Every all-reduce algorithm minipar writes on send and receive, and torch's own
all-reduce for scale, each checked against the sum one process computes, with the bytes
each rank sends. Runs on CPU processes it spawns (--ranks), or under torchrun (NCCL on
GPUs)."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=4,
             options={"numel": (1 << 16, "elements in each rank's tensor (float64)")})
