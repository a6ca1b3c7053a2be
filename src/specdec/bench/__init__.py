"""Benchmarks (never timed tests): speed belongs here, measured side by side in one run."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out a matplotlib figure, write it as a PNG and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
