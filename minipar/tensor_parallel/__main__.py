"""python -m minipar.tensor_parallel --ranks 2, or under torchrun: the Megatron MLP and a
transformer block split over the ranks, checked against their one-process twins."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__.splitlines()[0], default_ranks=2)
