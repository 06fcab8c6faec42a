"""The one attention implementation of tinyformer.

    Attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V,   scale = 1/sqrt(d_k) by default

Every attention in the project goes through this file: GPT self-attention, encoder
self-attention, decoder causal self-attention and cross-attention differ only in their masks
and in where keys and values come from.

Mask convention, everywhere in the project: a boolean mask is True where attention IS allowed
(as in torch.nn.functional.scaled_dot_product_attention); a float mask is added to the scores.
Masks broadcast against the scores, shape (..., Tq, Tk). A query whose keys are all masked
attends to nothing: its weights and its output are zeros, never NaN.

Two paths compute the same thing. The math path below returns the attention weights; the fused
path (torch's kernel) is used when nobody asks for them, and is faster and lighter.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from errors import check_field_types, check_int, is_number
from model.layers import RotaryEmbedding, alibi_bias, alibi_slopes


def repeat_kv(x: Tensor, n_head: int) -> Tensor:
    """Share each of the Hkv key/value heads of x (..., Hkv, T, D) among n_head query heads."""
    n_kv_head = x.size(-3)
    if n_kv_head == n_head:
        return x
    if n_head % n_kv_head:
        raise ValueError(f"{n_head} query heads cannot share {n_kv_head} key/value heads evenly")
    return x.repeat_interleave(n_head // n_kv_head, dim=-3)


def attention_scores(
    q: Tensor, k: Tensor, mask: Tensor | None = None, scale: float | None = None
) -> Tensor:
    """Scaled scores q·kᵀ·scale of shape (..., Tq, Tk), with -inf where the mask forbids.

    q (..., Tq, D), k (..., Tk, D); with a head axis at -3, k may have fewer heads than q
    (grouped-query attention).
    """
    if q.dim() >= 3 and k.dim() >= 3:
        k = repeat_kv(k, q.size(-3))
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if mask is None:
        return scores
    try:
        shape = torch.broadcast_shapes(mask.shape, scores.shape)
    except RuntimeError:
        shape = None
    if shape != scores.shape:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} does not broadcast to the scores' "
            f"shape {tuple(scores.shape)} (..., Tq, Tk): give it shape (Tq, Tk), (B, 1, Tq, Tk) "
            "or (B, H, Tq, Tk)"
        )
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def masked_softmax(scores: Tensor) -> Tensor:
    """Softmax over the key axis (-1); a row whose scores are all -inf gets zero weights."""
    nothing_allowed = scores.amax(dim=-1, keepdim=True) == float("-inf")
    # Zeroing the scores first keeps NaN out of the forward and the backward pass.
    weights = torch.softmax(scores.masked_fill(nothing_allowed, 0.0), dim=-1)
    return weights.masked_fill(nothing_allowed, 0.0)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """The math path: returns (output (..., Tq, Dv), weights (..., Tq, Tk)).

    Batched over any leading dims: q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv). The returned
    weights are before dropout, so each allowed row sums to 1.
    """
    weights = masked_softmax(attention_scores(q, k, mask, scale))
    dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    if q.dim() >= 3 and v.dim() >= 3:
        v = repeat_kv(v, q.size(-3))
    return dropped @ v, weights


# Named scales, as functions of the head dimension d_k; "1/dk" is the muP-style scaling.
SCALE_RULES = {"1/sqrt_dk": lambda d_k: 1.0 / math.sqrt(d_k), "1/dk": lambda d_k: 1.0 / d_k}


@dataclass
class AttentionConfig:
    """The attention knobs, `model.attention.*` on the command line."""

    n_head: int = 4
    n_kv_head: int | None = None  # None: one key/value head per query head (plain MHA)
    scale: float | str | None = None  # a number, or a SCALE_RULES name; None: "1/sqrt_dk"
    window: int | None = None  # None: every earlier key; W: only the last W keys
    dropout: float = 0.0  # on the attention weights

    def __post_init__(self) -> None:
        check_field_types(self, "model.attention.")
        check_int("model.attention.n_head", self.n_head)
        check_int("model.attention.n_kv_head", self.n_kv_head, optional=True)
        if self.n_kv_head is not None:
            if self.n_head % self.n_kv_head:
                raise ValueError(
                    f"model.attention.n_head={self.n_head} is not divisible by "
                    f"model.attention.n_kv_head={self.n_kv_head}: pick n_kv_head among "
                    f"{[d for d in range(1, self.n_head + 1) if self.n_head % d == 0]}"
                )
        number = is_number(self.scale)
        if not (self.scale is None or self.scale in SCALE_RULES or (number and self.scale > 0)):
            raise ValueError(
                f"model.attention.scale must be a number > 0, one of {list(SCALE_RULES)} or "
                f"null (= 1/sqrt_dk), got {self.scale!r}"
            )
        check_int("model.attention.window", self.window, optional=True)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.attention.dropout must be in [0, 1), got {self.dropout}")

    def scale_for(self, head_dim: int) -> float:
        """The factor on QKᵀ for heads of `head_dim` dimensions."""
        rule = "1/sqrt_dk" if self.scale is None else self.scale
        return SCALE_RULES[rule](head_dim) if isinstance(rule, str) else float(rule)

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head


class KVCache:
    """Keys and values (B, Hkv, T, D) of one attention layer, kept between decoding steps.

    Self-attention appends the new positions at each step; cross-attention fills the cache once
    with the projected encoder output and reuses it. Storage is preallocated to `max_len` so a
    step costs no copy of the past.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self._k: Tensor | None = None
        self._v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, Hkv, T, D) after the cached positions; return all keys and values."""
        new_length = self.length + k.size(-2)
        if new_length > self.max_len:
            raise ValueError(
                f"KV cache holds at most {self.max_len} positions, asked for {new_length}: "
                "make a larger cache or start a new one"
            )
        if self._k is None:
            self._k = k.new_empty(*k.shape[:-2], self.max_len, k.size(-1))
            self._v = v.new_empty(*v.shape[:-2], self.max_len, v.size(-1))
        self._k[..., self.length : new_length, :] = k
        self._v[..., self.length : new_length, :] = v
        self.length = new_length
        return self.keys, self.values

    @property
    def keys(self) -> Tensor:
        return self._k[..., : self.length, :]

    @property
    def values(self) -> Tensor:
        return self._v[..., : self.length, :]

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search keeps the surviving hypotheses)."""
        if self._k is not None:
            self._k = self._k.index_select(0, index)
            self._v = self._v.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """Multi-head self- or cross-attention with grouped key/value heads.

    x (B, Tq, C) attends to itself, or to `context` (B, Tk, Cc) for cross-attention.
    `causal` lets position i see keys j <= i only; `window` W keeps the last W keys
    (|i - j| < W without causality); `position` "rope" or "alibi" adds relative position
    inside attention. Returns (output (B, Tq, C), weights (B, H, Tq, Tk) or None).
    """

    def __init__(
        self,
        d_model: int,
        config: AttentionConfig,
        *,
        causal: bool = False,
        position: str = "none",
        bias: bool = True,
        resid_dropout: float = 0.0,
        context_dim: int | None = None,
    ):
        super().__init__()
        if d_model % config.n_head:
            raise ValueError(
                f"model.n_embd={d_model} is not divisible by model.attention.n_head="
                f"{config.n_head}: pick n_head among "
                f"{[h for h in range(1, d_model + 1) if d_model % h == 0 and h <= 64]}"
            )
        self.config = config
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = d_model // config.n_head
        self.scale = config.scale_for(self.head_dim)
        self.causal = causal
        self.window = config.window
        context_dim = context_dim or d_model
        self.q_proj = nn.Linear(d_model, self.n_head * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(context_dim, self.n_kv_head * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(context_dim, self.n_kv_head * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(self.n_head * self.head_dim, d_model, bias=bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = nn.Dropout(resid_dropout)
        self.rope = RotaryEmbedding(self.head_dim) if position == "rope" else None
        if position == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(self.n_head), persistent=False)
        else:
            self.alibi_slopes = None

    def _split_heads(self, x: Tensor, n_head: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, n_head, self.head_dim).transpose(1, 2)

    def _project(
        self, x: Tensor, context: Tensor | None, cache: KVCache | None, query_offset: int = 0
    ) -> tuple[Tensor, Tensor, Tensor, int]:
        """q (B, H, Tq, D), k and v (B, Hkv, Tk, D), and the absolute position of x's first row.

        For cross-attention with RoPE, queries sit at target positions from query_offset and
        keys at source positions from 0, so scores depend on the offset between the two.
        """
        q = self._split_heads(self.q_proj(x), self.n_head)
        if context is not None:  # cross-attention: keys come from another sequence
            if self.rope is not None:
                q = self.rope(q, query_offset)
            if cache is not None and cache.length:
                return q, cache.keys, cache.values, 0
            k = self._split_heads(self.k_proj(context), self.n_kv_head)
            v = self._split_heads(self.v_proj(context), self.n_kv_head)
            if self.rope is not None:
                k = self.rope(k)
            if cache is not None:
                k, v = cache.append(k, v)
            return q, k, v, 0
        offset = cache.length if cache is not None else 0
        k = self._split_heads(self.k_proj(x), self.n_kv_head)
        v = self._split_heads(self.v_proj(x), self.n_kv_head)
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None:
            k, v = cache.append(k, v)
        return q, k, v, offset

    def _mask(
        self,
        q_len: int,
        k_len: int,
        offset: int,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        device: torch.device,
    ) -> Tensor | None:
        """Combine causality, window, padding, ALiBi and the caller's mask into one mask."""
        q_pos = torch.arange(offset, offset + q_len, device=device)
        k_pos = torch.arange(k_len, device=device)
        allowed = None
        if self.causal:
            allowed = k_pos[None, :] <= q_pos[:, None]
        if self.window is not None:
            distance = q_pos[:, None] - k_pos[None, :]
            in_window = distance < self.window if self.causal else distance.abs() < self.window
            allowed = in_window if allowed is None else allowed & in_window
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool or key_padding_mask.shape[-1] != k_len:
                raise ValueError(
                    f"key_padding_mask must be a boolean (B, Tk={k_len}) tensor, True for real "
                    f"tokens; got {key_padding_mask.dtype} of shape {tuple(key_padding_mask.shape)}"
                )
            padding = key_padding_mask[:, None, None, :]
            allowed = padding if allowed is None else allowed & padding
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            allowed = attn_mask if allowed is None else allowed & attn_mask
        additive = attn_mask if attn_mask is not None and attn_mask.dtype != torch.bool else None
        if self.alibi_slopes is not None:
            bias = alibi_bias(self.alibi_slopes, q_pos, k_pos)
            additive = bias if additive is None else additive + bias
        if additive is None:
            return allowed
        if allowed is not None:
            additive = additive.masked_fill(~allowed, float("-inf"))
        return additive

    def _is_plain_causal(self, q_len: int, k_len: int, key_padding_mask, attn_mask) -> bool:
        """True when the mask is plain causality with the queries ending at the last key:
        either all positions (no offset), or one query, the newest, which sees every key (a
        decoding step). The fused kernel then needs no mask tensor, its fastest case."""
        return (
            self.causal
            and (q_len == k_len or q_len == 1)
            and self.window is None
            and self.alibi_slopes is None
            and key_padding_mask is None
            and attn_mask is None
        )

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        query_offset: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        q, k, v, offset = self._project(x, context, cache, query_offset)
        q_len, k_len = q.size(-2), k.size(-2)
        dropout_p = self.attn_dropout if self.training else 0.0
        weights = None
        if need_weights:
            mask = self._mask(q_len, k_len, offset, key_padding_mask, attn_mask, x.device)
            out, weights = scaled_dot_product_attention(q, k, v, mask, self.scale, dropout_p)
        elif self._is_plain_causal(q_len, k_len, key_padding_mask, attn_mask):
            out = F.scaled_dot_product_attention(
                q,
                repeat_kv(k, self.n_head),
                repeat_kv(v, self.n_head),
                dropout_p=dropout_p,
                is_causal=q_len > 1,  # one query at the last position sees all keys
                scale=self.scale,
            )
        else:
            mask = self._mask(q_len, k_len, offset, key_padding_mask, attn_mask, x.device)
            out = F.scaled_dot_product_attention(
                q,
                repeat_kv(k, self.n_head),
                repeat_kv(v, self.n_head),
                attn_mask=mask,
                dropout_p=dropout_p,
                scale=self.scale,
            )
        out = out.transpose(1, 2).reshape(x.size(0), q_len, self.n_head * self.head_dim)
        return self.resid_dropout(self.out_proj(out)), weights

    def scores(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        query_offset: int = 0,
    ) -> Tensor:
        """Scaled pre-softmax scores (B, H, Tq, Tk), -inf where masked (saturation diagnostic)."""
        q, k, _, offset = self._project(x, context, None, query_offset)
        mask = self._mask(q.size(-2), k.size(-2), offset, key_padding_mask, attn_mask, x.device)
        return attention_scores(q, k, mask, self.scale)
