"""torchrun's entry for tests/test_runtime_two_nodes.py: several of the tour's techniques in
one job, each exactly what `python -m minipar.<technique>` runs (one job pays torchrun's
start once). Each prints its table on rank 0 and exits non-zero if a case does not match
one process."""

import runpy
import sys

TECHNIQUES = ("minipar.basics", "minipar.collectives", "minipar.data_parallel", "minipar.moe")

if __name__ == "__main__":
    for module in TECHNIQUES:
        sys.argv = [module]  # each module's own defaults
        runpy.run_module(module, run_name="__main__", alter_sys=True)
