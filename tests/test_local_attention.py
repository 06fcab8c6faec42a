"""Tests of the sliding window at local cost (model/attention.py): local_attention, when
MultiHeadAttention takes it, and the windowed KV cache in decoding. The reference everywhere is
the dense path: the math path given the whole (T, T) mask."""

import pytest
import torch

import model.attention as attention
from helpers import BOS, EOS, FIRST_WORD, PAD, sharpened, tiny_encdec, tiny_gpt
from model.attention import (
    AttentionConfig,
    KVCache,
    MultiHeadAttention,
    local_attention,
    scaled_dot_product_attention,
)
from model.generation import beam_search, decode_greedy_or_sample, generate
from model.layers import alibi_slopes

TOL = {"atol": 1e-5, "rtol": 1e-5}
D_MODEL = 16
VOCAB = 19


def dense_reference(q, k, v, window, causal, padding=None, slopes=None):
    """Windowed attention the dense way: the math path with the (T, T) mask written out."""
    length = q.size(-2)
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]  # i - j
    allowed = (distance >= 0) & (distance < window) if causal else distance.abs() < window
    if padding is not None:
        allowed = allowed & padding[:, None, None, :]
    if slopes is None:
        return scaled_dot_product_attention(q, k, v, allowed)[0]
    bias = -slopes[:, None, None].to(q.dtype) * distance.abs()
    return scaled_dot_product_attention(q, k, v, bias.masked_fill(~allowed, float("-inf")))[0]


def spy_on_local_path(monkeypatch) -> list[int]:
    """Count the calls MultiHeadAttention makes to local_attention (one entry per call)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return local_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "local_attention", counted)
    return calls


# --------------------------------------------------------------------------- local_attention

# (T, W): T < W, T = 1, T a multiple of W or not, W = 1, many blocks
LENGTHS = [(1, 4), (3, 4), (4, 4), (13, 4), (16, 4), (9, 1), (23, 5), (40, 7)]
FUNCTION_CASES = {
    "causal": {"causal": True},
    "bidirectional": {"causal": False},
    "gqa": {"causal": True, "hkv": 2},
    "mqa_bidirectional": {"causal": False, "hkv": 1},
    "padding": {"causal": True, "padding": True},
    "padding_bidirectional_gqa": {"causal": False, "padding": True, "hkv": 2},
    "alibi": {"causal": True, "alibi": True},
    "alibi_bidirectional_padding_mqa": {"causal": False, "alibi": True, "padding": True, "hkv": 1},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(FUNCTION_CASES))
@pytest.mark.parametrize("length, window", LENGTHS)
def test_local_attention_equals_dense_with_gradients(length, window, case, dtype):
    options = FUNCTION_CASES[case]
    causal, hkv = options["causal"], options.get("hkv", 4)
    q = torch.randn(2, 4, length, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, hkv, length, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, hkv, length, 8, dtype=dtype, requires_grad=True)
    padding = torch.rand(2, length) > 0.4 if options.get("padding") else None
    slopes = alibi_slopes(4).to(dtype) if options.get("alibi") else None

    out = local_attention(
        q, k, v, window, causal=causal, key_padding_mask=padding, alibi_slopes=slopes
    )
    expected = dense_reference(q, k, v, window, causal, padding, slopes)
    tolerance = TOL if dtype == torch.float32 else {"atol": 1e-12, "rtol": 1e-12}
    torch.testing.assert_close(out, expected, **tolerance)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad, expected_grad, **tolerance)


def test_local_attention_query_with_only_padding_in_reach_gets_zeros():
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    padding = torch.ones(1, 12, dtype=torch.bool)
    padding[0, 3:8] = False  # with window 3, queries 5, 6 and 7 see padding only
    out = local_attention(q, k, v, 3, key_padding_mask=padding)
    assert (out[0, :, 5:8] == 0).all()
    assert (out[0, :, [4, 8]] != 0).all()


def test_local_attention_scale_and_dropout_reach_the_kernel():
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    torch.testing.assert_close(
        local_attention(q, k, v, 3, scale=0.3), dense_reference(q * 0.3 * 8**0.5, k, v, 3, True)
    )
    dropped = local_attention(q, k, v, 3, dropout_p=0.5)
    assert not torch.allclose(dropped, local_attention(q, k, v, 3))


# --------------------------------------------------------------------------- the module


def make_mha(causal=True, position="none", n_kv_head=None, window=3, **kwargs):
    config = AttentionConfig(n_head=4, n_kv_head=n_kv_head, window=window)
    return MultiHeadAttention(D_MODEL, config, causal=causal, position=position, **kwargs).eval()


MODULE_CASES = {
    "causal": {},
    "bidirectional": {"causal": False},
    "gqa_rope": {"n_kv_head": 2, "position": "rope"},
    "mqa_alibi": {"n_kv_head": 1, "position": "alibi"},
    "alibi_bidirectional": {"causal": False, "position": "alibi"},
    "rope_bidirectional_gqa": {"causal": False, "position": "rope", "n_kv_head": 2},
}


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_module_takes_the_local_path_and_matches_the_dense_one(case, padding, monkeypatch):
    calls = spy_on_local_path(monkeypatch)
    mha = make_mha(**MODULE_CASES[case])
    with torch.no_grad():  # non-zero biases, so that their gradients are compared too
        for proj in (mha.qkv_proj, mha.out_proj):
            proj.bias.normal_()
    x = torch.randn(2, 23, D_MODEL, requires_grad=True)  # 23 >= 4 windows of 3
    kwargs = {}
    if padding:
        kwargs["key_padding_mask"] = torch.rand(2, 23) > 0.3
    inputs = [x, *mha.parameters()]

    local, _ = mha(x, **kwargs)
    assert len(calls) == 1
    dense, weights = mha(x, need_weights=True, **kwargs)  # the math path, with the full mask
    assert len(calls) == 1 and weights.shape == (2, 4, 23, 23)
    torch.testing.assert_close(local, dense, **TOL)
    grad_out = torch.randn_like(local)
    grads = torch.autograd.grad(local, inputs, grad_out)
    expected = torch.autograd.grad(dense, inputs, grad_out)
    for grad, expected_grad in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, expected_grad, **TOL)


def fallback_call(case: str, x: torch.Tensor) -> tuple[tuple, dict]:
    """Arguments of a call the local path does not take."""
    if case == "short":  # under 4 windows of 3: the dense kernel is as fast
        return (x[:, :11],), {}
    if case == "attn_mask":  # any mask of the caller's
        return (x,), {"attn_mask": torch.rand(23, 23) > 0.5}
    return (x, torch.randn(2, 23, D_MODEL)), {}  # cross-attention


@pytest.mark.parametrize("case", ["short", "attn_mask", "cross"])
def test_what_the_local_path_does_not_cover_goes_dense(case, monkeypatch):
    calls = spy_on_local_path(monkeypatch)
    mha = make_mha(position="alibi", **({"context_dim": D_MODEL} if case == "cross" else {}))
    args, kwargs = fallback_call(case, torch.randn(2, 23, D_MODEL))
    out, _ = mha(*args, **kwargs)
    assert calls == []
    torch.testing.assert_close(out, mha(*args, need_weights=True, **kwargs)[0], **TOL)


def test_gpt_and_encoder_decoder_layers_take_the_local_path(monkeypatch):
    calls = spy_on_local_path(monkeypatch)
    gpt = tiny_gpt(VOCAB, "rope", window=2, block_size=32)
    gpt(torch.randint(VOCAB, (2, 20)))
    assert len(calls) == 2  # both layers
    calls.clear()
    encdec = tiny_encdec(VOCAB, "alibi", window=2)
    source = torch.randint(FIRST_WORD, VOCAB, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[1, 10:] = False
    encdec(source, torch.randint(FIRST_WORD, VOCAB, (2, 12)), mask)
    assert len(calls) == 4  # 2 encoder layers (with padding) and 2 decoder self-attentions


# --------------------------------------------------------------------------- the windowed cache


def test_window_cache_is_a_ring_of_the_last_w_positions():
    window, steps = 4, [3, 1, 1, 1, 1, 1, 5, 1, 2, 1]  # chunks and single steps, wrapping
    cache = KVCache(max_len=20, window=window)
    k_all, v_all = torch.randn(2, 3, 20, 8), torch.randn(2, 3, 20, 8)
    start = 0
    for count in steps:
        end = start + count
        keys, values, positions = cache.append(k_all[..., start:end, :], v_all[..., start:end, :])
        if positions is None:  # the ring has not wrapped: positions 0..Tk-1 in order
            positions = torch.arange(keys.size(-2))
        first_needed = start - window + 1  # what the earliest new query reaches
        assert set(positions.tolist()) >= set(range(max(0, first_needed), end))
        assert torch.equal(keys, k_all[..., positions, :])
        assert torch.equal(values, v_all[..., positions, :])
        assert cache.length == end
        assert cache.keys.size(-2) == min(end, window) <= cache.slots == window
        start = end


@pytest.mark.parametrize("chunks", [[2] + [1] * 13, [5, 4] + [1] * 6])
@pytest.mark.parametrize(
    "case", [name for name, b in MODULE_CASES.items() if b.get("causal", True)]
)
@torch.no_grad()
def test_cached_windowed_decoding_equals_the_full_pass(case, chunks):
    mha = make_mha(**MODULE_CASES[case])  # causal: a cache serves decoders
    x = torch.randn(2, sum(chunks), D_MODEL)
    full, _ = mha(x)  # the local path: 15 >= 4 windows of 3
    cache = KVCache(max_len=x.size(1), window=3)
    steps, start = [], 0
    for count in chunks:
        steps.append(mha(x[:, start : start + count], cache=cache)[0])
        start += count
        assert cache.keys.size(-2) <= 3
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


@pytest.mark.parametrize("prompt_len", [1, 13])
@pytest.mark.parametrize(
    "options", [{"position": "learned"}, {"position": "alibi", "n_kv_head": 2}]
)
@torch.no_grad()
def test_gpt_window_cache_holds_w_positions_and_matches_full_forward(options, prompt_len):
    model = tiny_gpt(VOCAB, window=3, block_size=32, **options)
    idx = torch.randint(VOCAB, (2, 30))
    full, _ = model(idx)
    cache = model.new_cache()
    steps = [model(idx[:, :prompt_len], cache=cache)[0]]
    for t in range(prompt_len, idx.size(1)):
        steps.append(model(idx[:, t : t + 1], cache=cache)[0])
        assert all(c.keys.size(-2) == min(t + 1, 3) for c in cache)
    assert all(c.slots == 3 and c.length == 30 for c in cache)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def full_caches(monkeypatch) -> None:
    """Make every new KVCache keep all positions, as before the ring buffer."""
    original = KVCache.__init__
    monkeypatch.setattr(
        KVCache, "__init__", lambda self, max_len, window=None: original(self, max_len)
    )


@pytest.mark.parametrize("sampling", [{"greedy": True}, {"temperature": 1.0}])
@pytest.mark.parametrize("position", ["rope", "alibi", "learned"])
def test_generation_with_a_window_gives_the_dense_paths_tokens(position, sampling, monkeypatch):
    model = sharpened(tiny_gpt(VOCAB, position, window=3, block_size=32, n_kv_head=2))
    idx = torch.randint(VOCAB, (3, 14))  # the prompt goes through the local path

    def tokens(use_cache: bool) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        steps = generate(model, idx, 18, use_cache=use_cache, generator=generator, **sampling)
        return torch.stack(list(steps), dim=1)

    windowed, uncached = tokens(True), tokens(False)
    with monkeypatch.context() as dense:
        dense.setattr(attention, "LOCAL_MIN_WINDOWS", 10**9)
        full_caches(dense)
        dense_cached, dense_uncached = tokens(True), tokens(False)
    assert torch.equal(windowed, dense_cached)
    assert torch.equal(windowed, uncached)
    assert torch.equal(windowed, dense_uncached)
    assert len(set(windowed.flatten().tolist())) > 3  # not one token repeated


def test_encoder_decoder_with_a_window_decodes_as_the_dense_path(monkeypatch):
    model = sharpened(tiny_encdec(VOCAB, "rope", window=2, n_kv_head=2))
    lengths = torch.tensor([14, 9, 12])
    mask = torch.arange(14)[None, :] < lengths[:, None]
    source = torch.randint(FIRST_WORD, VOCAB, (3, 14)).masked_fill(~mask, PAD)
    ids = {"bos_id": BOS, "eos_id": EOS, "max_new_tokens": 14}
    greedy = decode_greedy_or_sample(model, source, mask, greedy=True, **ids)
    beams = beam_search(model, source, mask, beam_size=3, **ids)
    cache = model.new_cache(14)
    assert all(c.slots == 2 for c in cache.self_attn) and cache.cross_attn[0].slots == 14
    with monkeypatch.context() as dense:
        dense.setattr(attention, "LOCAL_MIN_WINDOWS", 10**9)
        full_caches(dense)
        assert greedy == decode_greedy_or_sample(model, source, mask, greedy=True, **ids)
        assert beams == beam_search(model, source, mask, beam_size=3, **ids)
    assert any(len(row) > 3 for row in greedy)
