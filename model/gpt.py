"""A decoder-only language model: token embedding, pre-LayerNorm blocks, tied LM head."""

import math
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.attention import AttentionConfig, KVCache, MultiHeadAttention
from model.layers import MLP, sinusoidal_encoding

POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")


@dataclass
class GPTConfig:
    """The GPT's shape, `model.*` on the command line (attention knobs under model.attention)."""

    vocab_size: int | None = None  # None until the tokenizer is known
    block_size: int = 128
    n_layer: int = 4
    n_embd: int = 128
    position: str = "learned"
    dropout: float = 0.0  # on embeddings and residual branches
    bias: bool = True
    mlp_ratio: int = 4
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):
            self.attention = AttentionConfig(**self.attention)
        for name in ("block_size", "n_layer", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value}")
        if self.vocab_size is not None and (
            not isinstance(self.vocab_size, int) or self.vocab_size < 1
        ):
            raise ValueError(f"model.vocab_size must be a positive integer, got {self.vocab_size}")
        if self.position not in POSITIONS:
            raise ValueError(
                f"model.position={self.position!r} is not one of {', '.join(POSITIONS)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        n_head = self.attention.n_head
        if self.n_embd % n_head:
            divisors = [h for h in range(1, min(self.n_embd, 64) + 1) if self.n_embd % h == 0]
            raise ValueError(
                f"model.n_embd={self.n_embd} is not divisible by model.attention.n_head={n_head}: "
                f"pick n_head among {divisors} or change n_embd"
            )
        if self.position == "rope" and (self.n_embd // n_head) % 2:
            raise ValueError(
                f"model.position=rope needs an even head dimension, but model.n_embd={self.n_embd}"
                f" / model.attention.n_head={n_head} = {self.n_embd // n_head}"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown GPT config keys {unknown}; known keys are {sorted(known)}")
        return cls(**values)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiHeadAttention(
            config.n_embd,
            config.attention,
            causal=True,
            position=config.position,
            bias=config.bias,
            resid_dropout=config.dropout,
        )
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config.n_embd, config.mlp_ratio * config.n_embd, config.dropout, config.bias)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache=cache)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """forward(idx (B, T), targets (B, T) or None) -> (logits (B, T, V), loss or None)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size is not set: take it from the tokenizer")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        if config.position == "learned":
            self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        elif config.position == "sinusoidal":
            table = sinusoidal_encoding(config.block_size, config.n_embd)
            self.register_buffer("pos_table", table, persistent=False)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying (Press & Wolf)
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer) keep the stream's variance flat.
        for name, param in self.named_parameters():
            if name.endswith(("attn.out_proj.weight", "mlp.proj.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings and self.config.position == "learned":
            total -= self.pos_emb.weight.numel()
        return total

    def new_cache(self, max_len: int | None = None) -> list[KVCache]:
        """One empty KV cache per layer for incremental decoding."""
        return [KVCache(max_len or self.config.block_size) for _ in self.blocks]

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, cache: list[KVCache] | None = None
    ) -> tuple[Tensor, Tensor | None]:
        offset = cache[0].length if cache else 0
        length = idx.size(1)
        if offset + length > self.config.block_size and self.config.position in (
            "learned",
            "sinusoidal",
        ):
            raise ValueError(
                f"sequence of {offset + length} tokens is longer than model.block_size="
                f"{self.config.block_size}, the longest {self.config.position} position"
            )
        x = self.tok_emb(idx)
        if self.config.position == "learned":
            x = x + self.pos_emb(torch.arange(offset, offset + length, device=idx.device))
        elif self.config.position == "sinusoidal":
            x = x + self.pos_table[offset : offset + length]
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, cache[i] if cache else None)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Decay matrices only: norms, biases and embeddings keep weight decay 0."""
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            is_matrix = param.dim() >= 2 and "emb" not in name
            (decay if is_matrix else no_decay).append(param)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
