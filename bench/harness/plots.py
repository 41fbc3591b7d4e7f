"""The one figure writer of the benchmarks: panels side by side, one PNG, matplotlib without a display.

matplotlib is the bench extra's (imported only when a driver draws), so a
driver that writes no figure runs without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["write_figure"]


def write_figure(path: Path, panels: Sequence[Callable[[object], None]], suptitle: str, *, rows: int = 1) -> Path:
    """Draw each of ``panels`` on an axes of its own (``rows`` rows, filled left to right) and save the figure at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = -(-len(panels) // rows)
    figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.8 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for draw, ax in zip(panels, flat, strict=False):
        draw(ax)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    figure.suptitle(suptitle, fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.06 / rows))  # the title's band above the panels
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
