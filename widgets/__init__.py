"""minipar.widgets: pictures of what the library did.

`render_*` functions are pure (data in, matplotlib Figure out) and need only
matplotlib; the interactive widgets need ipywidgets (`pip install minipar[lessons]`)
and are imported on first use.
"""

from .collective_view import (
    CollectiveRecording,
    record_all_reduce,
    render_collective_frame,
    render_collective_strip,
)
from .render import (
    KIND_COLORS,
    kind_colors,
    render_pipeline,
    render_speedup,
    render_summary,
    render_timeline,
    to_png,
)
from .split_view import KINDS as SPLIT_KINDS
from .split_view import render_split, split_frames


def show(fig) -> None:
    """Display a Figure as a PNG in a notebook (works without %matplotlib)."""
    from IPython.display import Image, display

    display(Image(to_png(fig)))


# Widgets that need ipywidgets (or pull in heavier modules) load on first use.
_LAZY = {"TimelineViewer": "timeline_viewer", "RouterExplorer": "router_explorer",
         "render_routing": "router_explorer", "split_viewer": "split_view",
         "ScheduleExplorer": "schedule_explorer", "SpeedupLab": "speedup_lab",
         "CollectiveAnimator": "collective_animator"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'minipar.widgets' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


__all__ = ["KIND_COLORS", "CollectiveAnimator", "CollectiveRecording", "RouterExplorer",
           "ScheduleExplorer", "render_routing",
           "SpeedupLab", "TimelineViewer", "kind_colors", "record_all_reduce",
           "render_collective_frame", "render_collective_strip", "render_pipeline",
           "render_speedup", "render_split", "render_summary", "render_timeline", "show",
           "split_frames", "split_viewer", "SPLIT_KINDS", "to_png"]
