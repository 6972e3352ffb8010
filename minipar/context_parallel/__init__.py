"""Long sequences: split the sequence itself over ranks.

- `attention.py`: attention one key block at a time, merged by the online-softmax
  (log-sum-exp) rule; the balanced (zig-zag) layout of a causal sequence over ranks;
- `ring.py`: ring attention (context parallelism), forward and backward;
- `ulysses.py`: all-to-all sequence parallelism (sequence split <-> head split);
- `terapipe.py`: TeraPipe, one sequence's token slices through the pipeline engine;
- `hetero.py`: variable-length sequences placed on ranks of different speeds.
"""

from .attention import (
    attention,
    block_attention,
    blocked_attention,
    merge,
    positions,
)
from .ring import RingWork, ring_attention, ring_plan
from .ulysses import ulysses_attention

__all__ = ["RingWork", "attention", "block_attention", "blocked_attention", "merge",
           "positions", "ring_attention", "ring_plan", "ulysses_attention"]
