"""Attention maps as figures: numpy and matplotlib only, no torch, so that the process that draws
a training run's maps (training/map_drawing.py) never waits for torch's import (3 s on a 2-core
CPU). model/inspect.py records the maps these draw."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # matplotlib loads when a figure is drawn
    from matplotlib.figure import Figure

# Token labels on a map's axes up to this many tokens: more would overlap.
MAX_LABELLED_TOKENS = 64


@dataclass
class HeadMaps:
    """One attention call's maps, ready to draw: weights (H, Tq, Tk) and each head's entropy."""

    name: str
    weights: np.ndarray
    entropy: np.ndarray  # (H,), nats


def token_label(text: str) -> str:
    return {"\n": "\\n", " ": "␣", "\t": "\\t"}.get(text, text)


def plot_heads(
    maps: list[HeadMaps],
    query_labels: list[str] | None,
    key_labels: list[str] | None,
    title: str,
    boundary: int | None = None,
) -> "Figure":
    """One heatmap per head, a row per attention call; queries on the y axis, keys on the x
    axis. `boundary`: a line before that query and key, e.g. where a prompt ends."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, cols = len(maps), max(len(m.weights) for m in maps)
    height = 2.8 * rows + 0.4
    figure = Figure(figsize=(2.8 * cols, height))
    FigureCanvasAgg(figure)
    # Fixed margins: constrained layout doubles the drawing time, which a training run pays
    # at every map.
    margin = 0.35 if key_labels is not None else 0.15  # inches under the key labels
    figure.subplots_adjust(
        left=0.25 / (2.8 * cols) + 0.02,
        right=0.99,
        bottom=margin / height + 0.02,
        top=1 - 0.55 / height,
        wspace=0.15,
        hspace=0.35,
    )
    for row, call in enumerate(maps):
        for head, weights in enumerate(call.weights):
            axes = figure.add_subplot(rows, cols, row * cols + head + 1)
            axes.imshow(weights, cmap="viridis", vmin=0.0, aspect="auto")
            if boundary:
                axes.axhline(boundary - 0.5, color="white", linewidth=0.6)
                axes.axvline(boundary - 0.5, color="white", linewidth=0.6)
            name = f"{call.name} " if rows > 1 else ""
            axes.set_title(f"{name}head {head}  H={call.entropy[head]:.2f}", fontsize=8)
            # Tokens label the first head of each row only: every head of a row has the same
            # axes, and tick labels are 95% of a figure's drawing time.
            for labels, set_ticks, set_labels in (
                (key_labels, axes.set_xticks, axes.set_xticklabels),
                (query_labels, axes.set_yticks, axes.set_yticklabels),
            ):
                if labels is None or head > 0:
                    set_ticks([])
                    continue
                set_ticks(range(len(labels)))
                set_labels([token_label(t) for t in labels], fontsize=5, fontfamily="monospace")
    figure.suptitle(title, fontsize=10)
    return figure


def figure_to_array(figure: "Figure") -> np.ndarray:
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()
