"""What the GPT and the encoder-decoder share: config core, blocks, init, weight-decay groups."""

import math
from dataclasses import asdict, dataclass, field, replace

from torch import Tensor, nn

from errors import check_field_types, check_int, config_from
from model.attention import AttentionConfig, KVCache, MultiHeadAttention, StaticKVCache
from model.layers import INIT_STD, MLP

POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none")
# RoPE and ALiBi act inside self-attention; the others are added to the embeddings.
POSITIONS_IN_ATTENTION = ("rope", "alibi")
# The target id the models' loss ignores (padding); data/seq2seq_text.py pads with the same.
IGNORE_INDEX = -100


@dataclass
class TransformerConfig:
    """Width, positions, regularisation and attention: `model.*` on the command line."""

    vocab_size: int | None = None  # None until the tokenizer is known
    n_embd: int = 128
    position: str = "learned"
    dropout: float = 0.0  # on embeddings and residual branches
    bias: bool = True
    mlp_ratio: int = 4
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self) -> None:
        if isinstance(self.attention, dict):
            self.attention = config_from(
                AttentionConfig, self.attention, "model.attention.", "model.attention"
            )
        check_field_types(self, "model.")
        check_int("model.vocab_size", self.vocab_size, optional=True)
        check_int("model.n_embd", self.n_embd)
        check_int("model.mlp_ratio", self.mlp_ratio)
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
        if self.position == "rope":
            self.check_even_head_dim("model.position")

    def check_even_head_dim(self, key: str) -> None:
        """RoPE rotates pairs of a head's channels: `key`=rope needs an even head dimension."""
        n_head = self.attention.n_head
        head_dim = self.n_embd // n_head
        if head_dim % 2:
            raise ValueError(
                f"{key}=rope needs an even head dimension, but model.n_embd={self.n_embd} / "
                f"model.attention.n_head={n_head} = {head_dim}: make n_embd a multiple of "
                f"2 * n_head (model.n_embd={n_head * (head_dim + 1)}, say), or use another "
                "position"
            )

    @property
    def attention_position(self) -> str:
        """The position scheme self-attention applies itself ("none" for added embeddings)."""
        return self.position if self.position in POSITIONS_IN_ATTENTION else "none"

    def to_dict(self) -> dict:
        return asdict(self)

    def for_tokenizer(self, tokens: int) -> "TransformerConfig":
        """This config with the embedding's rows set for a tokenizer of `tokens` tokens: exactly
        those, unless model.vocab_size pads them (the GPT only: see GPTConfig)."""
        if self.vocab_size not in (None, tokens):
            raise ValueError(
                f"model.vocab_size={self.vocab_size}: only the GPT's vocabulary can be padded; "
                f"leave it null for the encoder-decoder (the tokenizer has {tokens} tokens)"
            )
        return replace(self, vocab_size=tokens)

    @classmethod
    def from_dict(cls, values: dict) -> "TransformerConfig":
        return config_from(cls, values, "model.", cls.__name__)


class Block(nn.Module):
    """Pre-LayerNorm block: x + self_attn(ln(x)), [x + cross_attn(ln(x), memory)], x + mlp(ln(x)).

    GPT blocks are causal; encoder blocks are not; decoder blocks are causal and cross-attend
    (cross_position "rope" lets cross-attention see target-source offsets).
    """

    def __init__(
        self, config: TransformerConfig, *, causal: bool, cross_position: str | None = None
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiHeadAttention(
            config.n_embd,
            config.attention,
            causal=causal,
            position=config.attention_position,
            bias=config.bias,
            resid_dropout=config.dropout,
        )
        if cross_position is not None:  # "none" or "rope": a decoder block
            self.ln_cross = nn.LayerNorm(config.n_embd, bias=config.bias)
            # No causality and no window over the source: the target may read all of it.
            self.cross_attn = MultiHeadAttention(
                config.n_embd,
                replace(config.attention, window=None),
                position=cross_position,
                bias=config.bias,
                resid_dropout=config.dropout,
                context_dim=config.n_embd,
            )
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config.n_embd, config.mlp_ratio * config.n_embd, config.dropout, config.bias)

    def forward(
        self,
        x: Tensor,
        *,
        padding_mask: Tensor | None = None,
        cache: KVCache | StaticKVCache | None = None,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cross_cache: KVCache | None = None,
    ) -> Tensor:
        """x (B, T, C); masks (B, T) / (B, S) True for real tokens; memory (B, S, C)."""
        offset = cache.length if cache is not None else 0  # x's first position
        x = x + self.attn(self.ln_1(x), key_padding_mask=padding_mask, cache=cache)[0]
        if memory is not None:
            attended = self.cross_attn(
                self.ln_cross(x),
                memory,
                key_padding_mask=memory_mask,
                cache=cross_cache,
                query_offset=offset,
            )[0]
            x = x + attended
        return x + self.mlp(self.ln_2(x))


def init_weights(model: nn.Module, n_layer: int) -> None:
    """GPT-2 init: N(0, 0.02) weights, zero biases, and residual output projections scaled by
    1/sqrt(2 * n_layer) so that the residual stream's variance does not grow with depth."""
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for name, param in model.named_parameters():
        if name.endswith(("attn.out_proj.weight", "mlp.proj.weight")):
            nn.init.normal_(param, mean=0.0, std=INIT_STD / math.sqrt(2 * n_layer))


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay the weights of linear layers only, chosen by module type rather than by name:
    norms, biases, token embeddings, position tables (whatever their name), and a head tied to
    an embedding keep weight decay 0."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    kept = {  # a parameter that another module also owns (weight tying) is that module's
        id(p)
        for m in model.modules()
        if not isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    }
    decay, no_decay = [], []
    for param in model.parameters():  # each shared parameter once
        if param.requires_grad:
            decays = id(param) in linear and id(param) not in kept
            (decay if decays else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
