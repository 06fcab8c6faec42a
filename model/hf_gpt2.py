"""Our GPT as Hugging Face's GPT-2 (`transformers.GPT2LMHeadModel`): which of our settings GPT-2
can compute exactly, its config, and the weights in its layout and back. Plain PyTorch: export.py
hands these to transformers, and model/checkpoint.py reads such an export without it.

GPT-2's block is ours: pre-LayerNorm (eps 1e-5), learned positions, biases, an MLP of
n_inner = mlp_ratio * n_embd, a head tied to the token embedding. Where it differs it is set to
match: exact (erf) GELU, "gelu" rather than GPT-2's tanh approximation; no scaling of QKᵀ for our
scale=1.0. A model without biases exports with zero biases, which compute the same. GPT-2 has a
key/value head per query head: a model whose query heads share them (n_kv_head) exports with
each shared head repeated for its query heads, which computes the same at a larger c_attn, and
reads back as a plain multi-head model. Its Conv1D layers hold their weights as (in, out), the
transpose of nn.Linear's, and one c_attn holds the query, key and value projections side by
side.
"""

import math

import torch
from torch import Tensor, nn

from model.gpt import GPT


def gpt2_obstacle(model: nn.Module) -> str | None:
    """Why GPT-2 cannot compute `model` exactly: "needs <setting>=<value>, this checkpoint has
    <value>"; None when it can."""
    if not isinstance(model, GPT):
        return "needs a GPT (model=gpt), this checkpoint is an encoder-decoder"
    config, attention = model.config, model.config.attention
    head_dim = config.n_embd // attention.n_head
    if config.position != "learned":
        return f"needs model.position=learned, this checkpoint has {config.position}"
    # A window as long as the block hides nothing: learned positions never see more keys.
    if attention.window is not None and attention.window < config.block_size:
        return (
            f"needs model.attention.window=null (or at least model.block_size="
            f"{config.block_size}), this checkpoint has {attention.window}"
        )
    scale = attention.scale_for(head_dim)
    if not (math.isclose(scale, head_dim**-0.5) or scale == 1.0):
        return (
            f"needs model.attention.scale=1/sqrt_dk or 1.0, this checkpoint has "
            f"{attention.scale} (= {scale:.4g} for d_k={head_dim})"
        )
    return None


def gpt2_config(model: GPT, vocab_size: int) -> dict:
    """The `transformers.GPT2Config` arguments for `model` with its first `vocab_size` tokens."""
    config = model.config
    head_dim = config.n_embd // config.attention.n_head
    return {
        "vocab_size": vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.attention.n_head,
        "n_inner": config.mlp_ratio * config.n_embd,
        "activation_function": "gelu",  # exact GELU, as nn.functional.gelu
        "layer_norm_epsilon": model.ln_f.eps,
        "scale_attn_weights": config.attention.scale_for(head_dim) != 1.0,  # 1/sqrt(d_k), or 1
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.attention.dropout,
        "tie_word_embeddings": True,
    }


def _layout(n_layer: int) -> list[tuple[str, str, bool]]:
    """(our name, GPT-2's name, transposed): a Conv1D weight of GPT-2's is our Linear's
    transposed."""
    pairs = [
        ("tok_emb.weight", "transformer.wte.weight", False),
        ("pos_emb.weight", "transformer.wpe.weight", False),
        ("ln_f.weight", "transformer.ln_f.weight", False),
        ("ln_f.bias", "transformer.ln_f.bias", False),
    ]
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            linear = kind == "weight"
            pairs += [
                (f"{ours}ln_1.{kind}", f"{theirs}ln_1.{kind}", False),
                (f"{ours}ln_2.{kind}", f"{theirs}ln_2.{kind}", False),
                (f"{ours}attn.qkv_proj.{kind}", f"{theirs}attn.c_attn.{kind}", linear),
                (f"{ours}attn.out_proj.{kind}", f"{theirs}attn.c_proj.{kind}", linear),
                (f"{ours}mlp.fc.{kind}", f"{theirs}mlp.c_fc.{kind}", linear),
                (f"{ours}mlp.proj.{kind}", f"{theirs}mlp.c_proj.{kind}", linear),
            ]
    return pairs


def _unshared_heads(model: GPT, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """`state` with each layer's shared key/value heads repeated for the query heads that share
    them, in repeat_kv's order (model/attention.py): the projections of multi-head attention
    that computes the same."""
    attention = model.config.attention
    groups = attention.n_head // attention.kv_heads
    if groups == 1:
        return state
    state = dict(state)
    for i, block in enumerate(model.blocks):
        for kind in ("weight", "bias"):
            name = f"blocks.{i}.attn.qkv_proj.{kind}"
            if name in state:
                q, k, v = state[name].split(block.attn.widths)
                k, v = (x.unflatten(0, (attention.kv_heads, -1)) for x in (k, v))
                k, v = (x.repeat_interleave(groups, dim=0).flatten(0, 1) for x in (k, v))
                state[name] = torch.cat((q, k, v))
    return state


@torch.no_grad()
def to_gpt2(model: GPT, vocab_size: int) -> dict[str, Tensor]:
    """`model`'s weights as GPT2LMHeadModel's state dict, cut to the first `vocab_size` tokens:
    the rows that pad a vocabulary are never sampled, and every logit of a real token stays."""
    state = _unshared_heads(model, model.state_dict())

    def ours(name: str) -> Tensor:
        if name in state:
            return state[name]
        # No bias (model.bias=false): a zero bias computes the same.
        return torch.zeros(state[name.removesuffix("bias") + "weight"].size(0))

    weights = {}
    for name, theirs, transposed in _layout(model.config.n_layer):
        weight = ours(name)
        weights[theirs] = (weight.T if transposed else weight).contiguous()
    weights["transformer.wte.weight"] = weights["transformer.wte.weight"][:vocab_size]
    weights["lm_head.weight"] = weights["transformer.wte.weight"]  # tied, as ours
    return weights


def from_gpt2(weights: dict[str, Tensor], model: GPT) -> dict[str, Tensor]:
    """GPT2LMHeadModel's weights (its head tied, so maybe absent) as `model`'s state dict; the
    inverse of to_gpt2 for a model of the vocabulary it was cut to."""
    expected = model.state_dict().keys()
    state = {}
    for name, theirs, transposed in _layout(model.config.n_layer):
        if name in expected:  # a model without biases exported zeros for them
            weight = weights[theirs]
            state[name] = (weight.T if transposed else weight).contiguous()
    state["lm_head.weight"] = state["tok_emb.weight"]
    return state
