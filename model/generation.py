"""Decoding for the GPT: temperature, top-k and top-p (nucleus) sampling, or greedy."""

from collections.abc import Iterator

import torch
from torch import Tensor

from model.gpt import GPT


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to -inf every logit outside the top k and outside the smallest set of mass top_p.

    logits (B, V); reduces over V. The most likely token always survives.
    """
    if top_k is not None and top_k < logits.size(-1):
        kth_best = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(
    logits: Tensor,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick one token per row of logits (B, V) -> (B,)."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    **sampling,
) -> Iterator[Tensor]:
    """Yield max_new_tokens new tokens (B,) one step at a time, continuing idx (B, T).

    The KV cache makes a step cost one position instead of the whole context. The context is
    the last block_size tokens; when the cache fills up it is rebuilt from the last half block,
    so that the cost of re-reading the context is paid once every block_size/2 tokens.
    """
    block_size = model.config.block_size
    context = idx[:, -block_size:]
    cache = model.new_cache() if use_cache else None
    logits, _ = model(context, cache=cache)
    for step in range(max_new_tokens):
        token = next_token(logits[:, -1], **sampling)
        yield token
        if step == max_new_tokens - 1:
            return  # no forward pass for logits nobody will read
        context = torch.cat((context, token[:, None]), dim=1)
        if not use_cache:
            context = context[:, -block_size:]
            logits, _ = model(context)
        elif cache[0].length < block_size:
            logits, _ = model(token[:, None], cache=cache)
        else:
            context = context[:, -max(1, block_size // 2) :]  # block_size 1: keep 1, not all
            cache = model.new_cache()
            logits, _ = model(context, cache=cache)
