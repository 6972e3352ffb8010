"""python -m minipar.mesh --ranks 8 [--dp 2 --pp 2 --tp 2] [--moe 0], or under torchrun: the
tiny GPT on a data x pipeline x tensor mesh (Adam, then ZeRO-1 over dp) and experts over an ep
dimension, checked against one process."""

from ..demo import run_demo
from .demo import check_options, demo

if __name__ == "__main__":
    run_demo(demo, " ".join(__doc__.split()), default_ranks=4,
             options={"dp": 0, "pp": 0, "tp": 0, "moe": 1},
             check_options=check_options)
