"""What every benchmark's figures share: a headless backend, CDF lines, one way to finish
and save a figure. matplotlib is imported here, on demand (it is a ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def figure():
    """A new (figure, axes), drawn off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4))


def cdf(ax, samples: Sequence[float], label: str, style: str = "-") -> None:
    """The empirical CDF of ``samples`` (nothing when there are none)."""
    xs = sorted(samples)
    if xs:
        ax.plot(xs, [i / len(xs) for i in range(1, len(xs) + 1)], style, label=label)


def save(
    fig, ax, path: Path, *, title: str, xlabel: str, ylabel: str, log_x: bool = False, log_y: bool = False
) -> None:
    import matplotlib.pyplot as plt

    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
