"""The plotting import the reports share: matplotlib, only when a plot is drawn."""

from .errors import ReportError


def new_figure(width: float, height: float):
    """A matplotlib Figure drawn by the Agg (file-only) canvas. Built without pyplot, so no global
    backend state changes and no display is needed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError("plots need matplotlib: pip install 'pipesgd[plot]'") from None
    return Figure(figsize=(width, height), dpi=120, layout="constrained")
