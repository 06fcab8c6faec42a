"""The encoder-decoder of "Attention Is All You Need", built from the same attention module.

The encoder's self-attention is bidirectional and ignores source padding; the decoder's
self-attention is causal and ignores target padding; its cross-attention reads the encoder
output (the "memory") at real source positions only.
"""

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from errors import check_int
from model.attention import KVCache
from model.blocks import (
    IGNORE_INDEX,
    Block,
    TransformerConfig,
    init_weights,
    optimizer_groups,
)
from model.layers import AddedPositions, dropout_layer

CROSS_POSITIONS = ("none", "rope")


@dataclass
class EncDecConfig(TransformerConfig):
    """The encoder-decoder's shape, `model.*` on the command line."""

    n_encoder_layer: int = 3
    n_decoder_layer: int = 3
    max_source_len: int = 128
    max_target_len: int = 128  # counting the BOS token the decoder starts from
    shared_embeddings: bool = True  # one table for source and target tokens (and the head)
    label_smoothing: float = 0.0
    # "rope": cross-attention scores see the offset between target and source positions, a
    # prior for tasks whose output follows the input in order (denoising); "none": content only.
    cross_position: str = "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("n_encoder_layer", "n_decoder_layer", "max_source_len", "max_target_len"):
            check_int(f"model.{key}", getattr(self, key))
        if self.cross_position not in CROSS_POSITIONS:
            raise ValueError(
                f"model.cross_position={self.cross_position!r} is not one of "
                f"{', '.join(CROSS_POSITIONS)}"
            )
        if self.cross_position == "rope":
            self.check_even_head_dim("model.cross_position")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"model.label_smoothing must be in [0, 1), got {self.label_smoothing}")


@dataclass
class DecoderCache:
    """Per decoder layer: the growing self-attention cache and the once-filled cross cache."""

    self_attn: list[KVCache]
    cross_attn: list[KVCache]

    @property
    def length(self) -> int:
        return self.self_attn[0].length

    def reorder(self, index: Tensor) -> None:
        for cache in (*self.self_attn, *self.cross_attn):
            cache.reorder(index)


class EncoderDecoder(nn.Module):
    """forward(source (B, S), target_in (B, T), masks, targets) -> (logits (B, T, V), loss).

    Masks are boolean, True for real tokens. Targets hold IGNORE_INDEX where the loss ignores them.
    """

    def __init__(self, config: EncDecConfig):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("EncDecConfig.vocab_size is not set: take it from the tokenizer")
        self.config = config
        c = config
        self.src_emb = nn.Embedding(c.vocab_size, c.n_embd)
        self.tgt_emb = self.src_emb if c.shared_embeddings else nn.Embedding(c.vocab_size, c.n_embd)
        self.src_pos = AddedPositions(
            c.position, c.max_source_len, c.n_embd, "model.max_source_len"
        )
        self.tgt_pos = AddedPositions(
            c.position, c.max_target_len, c.n_embd, "model.max_target_len"
        )
        self.drop = dropout_layer(c.dropout)
        self.encoder = nn.ModuleList(Block(c, causal=False) for _ in range(c.n_encoder_layer))
        self.ln_enc = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.decoder = nn.ModuleList(
            Block(c, causal=True, cross_position=c.cross_position) for _ in range(c.n_decoder_layer)
        )
        self.ln_dec = nn.LayerNorm(c.n_embd, bias=c.bias)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        init_weights(self, c.n_encoder_layer + c.n_decoder_layer)
        self.lm_head.weight = self.tgt_emb.weight  # output head tied to the target embedding

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def encode(self, source: Tensor, source_mask: Tensor | None = None) -> Tensor:
        """source (B, S) -> memory (B, S, C)."""
        x = self.drop(self.src_pos(self.src_emb(source)))
        for block in self.encoder:
            x = block(x, padding_mask=source_mask)
        return self.ln_enc(x)

    def decode(
        self,
        target_in: Tensor,
        memory: Tensor,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
        cache: DecoderCache | None = None,
    ) -> Tensor:
        """target_in (B, T) and memory (B, S, C) -> logits (B, T, V).

        With a cache, target_in holds only the new positions and target_mask must be None.
        """
        offset = cache.length if cache else 0
        x = self.drop(self.tgt_pos(self.tgt_emb(target_in), offset))
        for i, block in enumerate(self.decoder):
            x = block(
                x,
                padding_mask=target_mask,
                cache=cache.self_attn[i] if cache else None,
                memory=memory,
                memory_mask=source_mask,
                cross_cache=cache.cross_attn[i] if cache else None,
            )
        return self.lm_head(self.ln_dec(x))

    def forward(
        self,
        source: Tensor,
        target_in: Tensor,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
        targets: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        memory = self.encode(source, source_mask)
        logits = self.decode(target_in, memory, source_mask, target_mask)
        if targets is None:
            return logits, None
        # Smoothing is what training minimises; in eval mode the loss is the likelihood alone,
        # so that val/loss, perplexity and evaluate.py compare runs of any smoothing.
        loss = F.cross_entropy(
            logits.flatten(0, 1),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            label_smoothing=self.config.label_smoothing if self.training else 0.0,
        )
        return logits, loss

    def new_cache(self, source_len: int, max_len: int | None = None) -> DecoderCache:
        """Empty caches for decoding up to max_len target positions from a source of source_len."""
        layers = range(len(self.decoder))
        window = self.config.attention.window  # self-attention's: cross-attention has none
        return DecoderCache(
            self_attn=[KVCache(max_len or self.config.max_target_len, window) for _ in layers],
            cross_attn=[KVCache(source_len) for _ in layers],
        )

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        return optimizer_groups(self, weight_decay)
