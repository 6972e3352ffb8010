"""python -m minipar.pipeline --ranks 2, or under torchrun: every synchronous schedule on
real ranks, checked against one process."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__.splitlines()[0], default_ranks=2)
