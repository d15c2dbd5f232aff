"""A result's curves as PNGs (matplotlib, no display)."""

from __future__ import annotations

import pathlib

from bench.harness.record import Plot


def draw(plot: Plot, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(6.4, 3.6), dpi=100)
    for series in plot.series:
        axes.plot(series.x, series.y, marker="o", label=series.label)
    if plot.log_x:
        axes.set_xscale("log", base=2)
    axes.set(title=plot.title, xlabel=plot.x_label, ylabel=plot.y_label)
    axes.grid(alpha=0.3)
    if len(plot.series) > 1:
        axes.legend()
    figure.tight_layout()
    # No timestamp in the file: the same figures give the same bytes.
    figure.savefig(path, metadata={"Software": None})
    pyplot.close(figure)
