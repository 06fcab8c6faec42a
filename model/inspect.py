"""Look inside the attention: every attention map of a forward pass, recorded with hooks,
per-head statistics and the figures. Plain PyTorch and matplotlib, for a notebook, the training
callback or generate.py alike.

Every MultiHeadAttention in the model is observed through a forward hook, so the models need
no extra plumbing: one ordinary forward pass yields every layer's scores. Per head: the mean
entropy of the attention rows (low: focused, high: spread out) and the standard deviation of the
pre-softmax scores, the saturation diagnostic: with scores spread much wider than ~1, softmax is
close to one-hot and its gradients vanish.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # matplotlib loads when a figure is drawn: recording and statistics need none
    from matplotlib.figure import Figure

from model.attention import MultiHeadAttention, masked_softmax


@dataclass
class AttentionRecord:
    """One attention call of the first sample: weights and scores (H, Tq, Tk)."""

    name: str
    weights: Tensor
    scores: Tensor


def readable_name(module_path: str) -> str:
    """'blocks.0.attn' -> 'layer0/attn'; 'decoder.1.cross_attn' -> 'decoder/layer1/cross_attn'."""
    return re.sub(r"(blocks\.)?(\d+)\.", r"layer\2.", module_path).replace(".", "/")


@torch.no_grad()
def record_attention(model: nn.Module, run: Callable[[], object]) -> list[AttentionRecord]:
    """Call run() (a forward pass of model) and return every attention map it computed."""
    records: list[AttentionRecord] = []
    names = {
        m: readable_name(n) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)
    }

    def hook(module: MultiHeadAttention, args: tuple, kwargs: dict, output: object) -> None:
        mask_kwargs = {
            k: kwargs[k]
            for k in ("context", "key_padding_mask", "attn_mask", "query_offset")
            if k in kwargs
        }
        scores = module.scores(*args, **mask_kwargs)[0].float()
        records.append(AttentionRecord(names[module], masked_softmax(scores), scores))

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in names]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return records


def head_statistics(record: AttentionRecord) -> dict[str, Tensor]:
    """Per-head entropy (nats, mean over query rows) and std of the allowed scores; shape (H,)."""
    row_entropy = -torch.special.xlogy(record.weights, record.weights).sum(dim=-1)  # (H, Tq)
    has_keys = record.weights.sum(dim=-1) > 0
    entropy = (row_entropy * has_keys).sum(-1) / has_keys.sum(-1).clamp(min=1)
    allowed = torch.isfinite(record.scores)
    count = allowed.sum(dim=(-2, -1)).clamp(min=1)
    finite = record.scores.masked_fill(~allowed, 0.0)
    mean = finite.sum(dim=(-2, -1)) / count
    variance = ((finite - mean[:, None, None]) ** 2 * allowed).sum(dim=(-2, -1)) / count
    return {"entropy": entropy, "score_std": variance.sqrt()}


def token_label(text: str) -> str:
    return {"\n": "\\n", " ": "␣", "\t": "\\t"}.get(text, text)


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Each id's text, special tokens included: a figure's axis labels. `tokenizer` is any
    object with data.tokenizer's decode(ids, skip_special=...)."""
    return [tokenizer.decode([i], skip_special=False) for i in ids]


def plot_heads(
    records: list[AttentionRecord],
    query_labels: list[str] | None,
    key_labels: list[str] | None,
    title: str,
    boundary: int | None = None,
) -> "Figure":
    """One heatmap per head, a row per record; queries on the y axis, keys on the x axis.
    `boundary`: a line before that query and key, e.g. where a prompt ends."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, cols = len(records), max(r.weights.size(0) for r in records)
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
    for row, record in enumerate(records):
        entropy = head_statistics(record)["entropy"]
        for head in range(record.weights.size(0)):
            axes = figure.add_subplot(rows, cols, row * cols + head + 1)
            weights = record.weights[head].cpu().numpy()
            axes.imshow(weights, cmap="viridis", vmin=0.0, aspect="auto")
            if boundary:
                axes.axhline(boundary - 0.5, color="white", linewidth=0.6)
                axes.axvline(boundary - 0.5, color="white", linewidth=0.6)
            name = f"{record.name} " if rows > 1 else ""
            axes.set_title(f"{name}head {head}  H={entropy[head]:.2f}", fontsize=8)
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


# Token labels on a map's axes up to this many tokens: more would overlap.
MAX_LABELLED_TOKENS = 64


def self_attention_figure(
    model: nn.Module, ids: Tensor, labels: list[str], title: str, boundary: int | None = None
) -> "Figure":
    """Every self-attention map of one forward pass of `ids` (T,) through a GPT: a row per
    layer, a panel per head, `labels` (one per token) on the axes when there are at most
    MAX_LABELLED_TOKENS, and a line before token `boundary` (e.g. the first generated one)."""
    records = record_attention(model, lambda: model(ids[None]))
    shown = labels if len(labels) <= MAX_LABELLED_TOKENS else None
    return plot_heads(records, shown, shown, title, boundary)


def figure_to_array(figure: "Figure") -> np.ndarray:
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()
