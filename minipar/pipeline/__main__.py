"""Every synchronous pipeline schedule (GPipe, 1F1B, ZB-H1, interleaved 1F1B, looped BFS)
trains one step of a stack of linear stages, one stage (or v of them) per rank; each
rank's gradients, and the last stage's loss, are checked against one process running the
whole model. A schedule impossible on --ranks is skipped, saying why. Runs on CPU
processes it spawns (--ranks), or under torchrun."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=2)
