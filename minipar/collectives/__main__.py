"""python -m minipar.collectives --ranks 4, or under torchrun (NCCL on GPUs): minipar's
all-reduce algorithms against one process's sum, with their traffic."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__.splitlines()[0], default_ranks=4, options={"numel": 1 << 16})
