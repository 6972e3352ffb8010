"""minipar.widgets: pictures of what the library did.

`render_*` functions are pure (data in, matplotlib Figure out) and need only
matplotlib (a Timeline's Gantt chart and summary bars are in `minipar.plots`); the
interactive widgets need ipywidgets (`pip install minipar[lessons]`) and are imported
on first use.
"""

from .collective_view import (
    CollectiveRecording,
    record_all_reduce,
    render_collective_frame,
    render_collective_strip,
)
from .render import (
    render_all_to_all,
    render_lifecycle,
    render_memory,
    render_pipeline,
    render_schedule_gallery,
    render_speedup,
)
from .split_view import KINDS as SPLIT_KINDS
from .split_view import render_split, split_frames


def show(fig) -> None:
    """Display a Figure as a PNG in a notebook (works without %matplotlib)."""
    from IPython.display import Image, display

    from minipar.plots import to_png

    display(Image(to_png(fig)))


# Widgets that need ipywidgets (or pull in heavier modules) load on first use.
_LAZY = {"TimelineViewer": "timeline_viewer", "RouterExplorer": "router_explorer",
         "render_routing": "router_explorer", "split_viewer": "split_view",
         "ScheduleExplorer": "schedule_explorer", "SpeedupLab": "speedup_lab",
         "CollectiveAnimator": "collective_animator", "MemoryExplorer": "memory_explorer",
         "MeshViewer": "mesh_explorer", "PlannerExplorer": "mesh_explorer",
         "render_mesh": "mesh_view", "render_plans": "mesh_view",
         "RingAnimator": "ring_animator", "render_ring": "ring_view",
         "AllToAllAnimator": "exchange_animator", "render_exchange": "exchange_view",
         "render_exchange_strip": "exchange_view",
         "NetworkLab": "network_lab", "render_network_runs": "network_lab"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'minipar.widgets' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


__all__ = ["AllToAllAnimator", "CollectiveAnimator", "CollectiveRecording", "MemoryExplorer",
           "MeshViewer", "NetworkLab", "PlannerExplorer", "record_all_reduce",
           "render_all_to_all", "render_collective_frame", "render_collective_strip",
           "render_exchange", "render_exchange_strip", "render_lifecycle", "render_memory",
           "render_mesh", "render_network_runs",
           "render_pipeline", "render_plans", "render_ring", "render_routing",
           "render_schedule_gallery", "render_speedup", "render_split", "RingAnimator",
           "RouterExplorer", "ScheduleExplorer", "show", "SpeedupLab", "split_frames",
           "SPLIT_KINDS", "split_viewer", "TimelineViewer"]
