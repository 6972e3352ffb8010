"""minipar: parallel training, built small and run for real.

Start with `minipar.launch(fn, world_size)`; see README.md for the lessons and docs/ for the rest.
"""

# First, before any import that takes time: the handler that makes Ctrl-C during the rest
# of start-up one line (see interrupt_at_start.py)
from . import interrupt_at_start  # noqa: F401, I001  (imported for its handler; order matters)
from . import cli, trace  # noqa: F401
from .cli import refuse_library_modules
from .runtime import (
    Cluster,
    RankDied,
    RankError,
    RankTimeout,
    Results,
    device,
    launch,
    rank,
    synchronize,
    world_size,
)
from .trace import Event, Timeline, record

__version__ = "0.1.0"

refuse_library_modules()  # `python -m minipar.<library module>`: one line, not silence

__all__ = [
    "Cluster", "Event", "RankDied", "RankError", "RankTimeout", "Results", "Timeline", "device",
    "launch", "rank", "record", "synchronize", "trace", "world_size",
]
