"""python -m minipar.basics --ranks 4, or under torchrun (one machine: torchrun
--nproc-per-node 2 -m minipar.basics): hello world and work split over the ranks,
checked against one process."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__.splitlines()[0], default_ranks=4)
