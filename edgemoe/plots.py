"""Figures (optional: matplotlib, the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from .errors import EdgeMoEError
from .files import atomic_write


def plot_width_map(summary: dict, path: Path) -> None:
    """Heatmap of bits per expert (rows: MoE layers, columns: experts) from inspect_store()."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgeMoEError("--plot needs matplotlib: pip install 'edgemoe[plot]'") from None
    layers = list(summary["widths"])
    grid = [summary["widths"][layer] for layer in layers]
    fig, ax = plt.subplots(figsize=(1 + 0.5 * len(grid[0]), 1 + 0.4 * len(layers)))
    image = ax.imshow(grid, cmap="viridis", vmin=2, vmax=8, aspect="auto")
    for i, row in enumerate(grid):
        for j, bits in enumerate(row):
            ax.text(j, i, str(bits), ha="center", va="center", color="white" if bits < 6 else "black")
    ax.set_xticks(range(len(grid[0])))
    ax.set_yticks(range(len(layers)), labels=layers)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(f"{summary['model']['model_type']}: {summary['bits_per_weight']:.2f} bits/weight")
    fig.colorbar(image, ax=ax, label="bits", ticks=[2, 4, 8])
    fig.tight_layout()
    try:   # the format the name says (png, svg, pdf...), written atomically (edgemoe.files)
        atomic_write(path, lambda f: fig.savefig(f, format=Path(path).suffix[1:] or None, dpi=100), binary=True)
    finally:
        plt.close(fig)
