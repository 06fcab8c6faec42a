"""A decoder-only language model: token embedding, pre-LayerNorm blocks, tied LM head."""

from dataclasses import dataclass, replace

import torch.nn.functional as F
from torch import Tensor, nn

from errors import check_int
from model.attention import KVCache, StaticKVCache, StaticPositions
from model.blocks import (
    IGNORE_INDEX,
    Block,
    TransformerConfig,
    init_weights,
    optimizer_groups,
)
from model.layers import AddedPositions, dropout_layer


@dataclass
class GPTConfig(TransformerConfig):
    """The GPT's shape, `model.*` on the command line (attention knobs under model.attention)."""

    block_size: int = 128
    n_layer: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("model.block_size", self.block_size)
        check_int("model.n_layer", self.n_layer)

    def for_tokenizer(self, tokens: int) -> "GPTConfig":
        """The embedding's rows: the tokenizer's `tokens`, or more where model.vocab_size pads
        them (to a multiple of 64 for faster matmuls, or to a given size)."""
        if self.vocab_size is None or self.vocab_size == tokens:
            return replace(self, vocab_size=tokens)
        if self.vocab_size < tokens:
            raise ValueError(
                f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's {tokens} "
                f"tokens; leave it null, or give at least {tokens}"
            )
        return self


class GPT(nn.Module):
    """forward(idx (B, T), targets (B, T) or None) -> (logits (B, T, V), loss or None)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size is not set: take it from the tokenizer")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = AddedPositions(
            config.position, config.block_size, config.n_embd, "model.block_size"
        )
        self.drop = dropout_layer(config.dropout)
        self.blocks = nn.ModuleList(Block(config, causal=True) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        init_weights(self, config.n_layer)
        self.lm_head.weight = self.tok_emb.weight  # weight tying (Press & Wolf)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.config.position == "learned":
            total -= self.pos_emb.weight.numel()
        return total

    def new_cache(self, max_len: int | None = None) -> list[KVCache]:
        """One empty KV cache per layer for incremental decoding (the last `window` positions
        only, with a sliding window)."""
        window = self.config.attention.window
        return [KVCache(max_len or self.config.block_size, window) for _ in self.blocks]

    def new_static_cache(self, length: Tensor) -> list[StaticKVCache]:
        """One block_size-long StaticKVCache per layer, all sharing one StaticPositions around
        `length` (a 0-d long tensor on the model's device that the caller advances): the cache of
        a decoding step captured as a CUDA graph. A sliding window is a mask over it."""
        positions = StaticPositions(length, self.config.block_size, self.config.attention.window)
        return [StaticKVCache(positions) for _ in self.blocks]

    def forward(
        self,
        idx: Tensor,
        targets: Tensor | None = None,
        cache: list[KVCache] | list[StaticKVCache] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        offset = cache[0].length if cache else 0
        if cache and isinstance(cache[0], StaticKVCache):
            cache[0].positions.begin(idx.size(1))  # the pass's slots, shared by every layer
        x = self.drop(self.pos_emb(self.tok_emb(idx), offset))
        for i, block in enumerate(self.blocks):
            x = block(x, cache=cache[i] if cache else None)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        return logits, loss

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        return optimizer_groups(self, weight_decay)
