"""Context parallelism: causal attention over a sequence split across the ranks, by ring
attention (balanced layout) and by Ulysses' all-to-all, each rank's output and q, k, v
gradients checked against one process. Runs on CPU processes it spawns (--ranks), or
under torchrun."""

from ..demo import run_demo
from .demo import check_options, demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=2,
             options={"seq_len": (64, "tokens in the sequence, split over the ranks")},
             check_options=check_options)
