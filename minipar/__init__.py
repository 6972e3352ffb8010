"""minipar: parallel training, built small and run for real.

Start with `minipar.launch(fn, world_size)`; see README.md for the lessons and docs/ for the rest.
"""

# cli first: importing it installs the handler that makes Ctrl-C during the rest of
# start-up one line (trace alone pulls in dataclasses, inspect and ast: a cold start spends
# a visible fraction of a second there)
from . import cli, trace  # noqa: F401  (cli: imported for its start-up handler)
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
