"""python -m minipar.moe --ranks 2, or under torchrun: expert parallelism with all-to-all
dispatch and combine, checked against the one-process MoE layer."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__.splitlines()[0], default_ranks=2)
