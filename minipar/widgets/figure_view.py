"""FigureView: matplotlib figures drawn by the browser as SVG, crisp at any width.

One figure is a picture; several are frames that Play steps through in the browser
(figure.js), so a static page still animates. Every frame is drawn once, up front.
"""

from __future__ import annotations

import anywidget
import traitlets
from matplotlib.figure import Figure

from minipar.plots import to_svg

from .esm import esm


class FigureView(anywidget.AnyWidget):
    """SVG frames with captions; `frame` is the one shown; `greyed` says why the picture
    is not of the current input (it greys out, so a stale picture never passes as new)."""

    _esm = esm("figure.js")
    frames = traitlets.List(traitlets.Unicode()).tag(sync=True)
    captions = traitlets.List(traitlets.Unicode()).tag(sync=True)
    frame = traitlets.Int(0).tag(sync=True)
    greyed = traitlets.Unicode("").tag(sync=True)
    frame_ms = traitlets.Int(1200).tag(sync=True)  # how long Play shows each frame

    def show(self, *figures: Figure, captions: list[str] | None = None, frame: int = 0) -> None:
        """Draw these figures as the frames (one figure: a still picture), show `frame`,
        and clear any greying: the picture is of the current input again."""
        captions = list(captions or [""] * len(figures))
        if len(captions) != len(figures):
            raise ValueError(f"captions must have one entry per figure ({len(figures)}); "
                             f"got {len(captions)}")
        with self.hold_sync():
            self.frames = [to_svg(fig) for fig in figures]
            self.captions = captions
            self.frame = min(max(frame, 0), max(len(figures) - 1, 0))
            self.greyed = ""
