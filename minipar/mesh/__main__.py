"""A mesh of techniques: the tiny decoder trained on a data x pipeline x tensor mesh (Adam,
then ZeRO-1 over dp), each rank's loss, gradients and parameters checked against one
process (an MoE layer's experts over an ep dimension: the MoE package's demo). Without
--dp, --pp and --tp the mesh is chosen for --ranks; a degree left out beside the others
is 1. Runs on CPU
processes it spawns (--ranks), or under torchrun. Examples: --ranks 8 (dp=2 x pp=2 x
tp=2), --ranks 4 --pp 2 --tp 2."""

from ..demo import run_demo
from .demo import check_options, demo

if __name__ == "__main__":
    run_demo(demo, __doc__, default_ranks=4,
             options={"dp": (0, "data-parallel degree"), "pp": (0, "pipeline-parallel degree"),
                      "tp": (0, "tensor-parallel degree")},
             check_options=check_options)
