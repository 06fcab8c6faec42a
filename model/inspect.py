"""Look inside the attention: every attention map of a forward pass, recorded with hooks,
per-head statistics and the figures. Plain PyTorch and matplotlib, for a notebook, the training
callback or generate.py alike.

Every MultiHeadAttention in the model is observed through a forward hook, so the models need
no extra plumbing: one ordinary forward pass yields every layer's scores. Per head: the mean
entropy of the attention rows (low: focused, high: spread out) and the standard deviation of the
pre-softmax scores, the saturation diagnostic: with scores spread much wider than ~1, softmax is
close to one-hot and its gradients vanish. The figures are model/figures.py's.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # for the hints only: matplotlib loads when a figure is drawn
    from matplotlib.figure import Figure

    from model.generation import Tokenizer

from model.attention import MultiHeadAttention, masked_softmax
from model.figures import MAX_LABELLED_TOKENS, HeadMaps, plot_heads


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


def head_maps(record: AttentionRecord) -> HeadMaps:
    """A record as model/figures.py draws it."""
    entropy = head_statistics(record)["entropy"]
    return HeadMaps(record.name, record.weights.cpu().numpy(), entropy.cpu().numpy())


def token_labels(tokenizer: "Tokenizer", ids: list[int]) -> list[str]:
    """Each id's text, special tokens included: a figure's axis labels."""
    return [tokenizer.decode([i], skip_special=False) for i in ids]


def self_attention_figure(
    model: nn.Module, ids: Tensor, labels: list[str], title: str, boundary: int | None = None
) -> "Figure":
    """Every self-attention map of one forward pass of `ids` (T,) through a GPT: a row per
    layer, a panel per head, `labels` (one per token) on the axes when there are at most
    MAX_LABELLED_TOKENS, and a line before token `boundary` (e.g. the first generated one)."""
    records = record_attention(model, lambda: model(ids[None]))
    shown = labels if len(labels) <= MAX_LABELLED_TOKENS else None
    return plot_heads([head_maps(r) for r in records], shown, shown, title, boundary)
