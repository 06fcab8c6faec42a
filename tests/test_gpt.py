"""Tests of the decoder-only language model in model/gpt.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_encdec, tiny_gpt
from model import layers
from model.attention import AttentionConfig
from model.blocks import POSITIONS
from model.generation import decoding_step
from model.gpt import GPT, GPTConfig
from model.layers import (
    INIT_STD,
    AddedPositions,
    ThreadSplitLinear,
    sinusoidal_encoding,
    split_one_rows,
)

VOCAB = 23


CACHE_CASES = {
    **{position: {"position": position} for position in POSITIONS},
    "gqa_rope": {"position": "rope", "n_kv_head": 2},
    "mqa_alibi": {"position": "alibi", "n_kv_head": 1},
    "window_learned": {"position": "learned", "window": 3},
    "window_rope_gqa": {"position": "rope", "window": 4, "n_kv_head": 2},
}


@pytest.mark.parametrize("prompt_len", [1, 5])
@pytest.mark.parametrize("case", list(CACHE_CASES))
@torch.no_grad()
def test_kv_cache_decoding_matches_full_forward(case, prompt_len):
    model = tiny_gpt(VOCAB, **CACHE_CASES[case])
    idx = torch.randint(VOCAB, (2, 12))
    full, _ = model(idx)
    cache = model.new_cache()
    steps = [model(idx[:, :prompt_len], cache=cache)[0]]
    for t in range(prompt_len, idx.size(1)):
        steps.append(model(idx[:, t : t + 1], cache=cache)[0])
    assert cache[0].length == idx.size(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.fixture
def split_small_matrices(monkeypatch):
    """One-row products split over the threads whatever the matrix's size, so that tests can
    check the split path on the tiny models."""
    monkeypatch.setattr(layers, "SPLIT_MIN_WEIGHTS", 0)


def aten_ops(run) -> set[str]:
    """The names of the aten operators run() calls."""
    with torch.profiler.profile() as profiler:
        run()
    return {event.name for event in profiler.events()}


@pytest.mark.parametrize("bias", [True, False])
@torch.inference_mode()
def test_one_row_product_is_split_inside_split_one_rows(bias):
    layer = ThreadSplitLinear(384, 4 * 384, bias=bias)
    assert layer.weight.numel() >= layers.SPLIT_MIN_WEIGHTS
    x = torch.randn(1, 1, 384)
    with split_one_rows(2):
        assert "aten::bmm" in aten_ops(lambda: layer(x))
        y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))
    assert "aten::bmm" not in aten_ops(lambda: layer(x))  # outside: nn.Linear's path


@pytest.mark.parametrize(
    "rows, out_features, blocks",
    [(2, 4 * 384, 2), (1, 4 * 384 - 1, 2), (1, 96, 2), (1, 4 * 384, 1)],
    ids=["two_rows", "rows_not_divisible_by_blocks", "small_matrix", "one_block"],
)
@torch.inference_mode()
def test_other_products_take_nn_linears_path(rows, out_features, blocks):
    layer = ThreadSplitLinear(384, out_features)
    x = torch.randn(rows, 384)
    with split_one_rows(blocks):
        ops = aten_ops(lambda: layer(x))
        y = layer(x)
    assert "aten::bmm" not in ops
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias))


def test_split_one_rows_restores_the_count_after_a_failure():
    with pytest.raises(RuntimeError), split_one_rows(2):
        raise RuntimeError("a failing step")
    assert "aten::bmm" not in aten_ops(lambda: ThreadSplitLinear(384, 4 * 384)(torch.randn(384)))


@torch.inference_mode()
def test_one_row_product_compiles_split_in_one_graph():
    layer = ThreadSplitLinear(384, 4 * 384)
    x = torch.randn(1, 384)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)  # a graph break raises
    with split_one_rows(2):
        assert "aten::bmm" in aten_ops(lambda: compiled(x))
        torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("case", ["learned", "gqa_rope"])
@torch.inference_mode()
def test_batch_one_decoding_steps_split_and_match_full_forward(
    two_threads, split_small_matrices, case
):
    model = tiny_gpt(VOCAB, **CACHE_CASES[case])
    step = decoding_step(model, model)
    idx = torch.randint(VOCAB, (1, 12))
    full, _ = model(idx)
    cache = model.new_cache()
    first = step(idx[:, :1], cache=cache)[0]
    assert "aten::bmm" in aten_ops(lambda: step(idx[:, 1:2], cache=model.new_cache()))
    steps = [first] + [step(idx[:, t : t + 1], cache=cache)[0] for t in range(1, idx.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CACHE_CASES))
@torch.no_grad()
def test_future_tokens_never_change_past_logits(case):
    model = tiny_gpt(VOCAB, **CACHE_CASES[case])
    idx = torch.randint(VOCAB, (2, 10))
    changed = idx.clone()
    changed[:, 6] = (idx[:, 6] + 1) % VOCAB
    logits, _ = model(idx)
    changed_logits, _ = model(changed)
    torch.testing.assert_close(changed_logits[:, :6], logits[:, :6], atol=1e-6, rtol=0)
    assert not torch.allclose(changed_logits[:, 6:], logits[:, 6:], atol=1e-4)


@pytest.mark.parametrize("position", POSITIONS)
@torch.no_grad()
def test_last_position_sees_earlier_tokens_as_a_set_only_without_positions(position):
    # One layer: with more, the earlier positions' causal states already depend on their order.
    model = tiny_gpt(VOCAB, position, n_layer=1)
    with torch.no_grad():  # make the positional signals large enough to matter clearly
        for block in model.blocks:
            block.attn.qkv_proj.weight.mul_(10)
    idx = torch.randint(VOCAB, (3, 10))
    perm = torch.cat((torch.randperm(9), torch.tensor([9])))
    assert not torch.equal(perm, torch.arange(10))
    last, _ = model(idx)
    permuted_last, _ = model(idx[:, perm])
    invariant = torch.allclose(permuted_last[:, -1], last[:, -1], atol=1e-5, rtol=1e-5)
    assert invariant == (position == "none")


@pytest.mark.parametrize("position", ["none", "learned", "sinusoidal", "rope", "alibi"])
@torch.no_grad()
def test_causality_check_of_none_is_not_vacuous(position):
    # With causal attention the earlier positions do change under a permutation, even for "none".
    model = tiny_gpt(VOCAB, position)
    idx = torch.randint(VOCAB, (2, 8))
    perm = torch.tensor([3, 1, 0, 2, 6, 5, 4, 7])
    logits, _ = model(idx)
    permuted, _ = model(idx[:, perm])
    assert not torch.allclose(permuted[:, :-1], logits[:, perm[:-1]], atol=1e-4)


def test_overfits_one_small_batch():
    model = tiny_gpt(VOCAB, "rope", block_size=16, n_layer=2, n_embd=32).train()
    idx = torch.randint(VOCAB, (4, 17))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.optimizer_groups(0.0), lr=1e-2)
    first_loss = None
    for _ in range(300):
        _, loss = model(inputs, targets)
        first_loss = first_loss or loss.item()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if loss.item() < 0.05:
            break
    assert first_loss == pytest.approx(math.log(VOCAB), rel=0.1)  # starts near uniform
    assert loss.item() < 0.05


def test_loss_is_cross_entropy_and_ignores_minus_100():
    model = tiny_gpt(VOCAB)
    idx = torch.randint(VOCAB, (2, 6))
    targets = torch.randint(VOCAB, (2, 6))
    targets[0, :3] = -100
    logits, loss = model(idx, targets)
    keep = targets != -100
    expected = F.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss, expected)
    assert model(idx)[1] is None


def test_weight_tying():
    model = tiny_gpt(VOCAB)
    assert model.lm_head.weight is model.tok_emb.weight
    with torch.no_grad():
        model.tok_emb.weight[5].zero_()
    logits, _ = model(torch.randint(VOCAB, (1, 4)))
    assert (logits[..., 5] == 0.0).all()  # the tied row 5 now scores every state 0


def test_initialisation_std():
    n_layer = 4
    model = tiny_gpt(VOCAB, n_layer=n_layer, n_embd=128)
    residual_std = 0.02 / math.sqrt(2 * n_layer)
    for block in model.blocks:
        assert block.attn.out_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
        assert block.mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
        assert block.attn.qkv_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert (block.attn.qkv_proj.bias == 0).all() and (block.mlp.fc.bias == 0).all()
        assert (block.ln_1.weight == 1).all()
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_optimizer_groups(position):
    model = tiny_gpt(VOCAB, position)
    decay_group, no_decay_group = model.optimizer_groups(0.1)
    assert decay_group["weight_decay"] == 0.1 and no_decay_group["weight_decay"] == 0.0
    decay = {id(p) for p in decay_group["params"]}
    no_decay = {id(p) for p in no_decay_group["params"]}
    params = dict(model.named_parameters())
    assert not decay & no_decay
    assert decay | no_decay == {id(p) for p in params.values()}
    assert len(decay_group["params"]) + len(no_decay_group["params"]) == len(params)
    for name, param in params.items():
        is_matrix = param.dim() == 2 and not name.startswith(("tok_emb", "pos_emb"))
        assert (id(param) in decay) == is_matrix, name
    assert id(model.tok_emb.weight) in no_decay
    assert id(model.blocks[0].ln_1.weight) in no_decay and id(model.blocks[0].ln_1.bias) in no_decay
    assert id(model.blocks[0].attn.qkv_proj.bias) in no_decay
    assert id(model.blocks[0].attn.qkv_proj.weight) in decay
    if position == "learned":
        assert id(model.pos_emb.weight) in no_decay


@pytest.mark.parametrize(
    "position, n_kv_head, bias", [("learned", None, True), ("rope", 2, True), ("none", 1, False)]
)
def test_num_parameters(position, n_kv_head, bias):
    v, block, n_layer, c, ratio = VOCAB, 16, 2, 32, 4
    model = tiny_gpt(VOCAB, position, n_kv_head=n_kv_head, bias=bias)
    kv = c // 4 * (n_kv_head or 4)
    b = int(bias)
    norm = c + b * c
    attn = (c * c + b * c) + 2 * (c * kv + b * kv) + (c * c + b * c)
    mlp = (c * ratio * c + b * ratio * c) + (ratio * c * c + b * c)
    per_block = 2 * norm + attn + mlp
    pos = block * c if position == "learned" else 0
    expected = v * c + pos + n_layer * per_block + norm  # lm_head is tied: not counted twice
    assert model.num_parameters() == expected
    assert model.num_parameters(exclude_embeddings=True) == expected - pos
    assert model.num_parameters() == sum(p.numel() for p in set(model.parameters()))


def test_learned_positions_refuse_sequences_past_block_size():
    model = tiny_gpt(VOCAB, "learned", block_size=8)
    with pytest.raises(ValueError, match="9 tokens .*block_size=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    cache = model.new_cache()
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="9 tokens"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_rope_cache_overflow_raises():
    model = tiny_gpt(VOCAB, "rope", block_size=8)
    cache = model.new_cache()
    model(torch.zeros(1, 8, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="at most 8 positions, asked for 9"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert model(torch.zeros(1, 20, dtype=torch.long))[0].shape == (1, 20, VOCAB)


# --------------------------------------------------------------------------- config validation


def test_config_n_embd_not_divisible_by_n_head():
    with pytest.raises(ValueError) as info:
        GPTConfig(n_embd=128, attention=AttentionConfig(n_head=3))
    assert "n_embd=128" in str(info.value) and "n_head=3" in str(info.value)


def test_config_bad_position_lists_valid_ones():
    with pytest.raises(ValueError, match="'absolute'") as info:
        GPTConfig(position="absolute")
    for position in POSITIONS:
        assert position in str(info.value)


def test_config_rope_needs_even_head_dim():
    with pytest.raises(ValueError, match=r"rope .*= 3"):
        GPTConfig(n_embd=12, position="rope", attention=AttentionConfig(n_head=4))
    GPTConfig(n_embd=12, position="learned", attention=AttentionConfig(n_head=4))  # fine


@pytest.mark.parametrize("name", ["block_size", "n_layer", "n_embd", "mlp_ratio"])
def test_config_rejects_non_positive_sizes(name):
    with pytest.raises(ValueError, match=f"{name} must be a positive integer, got 0"):
        GPTConfig(**{name: 0})


def test_config_attention_from_dict_and_round_trip():
    config = GPTConfig(vocab_size=10, attention={"n_head": 8, "n_kv_head": 2})
    assert isinstance(config.attention, AttentionConfig) and config.attention.kv_heads == 2
    assert GPTConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="model.n_heads is not an option of GPTConfig"):
        GPTConfig.from_dict({"n_heads": 4})


def test_gpt_needs_vocab_size():
    with pytest.raises(ValueError, match="vocab_size"):
        GPT(GPTConfig())


def test_sinusoidal_table_starts_at_the_token_embeddings_scale():
    # Unscaled, the table would outweigh the N(0, 0.02) token embeddings ~35 to 1 at init.
    positions = AddedPositions("sinusoidal", max_len=256, d_model=128, limit_key="block_size")
    rms = positions.weight.square().mean().sqrt()
    assert rms == pytest.approx(INIT_STD, rel=0.01)
    torch.testing.assert_close(
        positions.weight / (INIT_STD * math.sqrt(2)), sinusoidal_encoding(256, 128)
    )


@pytest.mark.parametrize("make", [tiny_gpt, tiny_encdec], ids=["gpt", "encdec"])
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_only_linear_layers_weights_decay(make, position):
    """Weight decay is chosen by module type: the GPT and the encoder-decoder decay the same
    kinds of parameter, whatever their names (the encoder-decoder's learned position tables
    are not called *emb*)."""
    model = make(VOCAB, position=position, bias=True)
    decay, no_decay = model.optimizer_groups(0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    decayed = {id(p) for p in decay["params"]}
    grouped = [id(p) for group in (decay, no_decay) for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each exactly once
    never = (torch.nn.Embedding, torch.nn.LayerNorm, AddedPositions)
    for name, module in model.named_modules():
        if isinstance(module, never):
            assert not {id(p) for p in module.parameters()} & decayed, name
        elif isinstance(module, torch.nn.Linear) and module.bias is not None:
            assert id(module.bias) not in decayed, name
    decayed_names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert decayed_names and all(name.endswith(".weight") for name in decayed_names)
    if position == "learned":
        tables = [m for m in model.modules() if isinstance(m, AddedPositions)]
        assert tables and all(id(t.weight) not in decayed for t in tables)


@pytest.mark.parametrize("make", [tiny_gpt, tiny_encdec])
def test_dropout_drops_in_training_only_and_is_absent_at_zero(make):
    torch.manual_seed(0)
    dropping = make(VOCAB, dropout=0.3)
    idx = torch.randint(VOCAB, (2, 8))

    def logits(model):
        if isinstance(model, GPT):
            return model(idx)[0]
        return model(idx, idx)[0]

    assert torch.equal(logits(dropping), logits(dropping))  # eval: nothing dropped
    dropping.train()
    assert not torch.equal(logits(dropping), logits(dropping))
    plain = make(VOCAB, dropout=0.0)
    # not even a Dropout module that drops nothing: a decoding step would still pay its calls
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
    assert sum(isinstance(m, torch.nn.Dropout) for m in dropping.modules()) > 0
