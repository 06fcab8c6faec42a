"""Building blocks around attention: the MLP and the positional encodings.

Learned and sinusoidal encodings are added to the token embeddings by the model; RoPE and
ALiBi act inside attention (on q/k and on the scores), so MultiHeadAttention owns them.
"""

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def _unchanged(x: Tensor) -> Tensor:
    return x


def dropout_layer(p: float) -> Callable[[Tensor], Tensor]:
    """Dropout at rate p, or at rate 0 a plain function that returns its input: even a module
    that does nothing costs a module call per use, which token-by-token decoding pays
    2 * n_layer + 1 times a token."""
    return nn.Dropout(p) if p > 0 else _unchanged


# A one-row product is split over the threads from this many weights on (512 KB in fp32).
# Splitting pays when the weights come from memory and costs when they sit in the caches: on a
# 2-core AMD EPYC it sped up decoding of GPTs from 19 MB of weights on, and of a 3 MB one not at
# all (bench/decode_split.py, BENCHMARKS.md). A matrix's size stands in for the model's.
SPLIT_MIN_WEIGHTS = 2**17

# The blocks one-row products are cut into: 1 (nn.Linear's path) but inside split_one_rows. A
# process-wide setting, as torch's own oneDNN flag that decoding_step sets beside it.
_one_row_blocks = 1


@contextmanager
def split_one_rows(blocks: int) -> Iterator[None]:
    """Inside, ThreadSplitLinear cuts the product of a single row by a large enough weight into
    `blocks` blocks of rows, one per thread. A decoding step of an fp32 model on the CPU asks
    for it (model/generation.py's decoding_step), knowing once a step what each product would
    otherwise check for itself (device, dtype, autocast; decoding runs in inference mode),
    which slowed decoding measurably (bench/decode_overhead.py, BENCHMARKS.md)."""
    global _one_row_blocks
    before, _one_row_blocks = _one_row_blocks, blocks
    try:
        yield
    finally:
        _one_row_blocks = before


class ThreadSplitLinear(nn.Linear):
    """nn.Linear whose one-row products are spread over the CPU's threads in decoding steps.

    Decoding one token at batch 1 multiplies one row by every weight matrix. On the 2-core CPU
    where this was measured (an AMD EPYC with AVX2), MKL's matrix-vector product read the
    weights at about half the speed both cores reach together (bench/matvec_layout.py), and no
    faster on two threads than on one. Cut into one block of rows per thread, the weight
    becomes a batch of smaller products, and torch's batched product (bmm) gives each thread a
    block. That happens inside split_one_rows only, which decoding_step enters for fp32 models
    on the CPU, and only for single rows and large enough weights; everything else takes
    nn.Linear's path (training, batches, evaluation, other devices and dtypes).
    """

    def blocks_for(self, x: Tensor) -> int:
        """How many blocks of rows x's product is cut into: split_one_rows's count for a single
        row and a large enough weight whose rows that count divides; else 1, nn.Linear's path."""
        blocks = _one_row_blocks
        if (
            blocks == 1
            or x.numel() != x.size(-1)
            or self.out_features % blocks
            or self.in_features * self.out_features < SPLIT_MIN_WEIGHTS
        ):
            return 1
        return blocks

    def forward(self, x: Tensor) -> Tensor:
        blocks = self.blocks_for(x)
        if blocks == 1:
            return super().forward(x)
        weight = self.weight.view(blocks, -1, self.in_features)
        # x as a (1, in, 1) column with a row's strides: MKL reads it as a transposed row. The
        # same column made contiguous takes a path ~3x slower than the one-thread product.
        column = x.reshape(1, 1, -1).mT.expand(blocks, -1, -1)
        y = torch.bmm(weight, column).view(x.shape[:-1] + (-1,))
        bias = self.bias  # one attribute lookup, not two: a decoding step makes 24 of these calls
        return y if bias is None else y + bias


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear -> GELU -> Linear, (B, T, C) -> (B, T, C)."""

    def __init__(self, d_model: int, hidden: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.fc = ThreadSplitLinear(d_model, hidden, bias=bias)
        self.proj = ThreadSplitLinear(hidden, d_model, bias=bias)
        self.dropout = dropout_layer(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(nn.functional.gelu(self.fc(x))))


def sinusoidal_encoding(max_len: int, d_model: int) -> Tensor:
    """The fixed (max_len, d_model) table of Vaswani et al.: sin on even, cos on odd channels."""
    position = torch.arange(max_len, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(1e4) / d_model)
    )
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
    return table


def position_range(
    offset: int | Tensor, length: int, device: torch.device, dtype: torch.dtype = torch.long
) -> Tensor:
    """The positions offset .. offset + length - 1. The offset is an int, or a 0-d tensor on the
    device (a StaticKVCache's length), which only tensor arithmetic may touch: anything else
    would make the host wait for the device. From an int, one operation rather than two:
    decoding asks for these a few times a layer for every token."""
    if isinstance(offset, Tensor):
        return offset + torch.arange(length, device=device, dtype=dtype)
    return torch.arange(offset, offset + length, device=device, dtype=dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al.): rotates channel pairs of q and k by position.

    The dot product of a rotated query and key then depends only on their distance. The
    rotate-half layout pairs channel i with channel i + D/2.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """Rotate x (B, H, T, D) as if its first position were `offset` (an int or a 0-d tensor)."""
        pos = position_range(offset, x.size(-2), x.device, torch.float32)
        angles = torch.outer(pos, self.inv_freq)
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(x.dtype)
        sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin


def alibi_slopes(n_head: int) -> Tensor:
    """Per-head ALiBi slopes (Press et al.): a geometric sequence starting at 2^(-8/n).

    For a head count that is not a power of two, the slopes of the next lower power of two are
    completed with every other slope of the next higher one, as in the paper.
    """

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    lower = 2 ** math.floor(math.log2(n_head))
    slopes = power_of_two_slopes(lower)
    if lower < n_head:
        slopes += power_of_two_slopes(2 * lower)[0::2][: n_head - lower]
    return torch.tensor(slopes)


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Linear distance penalty -slope * |i - j|, shape (H, Tq, Tk), added to the scores."""
    distance = (q_pos[:, None] - k_pos[None, :]).abs().to(slopes.dtype)
    return -slopes[:, None, None] * distance


# GPT-2's initial weight scale, shared by every embedding table (see blocks.init_weights).
INIT_STD = 0.02


class AddedPositions(nn.Module):
    """Learned or sinusoidal positions, added to token embeddings (B, T, C).

    For "rope", "alibi" and "none" it adds nothing: those act inside attention, or not at all.
    `limit_key` names the config key that sets max_len, for the error message.
    """

    def __init__(self, kind: str, max_len: int, d_model: int, limit_key: str):
        super().__init__()
        self.kind, self.max_len, self.limit_key = kind, max_len, limit_key
        if kind == "learned":
            self.weight = nn.Parameter(torch.empty(max_len, d_model))
            nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
        elif kind == "sinusoidal":
            # The table's entries have RMS 1/sqrt(2), ~35 times the token embeddings' INIT_STD:
            # added as is, position would drown the tokens at the start of training. Vaswani et
            # al. scale the embeddings up by sqrt(d_model); with GPT-2's small initialisation the
            # table is scaled down to the embeddings' size instead.
            table = sinusoidal_encoding(max_len, d_model) * INIT_STD * math.sqrt(2)
            self.register_buffer("weight", table, persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """x plus the encodings of positions offset .. offset + T - 1. A 0-d tensor offset (a
        static cache's length, on the device) is not checked against max_len: that would make
        the host wait for the device; the cache's owner keeps within it."""
        if self.kind not in ("learned", "sinusoidal"):
            return x
        if isinstance(offset, Tensor):
            return x + self.weight[position_range(offset, x.size(1), x.device)]
        end = offset + x.size(1)
        if end > self.max_len:
            raise ValueError(
                f"sequence of {end} tokens is longer than {self.limit_key}={self.max_len}, "
                f"the longest {self.kind} position: shorten the input or raise {self.limit_key}"
            )
        return x + self.weight[offset:end]
