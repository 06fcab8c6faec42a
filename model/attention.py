"""The one attention implementation of tinyformer.

    Attention(Q, K, V) = softmax(Q Kᵀ · scale + mask) V,   scale = 1/sqrt(d_k) by default

Every attention in the project goes through this file: GPT self-attention, encoder
self-attention, decoder causal self-attention and cross-attention differ only in their masks
and in where keys and values come from.

Mask convention, everywhere in the project: a boolean mask is True where attention IS allowed
(as in torch.nn.functional.scaled_dot_product_attention); a float mask is added to the scores.
Masks broadcast against the scores, shape (..., Tq, Tk). A query whose keys are all masked
attends to nothing: its weights and its output are zeros, never NaN.

Four paths compute the same thing. The math path below returns the attention weights; the fused
path (torch's kernel) is used when nobody asks for them, and is faster and lighter. A sliding
window over a long sequence goes to local_attention, which runs the same kernel on blocks of the
band so that it costs T·W instead of T². A GPU's one-query decoding step over a static cache
goes to one_query_attention: three small products, where the fused kernel tiles 64 queries.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from errors import check_field_types, check_int, is_number
from model.layers import (
    RotaryEmbedding,
    ThreadSplitLinear,
    alibi_bias,
    alibi_slopes,
    dropout_layer,
    position_range,
)


def check_key_padding_mask(key_padding_mask: Tensor | None, k_len: int) -> None:
    """A key padding mask is boolean (B, Tk), True for real tokens."""
    if key_padding_mask is None:
        return
    if key_padding_mask.dtype != torch.bool or key_padding_mask.shape[-1] != k_len:
        raise ValueError(
            f"key_padding_mask must be a boolean (B, Tk={k_len}) tensor, True for real "
            f"tokens; got {key_padding_mask.dtype} of shape {tuple(key_padding_mask.shape)}"
        )


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


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of an fp32 decoding step over a static cache: q (B, H, 1, D), k and v
    (B, Hkv, Tk, D), an additive mask (1, Tk) that leaves each query at least one key (a step's
    query sees its own slot): unlike the other paths, a query that sees none would get NaN.
    Returns (B, H, 1, D).

    The fused kernel works in tiles of 64 queries: given one, on an H100 it took 30 µs a layer
    at nanoGPT's 6x384 shape, three fifths of a compiled decoding step. Here a step is three
    small kernels (scores and mask, softmax, weighted sum). The query heads that share a
    key/value head are the rows of one product, so no keys or values are copied. In bf16 the
    scores would be rounded before the softmax, which the fused kernels keep in fp32: bf16 steps
    go to those.
    """
    batch, n_head, _, dim = q.shape
    n_kv_head = k.size(1)
    groups = batch * n_kv_head
    rows = q.reshape(groups, n_head // n_kv_head, dim)
    keys, values = k.reshape(groups, -1, dim), v.reshape(groups, -1, dim)
    weights = torch.softmax(torch.baddbmm(mask, rows, keys.mT, alpha=scale), dim=-1)
    return (weights @ values).view(batch, n_head, 1, dim)


# On the CPU, torch's fused kernel is 3-5x slower in bf16 than in fp32 for heads narrower than
# this (its backward above all), and no slower from this width on: bench/cpu_attention_dtype.py.
CPU_BF16_MIN_HEAD_DIM = 64


def fused_attention(q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
    """F.scaled_dot_product_attention, but in fp32 for narrow bf16 heads on the CPU, where that
    is the faster kernel (autocast off around it, or it would cast back to bf16). A float mask
    may come in fp32 whatever q's dtype: it is cast to the dtype the kernel runs in, so that an
    fp32 kernel gets the exact bias."""
    narrow = q.size(-1) < CPU_BF16_MIN_HEAD_DIM
    fp32_kernel = q.device.type == "cpu" and q.dtype == torch.bfloat16 and narrow
    mask = options.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        options["attn_mask"] = mask.to(torch.float32 if fp32_kernel else q.dtype)
    if not fp32_kernel:
        return F.scaled_dot_product_attention(q, k, v, **options)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **options)
    return out.to(q.dtype)


def _sequence_in_blocks(x: Tensor, block: int) -> Tensor:
    """x (B, H, T, D) as (B, T', H, D), zeros after T up to a multiple T' of `block`. That is the
    projections' memory layout, so without padding this is a view."""
    sequence = x.transpose(1, 2)
    rest = -sequence.size(1) % block
    return F.pad(sequence, (0, 0, 0, 0, 0, rest)) if rest else sequence


class _Windows(torch.autograd.Function):
    """x.unfold(0, size, step), size a multiple of step: the overlapping windows of x (N, ...)
    as a view (n, ..., size). Its backward adds each window's gradient back onto x a block of
    `step` rows at a time, several times faster than autograd's generic unfold backward."""

    @staticmethod
    def forward(ctx, x: Tensor, size: int, step: int) -> Tensor:
        ctx.x_shape, ctx.size, ctx.step = x.shape, size, step
        return x.unfold(0, size, step)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        parts = ctx.size // ctx.step
        windows = grad.movedim(-1, 1).unflatten(1, (parts, ctx.step))  # (n, parts, step, ...)
        grad_x = grad.new_zeros(ctx.x_shape)
        blocks = grad_x.view(-1, ctx.step, *ctx.x_shape[1:])  # window w, part j: block w + j
        for part in range(parts):
            blocks[part : part + len(windows)] += windows[:, part]
        return grad_x, None, None


def _key_windows(x: Tensor, block: int, after: int) -> Tensor:
    """For each block of queries, the keys it may reach: x (B, H, T, D) -> (B·nb, H, K, D) with
    K = (2 + after)·block, the block before, its own and, if after = 1, the one after.

    B and T are laid end to end as one sequence, with a block of zeros before (and after), so
    that the windows are a strided view of it rather than copies: a window that reaches into
    the neighbouring sequence only meets keys the mask removes."""
    sequence = _sequence_in_blocks(x, block).flatten(0, 1)  # (B·T', H, D)
    sequence = F.pad(sequence, (0, 0, 0, 0, block, after * block))
    return _Windows.apply(sequence, (2 + after) * block, block).transpose(-1, -2)


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    window: int,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Sliding-window self-attention in time and memory T·W, where the dense path costs T².

    q (B, H, T, D), k and v (B, Hkv, T, D) at the same positions 0..T-1 -> output (B, H, T, D).
    Query i sees key j where 0 <= i - j < window (causal) or |i - j| < window, and where
    key_padding_mask (B, T) is True; alibi_slopes (H,) add -slope·|i - j| to the scores. The
    result is the dense path's with the same mask (tested): the fused kernel given the dense
    (T, T) mask still scores every pair before the mask discards all but T·W of them.

    The positions are cut into nb = ceil(T / window) blocks. Every key a block's queries can
    reach lies in the block before it, in its own and (not causal) in the one after, so each
    block attends to K = 2 or 3 blocks of keys: nb problems of window × K scores, which the fused
    kernel runs as one batch (B·nb, H, window, K). A mask of that size keeps the band and drops
    the keys that do not exist (before 0, past T) and the padding.
    """
    batch, n_head, length, head_dim = q.shape
    block, after = window, 0 if causal else 1
    q_blocks = _sequence_in_blocks(q, block).reshape(-1, block, n_head, head_dim).transpose(1, 2)
    n_blocks = q_blocks.size(0) // batch
    k_windows = repeat_kv(_key_windows(k, block, after), n_head)  # (B·nb, H, K, D)
    v_windows = repeat_kv(_key_windows(v, block, after), n_head)

    # Query a of block n sits at position n·block + a, key c of its window at (n - 1)·block + c.
    a = torch.arange(block, device=q.device)[:, None]
    c = torch.arange(k_windows.size(-2), device=q.device)
    distance = a + block - c  # i - j, the same in every block
    band = (distance >= 0) & (distance < window) if causal else distance.abs() < window
    key_position = torch.arange(n_blocks, device=q.device)[:, None, None] * block - block + c
    allowed = band & (key_position >= 0) & (key_position < length)  # (nb, block, K)
    if key_padding_mask is not None:
        real = _key_windows(key_padding_mask[:, None, :, None], block, after)  # (B·nb, 1, K, 1)
        allowed = allowed & real.reshape(batch, n_blocks, 1, -1)
    # One mask per block of each sequence, shared by the heads: (B·nb, 1, block, K).
    mask = allowed.expand(batch, n_blocks, block, -1).reshape(-1, 1, block, c.size(0))
    if alibi_slopes is not None:
        bias = -alibi_slopes[:, None, None] * distance.abs()
        mask = bias.masked_fill(~mask, float("-inf"))  # (B·nb, H, block, K), fused_attention casts

    out = fused_attention(
        q_blocks, k_windows, v_windows, attn_mask=mask, dropout_p=dropout_p, scale=scale
    )
    out = out.transpose(1, 2).reshape(batch, n_blocks * block, n_head, head_dim)
    return out[:, :length].transpose(1, 2)


# The local path runs from sequences of this many windows on (see _is_local).
LOCAL_MIN_WINDOWS = 4

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
    with the projected encoder output and reuses it. `length` counts the positions appended, at
    most `max_len`. Storage is preallocated, so a step costs no copy of the past.

    With a `window` W (causal sliding-window self-attention) no query reads a key more than
    W - 1 positions back, so the cache keeps the last W positions only: a ring buffer of W slots
    where position p lives in slot p mod W. Its keys come out of order once it wraps around,
    which is why `append` returns their positions too.
    """

    def __init__(self, max_len: int, window: int | None = None):
        self.max_len = max_len
        self.slots = max_len if window is None else min(window, max_len)
        self.length = 0
        self._k: Tensor | None = None
        self._v: Tensor | None = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store k, v (B, Hkv, Tn, D) as the next Tn positions. Returns what the queries of those
        positions may attend to: keys and values (B, Hkv, Tk, D) and the keys' positions (Tk,),
        None while they are simply 0..Tk-1 (a window's ring has not wrapped around).
        """
        start, new_length = self.length, self.length + k.size(-2)
        if new_length > self.max_len:
            raise ValueError(
                f"KV cache holds at most {self.max_len} positions, asked for {new_length}: "
                "make a larger cache or start a new one"
            )
        if self._k is None:
            self._k = k.new_empty(*k.shape[:-2], self.slots, k.size(-1))
            self._v = v.new_empty(*v.shape[:-2], self.slots, v.size(-1))
        # The new queries need the W - 1 positions before them. Writing first loses none of
        # those when nothing is overwritten, or when one position arrives (it replaces the one W
        # back); otherwise the stored keys are read before the new ones replace them.
        if new_length <= self.slots:
            self._write(k, v, start)
            return self.keys, self.values, None
        if k.size(-2) == 1:
            self._write(k, v, start)
            return self.keys, self.values, self._positions(new_length)
        keys, values = torch.cat((self.keys, k), dim=-2), torch.cat((self.values, v), dim=-2)
        new_positions = torch.arange(start, new_length, device=k.device)
        positions = torch.cat((self._positions(start), new_positions))
        self._write(k, v, start)
        return keys, values, positions

    def _write(self, k: Tensor, v: Tensor, start: int) -> None:
        """Store positions start.. of k, v in their slots; only the last `slots` of them stay."""
        kept = min(k.size(-2), self.slots)
        new_length = start + k.size(-2)
        slot = (new_length - kept) % self.slots
        if slot + kept <= self.slots:  # one run of slots: a plain copy
            self._k[..., slot : slot + kept, :] = k[..., -kept:, :]
            self._v[..., slot : slot + kept, :] = v[..., -kept:, :]
        else:  # the run wraps around the end of the ring
            index = torch.arange(slot, slot + kept, device=k.device) % self.slots
            self._k.index_copy_(-2, index, k[..., -kept:, :])
            self._v.index_copy_(-2, index, v[..., -kept:, :])
        self.length = new_length

    def _positions(self, length: int) -> Tensor:
        """The position in each filled slot once `length` positions were appended: slot s holds
        the latest p < length with p = s (mod slots)."""
        slots = torch.arange(min(length, self.slots), device=self._k.device)
        return length - 1 - (length - 1 - slots) % self.slots

    @property
    def keys(self) -> Tensor:
        """The stored keys (B, Hkv, min(length, slots), D), in slot order. (narrow: some 2 µs
        less than indexing, which each layer of a decoding step pays twice.)"""
        return self._k.narrow(-2, 0, min(self.length, self.slots))

    @property
    def values(self) -> Tensor:
        return self._v.narrow(-2, 0, min(self.length, self.slots))

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search keeps the surviving hypotheses)."""
        if self._k is not None:
            self._k = self._k.index_select(0, index)
            self._v = self._v.index_select(0, index)


def allowed_keys(q_pos: Tensor, k_pos: Tensor, causal: bool, window: int | None) -> Tensor | None:
    """Which keys, at positions k_pos (Tk,), each query at q_pos (Tq,) may see under causality
    and a sliding window: (Tq, Tk) booleans, or None where every key is seen."""
    allowed = None
    if causal:
        allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        distance = q_pos[:, None] - k_pos[None, :]
        in_window = distance < window if causal else distance.abs() < window
        allowed = in_window if allowed is None else allowed & in_window
    return allowed


class StaticPositions:
    """Where a static-cache decoding stands, shared by the StaticKVCaches of every layer:
    `length`, a 0-d long tensor on the device that the caller advances, and the forward pass's
    slots (the positions its queries write) and mask (the slots each query may see), made once
    a pass for every layer. At batch 1 each of those few-element tensors costs a kernel of its
    own: made in each layer, they were about a third of a decoding step's kernels.

    GPT.forward calls `begin` before its layers; the layers' caches write the slots it made, and
    their attention reads `mask`.
    """

    def __init__(self, length: Tensor, max_len: int, window: int | None) -> None:
        self.length = length
        self.max_len = max_len
        self.window = window
        self.all_slots = torch.arange(max_len, device=length.device)
        self.slots: Tensor | None = None  # (Tq,)
        self._mask: Tensor | None = None  # (Tq, max_len)

    def begin(self, q_len: int) -> None:
        """Start a forward pass of q_len queries from `length` on: their slots, and a new mask."""
        self.slots = position_range(self.length, q_len, self.length.device)
        self._mask = None

    def mask(self, dtype: torch.dtype) -> Tensor:
        """The slots each query of the pass may see (causality, the window) as an additive mask
        (0 or -inf) in dtype, made at the first layer that asks: given booleans, the fused
        kernel would convert them in every layer. All layers of a pass ask in one dtype."""
        if self._mask is None:
            visible = allowed_keys(self.slots, self.all_slots, causal=True, window=self.window)
            hidden = torch.full(visible.shape, float("-inf"), dtype=dtype, device=visible.device)
            self._mask = hidden.masked_fill_(visible, 0.0)
        return self._mask


class StaticKVCache:
    """Keys and values (B, Hkv, max_len, D) of one self-attention layer, in memory whose shape and
    place never change: what a decoding step captured as a CUDA graph needs, since each replay
    reruns the captured kernels on the same memory and nothing in it may depend on a number the
    host holds. Position p lives in slot p; `positions` (StaticPositions, shared by every layer)
    holds the length, which the caller advances after each step, and the slots of the pass,
    which GPT.forward makes before its layers run.

    Every step reads all max_len slots: causality hides the slots after the queries (not yet
    written, or left over from before the caller restarted at 0). Nothing here can check that
    the caller stays within max_len without making the host wait for the device.
    """

    def __init__(self, positions: StaticPositions):
        self.positions = positions
        self._k: Tensor | None = None
        self._v: Tensor | None = None

    @property
    def length(self) -> Tensor:
        """The positions written so far, a 0-d tensor on the device (the shared one)."""
        return self.positions.length

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, None]:
        """Store k, v (B, Hkv, Tn, D) in the pass's slots; return every slot's keys and values
        (their positions are 0..max_len-1)."""
        slots = self.positions.slots
        if slots is None or slots.numel() != k.size(-2):
            raise ValueError(
                f"{k.size(-2)} positions to store, but the pass's slots are "
                f"{None if slots is None else slots.numel()}: a StaticKVCache is written inside "
                "GPT.forward, which makes them (StaticPositions.begin) before its layers run"
            )
        if self._k is None:
            max_len = self.positions.max_len
            self._k = k.new_zeros(*k.shape[:-2], max_len, k.size(-1))
            self._v = v.new_zeros(*v.shape[:-2], max_len, v.size(-1))
        self._k.index_copy_(-2, slots, k)
        self._v.index_copy_(-2, slots, v)
        return self._k, self._v, None


# The joined projections (self-attention's qkv_proj, cross-attention's kv_proj) and the ones each
# replaced, in the order checkpoints from before the join hold them.
JOINED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "kv_proj": ("k_proj", "v_proj")}


class MultiHeadAttention(nn.Module):
    """Multi-head self- or cross-attention with grouped key/value heads.

    x (B, Tq, C) attends to itself, or, built with a `context_dim` Cc, to `context` (B, Tk, Cc).
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
        if d_model % config.n_head:  # the model configs say it in their keys' names first
            raise ValueError(f"d_model={d_model} is not divisible by n_head={config.n_head}")
        self.config = config
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = d_model // config.n_head
        self.scale = config.scale_for(self.head_dim)
        self.causal = causal
        self.window = config.window
        # Self-attention projects queries, keys and values out of x in one matmul: one kernel
        # where three would run, forward and backward, which small models feel. Cross-attention
        # projects queries out of x, and keys and values together out of the context.
        self.is_cross = context_dim is not None
        kv_width = self.n_kv_head * self.head_dim
        self.widths = (self.n_head * self.head_dim, kv_width, kv_width)  # q, k, v
        if self.is_cross:
            self.q_proj = ThreadSplitLinear(d_model, self.widths[0], bias=bias)
            self.kv_proj = ThreadSplitLinear(context_dim, sum(self.widths[1:]), bias=bias)
        else:
            self.qkv_proj = ThreadSplitLinear(d_model, sum(self.widths), bias=bias)
        self.out_proj = ThreadSplitLinear(self.n_head * self.head_dim, d_model, bias=bias)
        self.attn_dropout = config.dropout
        self.resid_dropout = dropout_layer(resid_dropout)
        self.rope = RotaryEmbedding(self.head_dim) if position == "rope" else None
        if position == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(self.n_head), persistent=False)
        else:
            self.alibi_slopes = None

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        # Checkpoints written before the projections were joined hold q_proj, k_proj and v_proj
        # apart: join them the same way, so that those checkpoints load as they are.
        joined = "kv_proj" if self.is_cross else "qkv_proj"
        for kind in ("weight", "bias"):
            parts = [f"{prefix}{part}.{kind}" for part in JOINED_PROJECTIONS[joined]]
            if all(part in state_dict for part in parts):
                state_dict[f"{prefix}{joined}.{kind}"] = torch.cat(
                    [state_dict.pop(p) for p in parts]
                )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _split_heads(self, x: Tensor, n_head: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, n_head, self.head_dim).transpose(1, 2)

    def _project(
        self,
        x: Tensor,
        context: Tensor | None,
        cache: KVCache | StaticKVCache | None,
        query_offset: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor, int | Tensor, Tensor | None]:
        """q (B, H, Tq, D), k and v (B, Hkv, Tk, D), the absolute position of x's first row, and
        the keys' positions (Tk,) where they are not 0..Tk-1 (a windowed cache's).

        For cross-attention with RoPE, queries sit at target positions from query_offset and
        keys at source positions from 0, so scores depend on the offset between the two.
        """
        if (context is not None) != self.is_cross:
            raise ValueError(
                "cross-attention needs a context and self-attention takes none: a "
                "MultiHeadAttention built with context_dim is cross-attention"
            )
        if context is not None:  # cross-attention: keys come from another sequence
            q = self._split_heads(self.q_proj(x), self.n_head)
            if self.rope is not None:
                q = self.rope(q, query_offset)
            if cache is not None and cache.length:
                return q, cache.keys, cache.values, 0, None
            k, v = self._split_heads(self.kv_proj(context), 2 * self.n_kv_head).chunk(2, dim=1)
            if self.rope is not None:
                k = self.rope(k)
            if cache is not None:
                k, v, _ = cache.append(k, v)
            return q, k, v, 0, None
        offset = cache.length if cache is not None else 0
        # All heads first, (B, H + 2·Hkv, T, D), then cut into q, k and v along the heads.
        heads = self._split_heads(self.qkv_proj(x), self.n_head + 2 * self.n_kv_head)
        q, k, v = heads.split_with_sizes((self.n_head, self.n_kv_head, self.n_kv_head), dim=1)
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
        k_pos = None
        if cache is not None:
            k, v, k_pos = cache.append(k, v)
        return q, k, v, offset, k_pos

    def _mask(
        self,
        q_len: int,
        k_len: int,
        offset: int | Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        device: torch.device,
        k_pos: Tensor | None = None,
    ) -> Tensor | None:
        """Combine causality, window, padding, ALiBi and the caller's mask into one mask, for
        queries at positions offset.. and keys at k_pos (Tk,) (None: 0..Tk-1). The offset may be
        a 0-d tensor (a static cache's length)."""
        q_pos = position_range(offset, q_len, device)
        k_pos = torch.arange(k_len, device=device) if k_pos is None else k_pos
        allowed = allowed_keys(q_pos, k_pos, self.causal, self.window)
        if key_padding_mask is not None:
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

    def _is_plain_causal(
        self, q_len: int, k_len: int, offset: int | Tensor, key_padding_mask, attn_mask
    ) -> bool:
        """True when the mask is plain causality with the queries ending at the last key:
        either all positions (no offset), or one query, the newest, which sees every key (a
        decoding step). A KVCache's keys are always the latest positions, so a window of at least
        Tk keys hides none of them; a StaticKVCache (its length, the offset, a tensor) holds slots
        past the queries, which only a mask hides. The fused kernel then needs no mask tensor,
        its fastest case."""
        return (
            self.causal
            and isinstance(offset, int)
            and (q_len == k_len or q_len == 1)
            and (self.window is None or k_len <= self.window)
            and self.alibi_slopes is None
            and key_padding_mask is None
            and attn_mask is None
        )

    def _sees_static_positions(
        self,
        cache: KVCache | StaticKVCache | None,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
    ) -> bool:
        """True when the mask is what a StaticKVCache's positions hold (causality and this
        layer's window): every layer of the pass then shares one."""
        return (
            isinstance(cache, StaticKVCache)
            and self.causal
            and self.window == cache.positions.window
            and self.alibi_slopes is None
            and key_padding_mask is None
            and attn_mask is None
        )

    def _is_local(
        self, q_len: int, k_len: int, offset: int | Tensor, context: Tensor | None, attn_mask
    ) -> bool:
        """True when local_attention computes this call: a sliding window over self-attention
        whose keys are the queries' own positions (no cached past, no caller's mask), at least
        LOCAL_MIN_WINDOWS windows long. Below that the dense kernel's T² is small, and the local
        path, with its many small problems, measured no faster on the CPU."""
        return (
            self.window is not None
            and context is None
            and attn_mask is None
            and isinstance(offset, int)
            and offset == 0
            and q_len == k_len >= LOCAL_MIN_WINDOWS * self.window
        )

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = False,
        cache: KVCache | StaticKVCache | None = None,
        query_offset: int = 0,
    ) -> tuple[Tensor, Tensor | None]:
        q, k, v, offset, k_pos = self._project(x, context, cache, query_offset)
        q_len, k_len = q.size(-2), k.size(-2)
        check_key_padding_mask(key_padding_mask, k_len)
        dropout_p = self.attn_dropout if self.training else 0.0
        weights = None
        if need_weights:
            mask = self._mask(q_len, k_len, offset, key_padding_mask, attn_mask, x.device, k_pos)
            out, weights = scaled_dot_product_attention(q, k, v, mask, self.scale, dropout_p)
        elif self._is_plain_causal(q_len, k_len, offset, key_padding_mask, attn_mask):
            out = fused_attention(
                q,
                repeat_kv(k, self.n_head),
                repeat_kv(v, self.n_head),
                dropout_p=dropout_p,
                is_causal=q_len > 1,  # one query at the last position sees all keys
                scale=self.scale,
            )
        elif self._is_local(q_len, k_len, offset, context, attn_mask):
            out = local_attention(
                q,
                k,
                v,
                self.window,
                causal=self.causal,
                key_padding_mask=key_padding_mask,
                alibi_slopes=self.alibi_slopes,
                scale=self.scale,
                dropout_p=dropout_p,
            )
        else:
            static_mask = self._sees_static_positions(cache, key_padding_mask, attn_mask)
            if static_mask:
                mask = cache.positions.mask(q.dtype)
            else:
                mask = self._mask(
                    q_len, k_len, offset, key_padding_mask, attn_mask, x.device, k_pos
                )
            # a one-query step in fp32 with no dropout: three small kernels, not the fused tiles
            if static_mask and q_len == 1 and q.dtype == torch.float32 and dropout_p == 0.0:
                out = one_query_attention(q, k, v, mask, self.scale)
            else:
                out = fused_attention(
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
        q, k, _, offset, _ = self._project(x, context, None, query_offset)
        check_key_padding_mask(key_padding_mask, k.size(-2))
        mask = self._mask(q.size(-2), k.size(-2), offset, key_padding_mask, attn_mask, x.device)
        return attention_scores(q, k, mask, self.scale)
