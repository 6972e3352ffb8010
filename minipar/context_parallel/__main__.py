"""python -m minipar.context_parallel --ranks 4 [--seq-len 64], or under torchrun: causal
attention over a sequence split across the ranks (ring attention with the balanced
layout, and Ulysses), checked against one process."""

from ..demo import run_demo
from .demo import check_options, demo

if __name__ == "__main__":
    run_demo(demo, " ".join(__doc__.split()), default_ranks=2, options={"seq_len": 64},
             check_options=check_options)
