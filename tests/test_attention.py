"""Tests of the attention core: model/attention.py and the position helpers in model/layers.py."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import tiny_encdec, tiny_gpt
from model.attention import (
    AttentionConfig,
    KVCache,
    MultiHeadAttention,
    attention_scores,
    one_query_attention,
    repeat_kv,
    scaled_dot_product_attention,
)
from model.layers import RotaryEmbedding, alibi_slopes

TOL = {"atol": 1e-5, "rtol": 1e-5}


def qkv(*lead, tq=5, tk=7, d=8, dv=None, hkv=None, grad=False):
    """Random q (*lead, tq, d), k (*lead', tk, d), v (*lead', tk, dv); hkv replaces lead[-1]."""
    kv_lead = lead if hkv is None else (*lead[:-1], hkv)
    q = torch.randn(*lead, tq, d, requires_grad=grad)
    k = torch.randn(*kv_lead, tk, d, requires_grad=grad)
    v = torch.randn(*kv_lead, tk, dv or d, requires_grad=grad)
    return q, k, v


def causal_mask(tq, tk=None):
    return torch.ones(tq, tk or tq, dtype=torch.bool).tril()


# --------------------------------------------------------------------------- the math path


@pytest.mark.parametrize("lead", [(), (4,), (2, 3), (2, 3, 5)])
def test_sdpa_shapes_over_leading_dims(lead):
    q, k, v = qkv(*lead, tq=4, tk=7, d=8, dv=6)
    out, weights = scaled_dot_product_attention(q, k, v)
    assert out.shape == (*lead, 4, 6)
    assert weights.shape == (*lead, 4, 7)


def test_sdpa_batches_are_independent():
    q, k, v = qkv(2, 3, 5, tq=4, tk=7, d=8, dv=6)
    out, weights = scaled_dot_product_attention(q, k, v)
    one_out, one_weights = scaled_dot_product_attention(q[1, 2, 3], k[1, 2, 3], v[1, 2, 3])
    torch.testing.assert_close(out[1, 2, 3], one_out, **TOL)
    torch.testing.assert_close(weights[1, 2, 3], one_weights, **TOL)


@pytest.mark.parametrize("masked", [False, True])
def test_weight_rows_sum_to_one(masked):
    q, k, v = qkv(3, 4, tq=6, tk=9)
    mask = None
    if masked:
        mask = torch.rand(3, 4, 6, 9) > 0.5
        mask[..., 0] = True  # every row keeps at least one key
    _, weights = scaled_dot_product_attention(q, k, v, mask)
    assert (weights >= 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 4, 6), **TOL)
    if masked:
        assert (weights[~mask] == 0.0).all()


def test_causal_upper_triangle_is_exactly_zero():
    q, k, v = qkv(2, 3, tq=8, tk=8)
    _, weights = scaled_dot_product_attention(q, k, v, causal_mask(8))
    upper = torch.ones(8, 8, dtype=torch.bool).triu(diagonal=1)
    assert (weights[..., upper] == 0.0).all()
    assert (weights[..., ~upper] > 0.0).all()
    assert weights[..., 0, 0].eq(1.0).all()  # the first query sees only itself


def test_gradients_reach_q_k_v():
    q, k, v = qkv(2, 3, tq=5, tk=5, grad=True)
    out, _ = scaled_dot_product_attention(q, k, v, causal_mask(5))
    (out * torch.randn_like(out)).sum().backward()
    for tensor in (q, k, v):
        assert tensor.grad is not None
        assert torch.isfinite(tensor.grad).all()
        assert tensor.grad.abs().sum() > 0


def test_dropout_zeroes_and_rescales_weights_but_returns_them_undropped():
    q, k, _ = qkv(4, tq=64, tk=32)
    v = torch.eye(32).expand(4, 32, 32)  # the output is then the dropped weights themselves
    out, weights = scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, 64), **TOL)
    dropped = out == 0
    assert dropped.float().mean().item() == pytest.approx(0.25, abs=0.02)
    torch.testing.assert_close(out[~dropped], weights[~dropped] / 0.75, **TOL)


def test_module_attention_dropout_only_in_training():
    config = AttentionConfig(n_head=2, dropout=0.5)
    mha = MultiHeadAttention(D_MODEL, config, causal=True).eval()
    x = torch.randn(2, 6, D_MODEL)
    torch.testing.assert_close(mha(x)[0], mha(x, need_weights=True)[0], **TOL)
    mha.train()
    for need_weights in (False, True):
        assert not torch.allclose(mha(x, need_weights=need_weights)[0], mha.eval()(x)[0])
        mha.train()


@pytest.mark.parametrize("kind", ["none", "bool", "float", "broadcast_bool", "scale"])
def test_math_path_matches_torch_sdpa(kind):
    q, k, v = qkv(2, 3, tq=5, tk=7, d=8, dv=6)
    mask, scale = None, None
    if kind == "bool":
        mask = torch.rand(2, 3, 5, 7) > 0.4
        mask[..., 0] = True
    elif kind == "broadcast_bool":
        mask = torch.rand(2, 1, 5, 7) > 0.4
        mask[..., -1] = True
    elif kind == "float":
        mask = torch.randn(2, 3, 5, 7)
        mask[..., 2] = float("-inf")
    elif kind == "scale":
        scale = 0.37
    out, _ = scaled_dot_product_attention(q, k, v, mask, scale)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    torch.testing.assert_close(out, expected, **TOL)


def test_explicit_causal_mask_matches_is_causal():
    q, k, v = qkv(2, 3, tq=6, tk=6)
    out, _ = scaled_dot_product_attention(q, k, v, causal_mask(6))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("hkv", [1, 2])
def test_gqa_matches_torch_enable_gqa(hkv):
    q, k, v = qkv(2, 4, tq=5, tk=6, d=8, dv=4, hkv=hkv)
    out, weights = scaled_dot_product_attention(q, k, v, causal_mask(5, 6))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(5, 6), enable_gqa=True)
    torch.testing.assert_close(out, expected, **TOL)
    assert weights.shape == (2, 4, 5, 6)
    # query heads 0 and 1 share key/value head 0 when there are 2 kv heads
    shared = scaled_dot_product_attention(q[:, 1], k[:, 0], v[:, 0], causal_mask(5, 6))[0]
    torch.testing.assert_close(out[:, 1], shared, **TOL)


def test_repeat_kv_groups_consecutive_query_heads():
    x = torch.arange(2).float().view(1, 2, 1, 1).expand(1, 2, 3, 1)
    repeated = repeat_kv(x, 6)
    assert repeated.shape == (1, 6, 3, 1)
    assert repeated[0, :, 0, 0].tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="4 query heads cannot share 3"):
        repeat_kv(torch.zeros(1, 3, 2, 2), 4)


def test_fully_masked_row_is_zero_in_math_path():
    q, k, v = qkv(2, 3, tq=4, tk=5, grad=True)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert not torch.isnan(out).any() and not torch.isnan(weights).any()
    assert (out[..., 2, :] == 0.0).all()
    assert (weights[..., 2, :] == 0.0).all()
    torch.testing.assert_close(weights[..., [0, 1, 3], :].sum(-1), torch.ones(2, 3, 3))
    out.sum().backward()
    for tensor in (q, k, v):
        assert torch.isfinite(tensor.grad).all()
    assert (q.grad[..., 2, :] == 0.0).all()  # the masked query influences nothing


def test_fully_masked_row_from_float_mask_is_zero():
    q, k, v = qkv(2, tq=3, tk=4, grad=True)
    mask = torch.zeros(3, 4)
    mask[0] = float("-inf")
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert (out[:, 0] == 0.0).all() and (weights[:, 0] == 0.0).all()
    assert torch.isfinite(out).all()
    out.sum().backward()
    for tensor in (q, k, v):
        assert torch.isfinite(tensor.grad).all()


def test_attention_scores_mask_marks_forbidden_with_minus_inf():
    q, k, _ = qkv(2, tq=4, tk=4)
    scores = attention_scores(q, k, causal_mask(4))
    raw = q @ k.transpose(-2, -1) / math.sqrt(8)
    upper = ~causal_mask(4)
    assert torch.isneginf(scores[:, upper]).all()
    torch.testing.assert_close(scores[:, ~upper], raw[:, ~upper], **TOL)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_one_query_attention_is_the_fused_kernels_with_grouped_heads(n_kv_head):
    generator = torch.Generator().manual_seed(n_kv_head)
    q = torch.randn(3, 4, 1, 8, generator=generator)
    k, v = (torch.randn(3, n_kv_head, 10, 8, generator=generator) for _ in range(2))
    visible = torch.arange(10)[None, :] <= 6  # slots 7.. hidden: not yet written
    mask = torch.zeros(1, 10).masked_fill(~visible, float("-inf"))
    expected = F.scaled_dot_product_attention(
        q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=visible, scale=0.3
    )
    torch.testing.assert_close(one_query_attention(q, k, v, mask, 0.3), expected, **TOL)


@pytest.mark.parametrize("d_k", [16, 64, 256])
def test_unscaled_scores_grow_as_sqrt_dk_and_scaling_normalises(d_k):
    generator = torch.Generator().manual_seed(d_k)
    q = torch.randn(128, 64, d_k, generator=generator)
    k = torch.randn(128, 64, d_k, generator=generator)
    unscaled = attention_scores(q, k, scale=1.0)
    scaled = attention_scores(q, k)
    assert unscaled.std().item() == pytest.approx(math.sqrt(d_k), rel=0.05)
    assert scaled.std().item() == pytest.approx(1.0, rel=0.05)


# --------------------------------------------------------------------------- bad inputs


def test_d_model_not_divisible_by_n_head():
    with pytest.raises(ValueError, match=r"d_model=10 is not divisible by n_head=4"):
        MultiHeadAttention(10, AttentionConfig(n_head=4))


def test_n_head_not_divisible_by_n_kv_head():
    with pytest.raises(ValueError, match=r"n_head=6 .*n_kv_head=4") as info:
        AttentionConfig(n_head=6, n_kv_head=4)
    assert "[1, 2, 3, 6]" in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_head": 0},
        {"n_kv_head": 0},
        {"scale": 0.0},
        {"scale": "sqrt"},
        {"scale": True},
        {"window": 0},
        {"dropout": 1.0},
    ],
)
def test_attention_config_rejects_bad_values(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=rf"{name} .*{value}"):
        AttentionConfig(**kwargs)


@pytest.mark.parametrize(
    ("scale", "expected"), [(None, 1 / 8), ("1/sqrt_dk", 1 / 8), ("1/dk", 1 / 64), (1, 1.0)]
)
def test_named_scales_follow_the_head_dimension(scale, expected):
    mha = MultiHeadAttention(256, AttentionConfig(n_head=4, scale=scale))  # head_dim 64
    assert mha.scale == expected
    q, k = torch.randn(2, 3, 64), torch.randn(2, 5, 64)
    torch.testing.assert_close(attention_scores(q, k, scale=mha.scale), q @ k.mT * expected)


@pytest.mark.parametrize("mask_shape", [(4, 6), (2, 5, 7), (2, 3, 2, 5, 7), (4, 1, 1, 5, 7)])
def test_mask_that_cannot_broadcast(mask_shape):
    q, k, v = qkv(2, 3, tq=5, tk=7)
    with pytest.raises(ValueError, match=r"shape \(2, 3, 5, 7\)") as info:
        scaled_dot_product_attention(q, k, v, torch.ones(mask_shape, dtype=torch.bool))
    assert str(mask_shape) in str(info.value)


def test_key_padding_mask_of_wrong_length():
    mha = MultiHeadAttention(16, AttentionConfig(n_head=2))
    with pytest.raises(ValueError, match="Tk=5"):
        mha(torch.randn(2, 5, 16), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))


def test_kv_cache_overflow():
    cache = KVCache(max_len=4)
    cache.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(ValueError, match=r"at most 4 positions, asked for 5"):
        cache.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    assert cache.length == 3  # a refused append leaves the cache as it was


def test_kv_cache_appends_and_reorders():
    cache = KVCache(max_len=5)
    k1, v1 = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    k2, v2 = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    cache.append(k1, v1)
    keys, values, positions = cache.append(k2, v2)
    assert positions is None  # no window: the keys are positions 0..2 in order
    assert torch.equal(keys, torch.cat((k1, k2), dim=-2))
    assert torch.equal(values, torch.cat((v1, v2), dim=-2))
    cache.reorder(torch.tensor([2, 0]))
    assert torch.equal(cache.keys, torch.cat((k1, k2), dim=-2)[[2, 0]])


# --------------------------------------------------------------------------- the module

D_MODEL = 16

MODULE_CASES = {
    "plain": ({}, {}),
    "causal": ({"causal": True}, {}),
    "padding": ({}, {"padding": True}),
    "causal_padding": ({"causal": True}, {"padding": True}),
    "window": ({"causal": True, "window": 3}, {}),
    "window_bidirectional": ({"window": 2}, {}),
    "alibi": ({"causal": True, "position": "alibi"}, {}),
    "alibi_padding": ({"position": "alibi"}, {"padding": True}),
    "rope": ({"causal": True, "position": "rope"}, {}),
    "gqa": ({"causal": True, "n_kv_head": 2}, {}),
    "mqa_rope_window": ({"causal": True, "n_kv_head": 1, "position": "rope", "window": 2}, {}),
    "cross": ({"context_dim": 12}, {"context": True}),
    "cross_padding_gqa": ({"context_dim": 12, "n_kv_head": 2}, {"context": True, "padding": True}),
    "float_attn_mask": ({}, {"float_mask": True}),
    "bool_attn_mask_causal": ({"causal": True}, {"bool_mask": True}),
}


def make_mha(causal=False, position="none", n_head=4, n_kv_head=None, window=None, **kwargs):
    config = AttentionConfig(n_head=n_head, n_kv_head=n_kv_head, window=window)
    return MultiHeadAttention(D_MODEL, config, causal=causal, position=position, **kwargs).eval()


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_fused_and_math_paths_agree(case):
    build, inputs = MODULE_CASES[case]
    mha = make_mha(**build)
    batch, length, k_len = 2, 6, 6
    x = torch.randn(batch, length, D_MODEL)
    kwargs = {}
    if inputs.get("context"):
        k_len = 5
        kwargs["context"] = torch.randn(batch, k_len, 12)
    if inputs.get("padding"):
        padding = torch.ones(batch, k_len, dtype=torch.bool)
        padding[1, -2:] = False
        kwargs["key_padding_mask"] = padding
    if inputs.get("float_mask"):
        kwargs["attn_mask"] = torch.randn(length, k_len)
    if inputs.get("bool_mask"):
        mask = torch.rand(batch, 1, length, k_len) > 0.3
        mask[..., 0] = True
        kwargs["attn_mask"] = mask
    fused, none = mha(x, **kwargs)
    math_out, weights = mha(x, need_weights=True, **kwargs)
    assert none is None
    torch.testing.assert_close(fused, math_out, **TOL)
    assert weights.shape == (batch, 4, length, k_len)
    torch.testing.assert_close(weights.sum(-1), torch.ones(batch, 4, length), **TOL)
    if "padding" in inputs:
        assert (weights[1, ..., -2:] == 0.0).all()


@pytest.mark.parametrize("position", ["none", "alibi"])  # boolean mask, float mask
def test_fused_path_fully_masked_row_is_zero_and_backward_finite(position):
    mha = make_mha(position=position, bias=False)
    x = torch.randn(2, 4, D_MODEL, requires_grad=True)
    padding = torch.ones(2, 4, dtype=torch.bool)
    padding[1] = False  # the second sequence has no key at all
    out, _ = mha(x, key_padding_mask=padding)
    assert torch.isfinite(out).all()
    assert (out[1] == 0.0).all()
    assert (out[0] != 0.0).any()
    math_out, weights = mha(x, key_padding_mask=padding, need_weights=True)
    assert (weights[1] == 0.0).all()
    torch.testing.assert_close(out, math_out, **TOL)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    for param in mha.parameters():
        assert torch.isfinite(param.grad).all()


def test_window_query_sees_only_last_w_keys():
    window, length = 3, 8
    mha = make_mha(causal=True, window=window)
    _, weights = mha(torch.randn(2, length, D_MODEL), need_weights=True)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    inside = (j <= i) & (j > i - window)
    assert (weights[..., ~inside] == 0.0).all()
    assert (weights[..., inside] > 0.0).all()
    assert inside.sum(-1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3]


def test_bidirectional_window_is_symmetric():
    window, length = 2, 6
    mha = make_mha(window=window)
    _, weights = mha(torch.randn(1, length, D_MODEL), need_weights=True)
    distance = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).abs()
    assert (weights[..., distance >= window] == 0.0).all()
    assert (weights[..., distance < window] > 0.0).all()


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_adds_linear_distance_penalty_to_scores(causal):
    plain = make_mha(causal=causal)
    alibi = make_mha(causal=causal, position="alibi")
    alibi.load_state_dict(plain.state_dict())
    x = torch.randn(2, 5, D_MODEL)
    plain_scores, alibi_scores = plain.scores(x), alibi.scores(x)
    allowed = causal_mask(5) if causal else torch.ones(5, 5, dtype=torch.bool)
    distance = (torch.arange(5)[:, None] - torch.arange(5)[None, :]).abs().float()
    slopes = alibi_slopes(4)
    expected = plain_scores - slopes[:, None, None] * distance
    torch.testing.assert_close(alibi_scores[..., allowed], expected[..., allowed], **TOL)
    assert torch.isneginf(alibi_scores[..., ~allowed]).all()
    assert torch.isneginf(plain_scores[..., ~allowed]).all()


def test_alibi_slopes_for_eight_heads():
    assert torch.equal(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]))


def test_alibi_slopes_for_non_power_of_two():
    # 4 heads' slopes 2^-2, 2^-4, 2^-6, 2^-8, completed by the odd ones of 8 heads: 2^-1, 2^-3
    expected = torch.tensor([2.0**-e for e in (2, 4, 6, 8, 1, 3)])
    torch.testing.assert_close(alibi_slopes(6), expected, atol=0, rtol=1e-6)


def test_rope_dot_product_depends_only_on_relative_position():
    rope = RotaryEmbedding(16)
    q = torch.randn(1, 1, 1, 16)
    k = torch.randn(1, 1, 1, 16)

    def dot(m, n):
        return (rope(q, offset=m) * rope(k, offset=n)).sum().item()

    for m, n in [(0, 0), (3, 1), (2, 7), (10, 4)]:
        for shift in (1, 5, 23):
            assert dot(m + shift, n + shift) == pytest.approx(dot(m, n), abs=1e-4)
    assert abs(dot(3, 1) - dot(3, 2)) > 1e-3  # but the distance does matter
    assert rope(q, offset=0).norm().item() == pytest.approx(q.norm().item(), rel=1e-5)


def test_rope_matches_complex_rotation_of_half_split_pairs():
    # Channel i pairs with channel i + D/2; the pair, read as a complex number, turns by
    # position * base^(-2i/D).
    head_dim, length = 8, 6
    x = torch.randn(1, 2, length, head_dim, dtype=torch.float64)
    rotated = RotaryEmbedding(head_dim)(x.float(), offset=3).double()
    pairs = torch.complex(x[..., : head_dim // 2], x[..., head_dim // 2 :])
    freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = torch.arange(3, 3 + length, dtype=torch.float64)[:, None] * freq
    turned = pairs * torch.polar(torch.ones_like(angle), angle)
    expected = torch.cat((turned.real, turned.imag), dim=-1)
    torch.testing.assert_close(rotated, expected, atol=1e-5, rtol=1e-5)


def test_rope_offset_matches_slicing_a_longer_sequence():
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, 10, 8)
    torch.testing.assert_close(rope(x)[..., 4:, :], rope(x[..., 4:, :], offset=4), **TOL)


def test_rope_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even head dimension, got 5"):
        RotaryEmbedding(5)


@pytest.mark.parametrize("position", ["none", "alibi"])
def test_non_causal_self_attention_is_permutation_equivariant(position):
    # ALiBi here is symmetric in |i - j|, so it is *not* equivariant: a control for "none".
    mha = make_mha(position=position)
    x = torch.randn(2, 7, D_MODEL)
    perm = torch.randperm(7)
    out, _ = mha(x)
    permuted_out, _ = mha(x[:, perm])
    equivariant = torch.allclose(permuted_out, out[:, perm], **TOL)
    assert equivariant == (position == "none")


def test_rope_breaks_permutation_equivariance():
    plain = make_mha()
    rope = make_mha(position="rope")
    rope.load_state_dict(plain.state_dict())
    x = torch.randn(2, 7, D_MODEL)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    torch.testing.assert_close(plain(x[:, perm])[0], plain(x)[0][:, perm], **TOL)
    assert not torch.allclose(rope(x[:, perm])[0], rope(x)[0][:, perm], atol=1e-4)


def test_cross_attention_is_invariant_to_permuting_the_context():
    mha = make_mha(context_dim=12)
    x, context = torch.randn(2, 4, D_MODEL), torch.randn(2, 6, 12)
    perm = torch.randperm(6)
    torch.testing.assert_close(mha(x, context)[0], mha(x, context[:, perm])[0], **TOL)


def test_cross_attention_cache_is_filled_once_and_reused():
    mha = make_mha(context_dim=12, n_kv_head=2)
    x, context = torch.randn(2, 3, D_MODEL), torch.randn(2, 6, 12)
    full, _ = mha(x, context)
    cache = KVCache(max_len=6)
    steps = [mha(x[:, t : t + 1], context, cache=cache)[0] for t in range(3)]
    assert cache.length == 6
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


@pytest.mark.parametrize("build", [{"causal": True}, {"causal": True, "position": "rope"}])
def test_self_attention_cache_matches_full_pass(build):
    mha = make_mha(n_kv_head=2, window=4, **build)
    x = torch.randn(2, 7, D_MODEL)
    full, _ = mha(x)
    cache = KVCache(max_len=7)
    chunks = [mha(x[:, :3], cache=cache)[0]]
    chunks += [mha(x[:, t : t + 1], cache=cache)[0] for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, **TOL)


# --------------------------------------------------------------------------- vs torch.nn


def torch_twin(mha: MultiHeadAttention) -> nn.MultiheadAttention:
    """A torch.nn.MultiheadAttention holding the same weights as our (plain MHA) module."""
    reference = nn.MultiheadAttention(D_MODEL, mha.n_head, batch_first=True).eval()
    with torch.no_grad():
        reference.in_proj_weight.copy_(mha.qkv_proj.weight)  # q, k, v stacked, as ours
        reference.in_proj_bias.copy_(mha.qkv_proj.bias)
        reference.out_proj.weight.copy_(mha.out_proj.weight)
        reference.out_proj.bias.copy_(mha.out_proj.bias)
    return reference


@pytest.mark.parametrize("case", ["plain", "padding", "causal", "causal_padding"])
def test_matches_torch_multihead_attention(case):
    causal = case.startswith("causal")
    mha = make_mha(causal=causal)
    with torch.no_grad():  # non-zero biases, so that a mix-up of the bias slices shows
        for proj in (mha.qkv_proj, mha.out_proj):
            proj.bias.normal_()
    reference = torch_twin(mha)
    x = torch.randn(3, 6, D_MODEL)
    ours, torch_kwargs = {}, {}
    if "padding" in case:
        real = torch.ones(3, 6, dtype=torch.bool)
        real[0, -1:] = False
        real[2, -3:] = False
        ours["key_padding_mask"] = real
        torch_kwargs["key_padding_mask"] = ~real  # torch: True = ignore
    if causal:
        torch_kwargs["attn_mask"] = ~causal_mask(6)  # torch: True = not allowed
    expected, expected_weights = reference(
        x, x, x, need_weights=True, average_attn_weights=False, **torch_kwargs
    )
    fused, _ = mha(x, **ours)
    math_out, weights = mha(x, need_weights=True, **ours)
    torch.testing.assert_close(fused, expected, **TOL)
    torch.testing.assert_close(math_out, expected, **TOL)
    torch.testing.assert_close(weights, expected_weights, **TOL)


# --------------------------------------------------------------------------- joined projections


def separate_projections(model: nn.Module) -> dict:
    """`model`'s state dict in the layout of checkpoints written before q, k and v were joined:
    self-attention's qkv_proj and cross-attention's kv_proj split back into q_proj, k_proj,
    v_proj (of the module's own widths: with GQA, k and v are narrower than q)."""
    old = model.state_dict()
    for prefix, module in model.named_modules():
        if not isinstance(module, MultiHeadAttention):
            continue
        joined, names, widths = "qkv_proj", "qkv", module.widths
        if module.is_cross:
            joined, names, widths = "kv_proj", "kv", module.widths[1:]
        for kind in ("weight", "bias"):
            tensor = old.pop(f"{prefix}.{joined}.{kind}", None)
            if tensor is not None:  # no bias with model.bias=false
                for name, part in zip(names, tensor.split(widths), strict=True):
                    old[f"{prefix}.{name}_proj.{kind}"] = part
    return old


@pytest.mark.parametrize("kind", ["gpt", "gpt_gqa_no_bias", "encdec", "encdec_gqa"])
@torch.no_grad()
def test_checkpoints_with_separate_q_k_v_projections_load_unchanged(kind):
    makers = {
        "gpt": lambda: tiny_gpt(11, "rope"),
        "gpt_gqa_no_bias": lambda: tiny_gpt(11, "rope", n_kv_head=2, bias=False),
        "encdec": lambda: tiny_encdec(11, "rope"),
        "encdec_gqa": lambda: tiny_encdec(11, "rope", n_kv_head=2),
    }
    make = makers[kind]
    torch.manual_seed(0)
    model = make().eval()
    old_state = separate_projections(model)
    assert any(name.endswith("attn.k_proj.weight") for name in old_state)
    torch.manual_seed(1)
    loaded = make().eval()
    loaded.load_state_dict(old_state)  # strict: every key used, none missing
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def test_self_and_cross_attention_refuse_each_others_calls():
    x = torch.randn(2, 5, D_MODEL)
    with pytest.raises(ValueError, match="built with context_dim is cross-attention"):
        make_mha()(x, torch.randn(2, 4, D_MODEL))
    with pytest.raises(ValueError, match="cross-attention needs a context"):
        make_mha(context_dim=12)(x)


# --------------------------------------------------------------------------- reduced precision


@pytest.mark.parametrize("case", ["causal", "alibi", "alibi_local_gqa"])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_bf16_attention_on_the_cpu_matches_fp32(case, head_dim, monkeypatch):
    """Under bf16 autocast narrow heads run the fused kernel in fp32 on the CPU (its faster
    kernel there), wide ones in bf16; both give the fp32 result to bf16 precision, with a
    bf16 output and gradients for every parameter. The local path (a window over 4 windows or
    more) hands the kernel its ALiBi bias in fp32, cast there to the kernel's dtype."""
    kernel_dtypes = []
    fused = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        kernel_dtypes.append(q.dtype)
        return fused(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    local = case == "alibi_local_gqa"
    config = AttentionConfig(n_head=2, n_kv_head=1 if local else None, window=3 if local else None)
    position = "alibi" if case.startswith("alibi") else "none"
    mha = MultiHeadAttention(2 * head_dim, config, causal=True, position=position)
    x = torch.randn(2, 13 if local else 9, 2 * head_dim)
    expected, _ = mha(x)
    with torch.autocast("cpu", torch.bfloat16):
        out, _ = mha(x)
    assert out.dtype == torch.bfloat16
    assert kernel_dtypes == [torch.float32, torch.float32 if head_dim < 64 else torch.bfloat16]
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in mha.parameters())
