"""Expert parallelism: an MoE layer's 4 experts spread over the ranks, tokens dispatched
and combined by all-to-all, each rank's outputs checked against the one-process layer
(dropped tokens included). On 4 ranks (the default) also Tutel's hierarchical all-to-all,
Pipeline MoE, Tutel's adaptive parallelism at every degree, and expert choice; on 4 or 8
ranks the experts over an ep dimension inside dp (dp=2 x ep=K/2), trained two Adam steps
against one process. Runs on CPU processes it spawns (--ranks), or
under torchrun."""

from ..demo import run_demo
from .demo import demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=4)
