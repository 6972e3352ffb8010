"""Control labels shown whole: ipywidgets cuts a description to a fixed width by default
("micro-bat...", "compressi..."); every widget calls `full_labels` on itself."""

from __future__ import annotations


def full_labels(widget):
    """Give `widget` and every control inside it a label as wide as its text; returns it."""
    style = getattr(widget, "style", None)
    if getattr(widget, "description", "") and style is not None \
            and hasattr(style, "description_width"):
        style.description_width = "initial"
    for child in getattr(widget, "children", ()):
        full_labels(child)
    return widget
