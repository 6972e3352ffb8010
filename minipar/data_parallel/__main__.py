"""python -m minipar.data_parallel --ranks 2, or under torchrun (NCCL on GPUs): every
data-parallel trainer on real ranks against single-process SGD."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__.splitlines()[0], default_ranks=2)
