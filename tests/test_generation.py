"""Tests of decoding: model/generation.py."""

import pytest
import torch

from helpers import tiny_gpt
from model import layers
from model.generation import (
    CachedDecoding,
    StaticDecoding,
    filter_logits,
    generate,
    next_token,
)
from model.gpt import GPT

VOCAB = 29


@torch.no_grad()
def assert_decisive(model: GPT, idx: torch.Tensor, tokens: torch.Tensor, margin=1e-4) -> None:
    """Each greedy token (B, N) after idx (B, T) beats the runner-up by `margin` in the full
    forward pass, within one block. Rounding differs between machines and between decoding
    paths by ~1e-6, so with this margin two paths that pick the same tokens here do on every
    machine: the premise of comparing greedy outputs exactly."""
    sequence = torch.cat((idx, tokens), dim=1)[:, :-1]
    assert sequence.size(1) <= model.config.block_size
    best_two = model(sequence)[0][:, idx.size(1) - 1 :].topk(2, dim=-1).values
    gaps = best_two[..., 0] - best_two[..., 1]
    assert gaps.min() > margin, f"a near tie ({gaps.min():.2e}): pick another seed"


def run(model, idx, steps, **kwargs) -> torch.Tensor:
    tokens = list(generate(model, idx, steps, **kwargs))
    assert len(tokens) == steps
    return torch.stack(tokens, dim=1)


# --------------------------------------------------------------------------- filter_logits


@pytest.mark.parametrize("k", [1, 3, 7, 19])
def test_top_k_keeps_exactly_the_k_best(k):
    logits = torch.randn(4, 20)
    filtered = filter_logits(logits, top_k=k)
    kept = torch.isfinite(filtered)
    assert kept.sum(-1).tolist() == [k] * 4
    best = logits.topk(k, dim=-1).indices
    assert kept.gather(-1, best).all()
    assert torch.equal(filtered[kept], logits[kept])  # survivors are untouched
    assert torch.isneginf(filtered[~kept]).all()


@pytest.mark.parametrize("k", [20, 25])
def test_top_k_at_least_vocab_keeps_everything(k):
    logits = torch.randn(2, 20)
    assert torch.equal(filter_logits(logits, top_k=k), logits)


# probabilities 0.05, 0.40, 0.25, 0.20, 0.10 (sorted: 0.40, 0.25, 0.20, 0.10, 0.05)
PROBS = torch.tensor([[0.05, 0.40, 0.25, 0.20, 0.10]])


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.01, [1]),  # the most likely token always survives
        (1e-300, [1]),  # 0 in float32, which the tensors compare it in
        (0.39, [1]),
        (0.5, [1, 2]),
        (0.6, [1, 2]),
        (0.7, [1, 2, 3]),
        (0.8, [1, 2, 3]),
        (0.9, [1, 2, 3, 4]),
        (0.99, [0, 1, 2, 3, 4]),
        (1.0, [0, 1, 2, 3, 4]),
    ],
)
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    logits = PROBS.log() + 3.0  # any shift: top-p sees probabilities
    filtered = filter_logits(logits, top_p=top_p)
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == kept
    assert torch.equal(filtered[torch.isfinite(filtered)], logits[torch.isfinite(filtered)])


def test_top_p_works_row_by_row():
    logits = torch.stack((PROBS[0], PROBS[0].flip(0))).log()
    filtered = filter_logits(logits, top_p=0.5)
    assert torch.isfinite(filtered).nonzero().tolist() == [[0, 1], [0, 2], [1, 2], [1, 3]]


def test_top_k_then_top_p():
    logits = PROBS.log()
    # top-2 leaves 0.40 and 0.25, renormalised 0.615 and 0.385: top_p=0.5 keeps only the best
    filtered = filter_logits(logits, top_k=2, top_p=0.5)
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == [1]


def test_next_token_greedy_and_filtered_sampling():
    logits = torch.randn(6, VOCAB)
    assert torch.equal(next_token(logits, greedy=True), logits.argmax(-1))
    # top_k=1 leaves one candidate: sampling must pick the argmax
    generator = torch.Generator().manual_seed(1)
    assert torch.equal(next_token(logits, top_k=1, generator=generator), logits.argmax(-1))
    # a near-zero temperature also collapses onto the argmax
    assert torch.equal(next_token(logits, temperature=1e-4, generator=generator), logits.argmax(-1))
    # down to temperatures that float32 reads as subnormal or as 0, not NaN
    for temperature in (1e-40, 1e-50, 5e-324):
        for top_p in (None, 0.9):
            picked = next_token(logits, temperature=temperature, top_p=top_p, generator=generator)
            assert torch.equal(picked, logits.argmax(-1))


def test_a_tiny_temperature_samples_among_tied_best_tokens():
    logits = torch.tensor([[2.0, 5.0, 5.0, -1.0]]).expand(400, 4)
    generator = torch.Generator().manual_seed(0)
    tokens = next_token(logits, temperature=1e-45, generator=generator)
    assert set(tokens.tolist()) == {1, 2}


def test_sampling_follows_the_filtered_distribution():
    logits = PROBS.log().expand(4000, 5)
    generator = torch.Generator().manual_seed(0)
    tokens = next_token(logits, top_p=0.6, generator=generator)
    assert set(tokens.tolist()) == {1, 2}
    share = (tokens == 1).float().mean().item()
    assert share == pytest.approx(0.40 / 0.65, abs=0.03)


# --------------------------------------------------------------------------- generate


@pytest.mark.parametrize(
    "position, attention",
    [
        ("learned", {}),
        ("sinusoidal", {}),
        ("rope", {"n_kv_head": 2}),
        ("alibi", {"window": 4}),
        ("none", {}),
    ],
)
def test_greedy_with_and_without_cache_agree_within_block_size(position, attention):
    model = tiny_gpt(VOCAB, position, block_size=16, **attention)
    idx = torch.randint(VOCAB, (3, 5))
    # the 12th token is predicted from 5 + 11 = block_size tokens: the cache is exactly full
    cached = run(model, idx, 12, greedy=True, use_cache=True)
    assert_decisive(model, idx, cached)
    uncached = run(model, idx, 12, greedy=True, use_cache=False)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, run(model, idx, 12, greedy=True, static_cache=True))


STATIC_CASES = [
    ("learned", {}),
    ("learned", {"n_kv_head": 1}),
    ("sinusoidal", {"n_kv_head": 2}),
    ("rope", {"window": 3}),
    ("alibi", {}),
    ("none", {"window": 5}),
]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].argmax(-1)


@pytest.mark.parametrize("position, attention", STATIC_CASES)
@pytest.mark.parametrize("tokens_per_replay", [1, 2, 8])
@torch.inference_mode()
def test_static_cache_steps_give_the_kv_cache_logits_across_a_restart(
    position, attention, tokens_per_replay
):
    model = tiny_gpt(VOCAB, position, block_size=8, **attention)
    cached = CachedDecoding(model, greedy)
    static = StaticDecoding(model, greedy, tokens_per_replay=tokens_per_replay)
    logits = []
    # 5 + 3 steps fill the block; the restart's 4 positions leave slots 4..7 from before. The
    # first step feeds the caller's tokens, the others each decoding's own choice: a run of
    # several tokens hands out the ones it made ahead.
    for context in (torch.randint(VOCAB, (2, 5)), torch.randint(VOCAB, (2, 4))):
        assert torch.equal(cached.start(context), static.start(context))
        logits.append((cached.logits, static.logits))
        token = torch.randint(VOCAB, (2,))
        for _ in range(3):
            expected = cached.step(token)
            token = static.step(token)
            assert torch.equal(token, expected)
            logits.append((cached.logits, static.logits))
        assert static.length == cached.length == context.size(1) + 3
    slots = [layer._k.data_ptr() for layer in static.cache]
    static.start(torch.randint(VOCAB, (2, 6)))
    assert [layer._k.data_ptr() for layer in static.cache] == slots  # the memory never moves
    for kv_cache, static_cache in logits:
        torch.testing.assert_close(static_cache, kv_cache, atol=1e-5, rtol=1e-4)


@torch.inference_mode()
def test_a_static_cache_is_written_inside_a_gpt_pass_only():
    model = tiny_gpt(VOCAB, block_size=8)
    cache = model.new_static_cache(torch.zeros((), dtype=torch.long))
    x = torch.randn(1, 1, model.config.n_embd)
    # a block called on its own: no pass made the slots its cache writes
    with pytest.raises(ValueError, match="a StaticKVCache is written inside GPT.forward"):
        model.blocks[0](x, cache=cache[0])


@torch.inference_mode()
def test_static_decoding_refuses_to_run_past_its_block():
    static = StaticDecoding(tiny_gpt(VOCAB, block_size=8), greedy)
    static.start(torch.randint(VOCAB, (1, 8)))
    with pytest.raises(ValueError, match=r"holds 8 positions \(model.block_size\), asked for 9"):
        static.step(torch.randint(VOCAB, (1,)))
    with pytest.raises(ValueError, match="asked for 9"):
        static.start(torch.randint(VOCAB, (1, 9)))
    assert static.length == static.position.item() == 8  # a refused call changes nothing


@torch.inference_mode()
def test_static_decoding_refuses_another_batch_size_before_changing_anything():
    static = StaticDecoding(tiny_gpt(VOCAB, block_size=8), greedy)
    with pytest.raises(ValueError, match="a step before any start"):
        static.step(torch.randint(VOCAB, (2,)))
    static.start(torch.randint(VOCAB, (2, 3)))
    with pytest.raises(ValueError, match="a context of 3 rows, but this StaticDecoding decodes 2"):
        static.start(torch.randint(VOCAB, (3, 3)))
    with pytest.raises(ValueError, match=r"a step of \(3,\) tokens, but this StaticDecoding"):
        static.step(torch.randint(VOCAB, (3,)))
    assert static.length == static.position.item() == 3
    assert static.step(torch.randint(VOCAB, (2,))).shape == (2,)  # and it goes on


def test_a_compiled_step_needs_the_static_cache():
    steps = generate(tiny_gpt(VOCAB), torch.zeros((1, 1), dtype=torch.long), 3, compile_step=True)
    with pytest.raises(ValueError, match="compile_step=True compiles StaticDecoding's step"):
        next(steps)


def test_a_static_cache_needs_the_cache():
    steps = generate(
        tiny_gpt(VOCAB),
        torch.zeros((1, 1), dtype=torch.long),
        3,
        use_cache=False,
        static_cache=True,
    )
    with pytest.raises(ValueError, match="static_cache=True is a KV cache: it needs use_cache"):
        next(steps)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_gpu
@pytest.mark.parametrize("position, attention", STATIC_CASES)
@pytest.mark.parametrize("tokens_per_replay", [1, 2])
@torch.inference_mode()
def test_static_decoding_on_a_gpu_replays_graphs_without_waiting_for_the_device(
    position, attention, tokens_per_replay
):
    model = tiny_gpt(VOCAB, position, block_size=8, **attention).cuda()
    cached = CachedDecoding(model, greedy)
    static = StaticDecoding(model, greedy, tokens_per_replay=tokens_per_replay)
    logits, graphs = [], {}
    # 5 + 3 steps fill the block; the restart's 4 positions leave slots 4..7 from before, which
    # the graphs captured in the first run then read past. Two tokens a replay: in the first
    # run the first two steps are one replay, the third a replay of the one-token graph, as
    # two would not fit; both graphs are captured at the first step.
    for context in (torch.randint(VOCAB, (2, 5)), torch.randint(VOCAB, (2, 4))):
        context = context.cuda()
        cached.start(context)
        static.start(context)
        logits.append((cached.logits, static.logits))
        tokens = [torch.randint(VOCAB, (2,), device="cuda")]  # the caller's: copied in
        static_logits, before = [], torch.cuda.get_sync_debug_mode()
        try:
            for step in range(3):
                if step == 1:  # after the capture, a replay that read a number back would raise
                    torch.cuda.set_sync_debug_mode("error")
                # from the second step on, the input is the graph's own choice, already in place
                tokens.append(static.step(tokens[-1]))
                static_logits.append(static.logits.clone())
        finally:
            torch.cuda.set_sync_debug_mode(before)
        graphs = graphs or dict(static.graphs)
        assert sorted(graphs) == sorted({tokens_per_replay, 1})
        assert all(static.graphs[count] is graph for count, graph in graphs.items())
        for token, chosen, step_logits in zip(tokens[:-1], tokens[1:], static_logits, strict=True):
            assert torch.equal(chosen, greedy(step_logits))  # the graph picked from its logits
            cached.step(token)
            logits.append((cached.logits, step_logits))
    assert static.length == cached.length == 4 + 3
    for kv_cache, static_cache in logits:
        torch.testing.assert_close(static_cache, kv_cache, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
@torch.inference_mode()
def test_static_decoding_drops_the_tokens_made_ahead_when_given_others(device):
    model = tiny_gpt(VOCAB, "rope", block_size=16).to(device)
    cached = CachedDecoding(model, greedy)
    static = StaticDecoding(model, greedy, tokens_per_replay=4)
    context = torch.randint(VOCAB, (2, 3)).to(device)
    cached.start(context)
    token = static.start(context)
    for step in range(10):
        if step in (2, 7):  # halfway through a run's tokens, tokens of the caller's own
            token = torch.randint(VOCAB, (2,)).to(device)
        cached.step(token)
        token = static.step(token)
        torch.testing.assert_close(static.logits, cached.logits, atol=1e-3, rtol=1e-3)
    assert static.length == cached.length == 3 + 10
    assert static.position.item() == static.length + len(static.ahead)  # made ahead, kept


def test_a_replay_makes_at_least_one_token():
    with pytest.raises(ValueError, match="tokens_per_replay=0: make it 1 or more"):
        StaticDecoding(tiny_gpt(VOCAB), greedy, tokens_per_replay=0)


@needs_gpu
@pytest.mark.parametrize("compile_step, tokens_per_replay", [(False, 1), (False, 3), (True, 3)])
def test_static_decoding_on_a_gpu_gives_the_kv_cache_tokens_and_samples_reproducibly(
    compile_step, tokens_per_replay
):
    model = tiny_gpt(VOCAB, "rope", block_size=8).cuda()
    idx = torch.randint(VOCAB, (2, 3)).cuda()
    static = {
        "static_cache": True,
        "compile_step": compile_step,
        "tokens_per_replay": tokens_per_replay,
    }
    # 20 tokens after 3: the cache restarts from half a block twice
    cached = run(model, idx, 20, greedy=True)
    assert torch.equal(run(model, idx, 20, greedy=True, **static), cached)

    def sample(seed):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        return run(model, idx, 20, temperature=1.5, top_k=20, generator=generator, **static)

    first, again, other = sample(1234), sample(1234), sample(4321)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert ((first >= 0) & (first < VOCAB)).all()


@torch.no_grad()
def test_greedy_tokens_are_the_argmax_of_the_full_forward():
    model = tiny_gpt(VOCAB, "rope")
    idx = torch.randint(VOCAB, (2, 4))
    tokens = run(model, idx, 6, greedy=True)
    assert_decisive(model, idx, tokens)
    sequence = torch.cat((idx, tokens), dim=1)
    logits, _ = model(sequence[:, :-1])
    assert torch.equal(logits[:, 3:].argmax(-1), tokens)


def record_calls(model: GPT) -> list[tuple[torch.Tensor, int | None]]:
    """Spy on model.forward: each call's idx and the cache length it found."""
    calls, forward = [], model.forward

    def spy(idx, targets=None, cache=None):
        calls.append((idx.clone(), cache[0].length if cache else None))
        return forward(idx, targets, cache)

    model.forward = spy
    return calls


def test_cache_feeds_one_token_per_step_and_rebuilds_from_half_a_block():
    model = tiny_gpt(VOCAB, "rope", block_size=8)
    calls = record_calls(model)
    idx = torch.randint(VOCAB, (2, 3))
    tokens = run(model, idx, 10, greedy=True, use_cache=True)
    sequence = torch.cat((idx, tokens), dim=1)
    assert [call[0].size(1) for call in calls] == [3, 1, 1, 1, 1, 1, 4, 1, 1, 1]
    assert [call[1] for call in calls] == [0, 3, 4, 5, 6, 7, 0, 4, 5, 6]  # none after the last
    assert torch.equal(calls[0][0], idx)
    assert torch.equal(calls[1][0], tokens[:, :1])  # each step feeds the token just yielded
    assert torch.equal(calls[6][0], sequence[:, 5:9])  # the last half block, token 6 included


def test_without_cache_every_step_reads_the_last_block():
    model = tiny_gpt(VOCAB, "rope", block_size=8)
    calls = record_calls(model)
    idx = torch.randint(VOCAB, (2, 11))
    tokens = run(model, idx, 4, greedy=True, use_cache=False)
    sequence = torch.cat((idx, tokens), dim=1)
    assert len(calls) == 4  # no forward pass after the last token
    for step, (seen, cache_length) in enumerate(calls):
        assert cache_length is None
        assert torch.equal(seen, sequence[:, 3 + step : 11 + step])


@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_generation_runs_past_block_size(position):
    model = tiny_gpt(VOCAB, position, block_size=8)
    idx = torch.randint(VOCAB, (2, 11))  # the prompt alone is longer than block_size
    for use_cache in (True, False):
        tokens = run(model, idx, 20, greedy=True, use_cache=use_cache)
        assert tokens.shape == (2, 20)
        assert ((tokens >= 0) & (tokens < VOCAB)).all()


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_generation_with_a_tiny_block_size(block_size):
    model = tiny_gpt(VOCAB, "rope", block_size=block_size)
    idx = torch.randint(VOCAB, (2, 3))
    cached = run(model, idx, 5, greedy=True, use_cache=True)
    assert cached.shape == (2, 5)
    if block_size == 1:  # every step sees the previous token only, with or without the cache
        assert torch.equal(cached, run(model, idx, 5, greedy=True, use_cache=False))
        with torch.no_grad():
            previous = torch.cat((idx[:, -1:], cached[:, :-1]), dim=1)
            expected = model(previous.reshape(-1, 1))[0][:, -1].argmax(-1).view(2, 5)
        assert torch.equal(cached, expected)


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = tiny_gpt(VOCAB, "rope")
    idx = torch.randint(VOCAB, (2, 3))

    def sample(seed):
        generator = torch.Generator().manual_seed(seed)
        return run(model, idx, 12, temperature=1.5, top_k=20, top_p=0.95, generator=generator)

    first, again, other = sample(1234), sample(1234), sample(4321)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_batch_rows_are_generated_independently():
    model = tiny_gpt(VOCAB, "alibi")
    idx = torch.randint(VOCAB, (3, 4))
    batched = run(model, idx, 6, greedy=True)
    assert_decisive(model, idx, batched)
    for row in range(3):
        assert torch.equal(batched[row : row + 1], run(model, idx[row : row + 1], 6, greedy=True))


@pytest.mark.parametrize("use_cache", [True, False])
def test_padding_rows_of_the_vocabulary_are_never_produced(use_cache):
    model = tiny_gpt(VOCAB)
    real = VOCAB - 5  # the last 5 rows pad the embedding, as model.vocab_size > tokenizer's
    with torch.no_grad():
        model.lm_head.weight[real:] = model.lm_head.weight[real:].sign() * 50  # padding wins
    idx = torch.randint(real, (3, 4))
    unrestricted = run(model, idx, 12, greedy=True, use_cache=use_cache)
    assert (unrestricted >= real).any()  # the test would catch a leak
    for sampling in ({"greedy": True}, {"temperature": 1.0}, {"top_k": 3}, {"top_p": 0.9}):
        tokens = run(model, idx, 12, vocab_size=real, use_cache=use_cache, **sampling)
        assert (tokens < real).all(), sampling


# --------------------------------------------------------------------------- kernels and modes


def onednn_during_steps(model, method: str) -> list[bool]:
    """Spy on model.<method>: whether oneDNN was on at each call."""
    seen, call = [], getattr(model, method)

    def spy(*args, **kwargs):
        seen.append(torch.backends.mkldnn.enabled)
        return call(*args, **kwargs)

    setattr(model, method, spy)
    return seen


@pytest.mark.parametrize("use_cache, static_cache", [(True, False), (True, True), (False, False)])
def test_fp32_decoding_steps_run_as_decoding_steps_and_leave_the_settings_as_they_were(
    two_threads, use_cache, static_cache
):
    model = tiny_gpt(VOCAB, "rope", block_size=8)
    seen, forward = [], model.forward

    def spy(*args, **kwargs):
        seen.append((torch.backends.mkldnn.enabled, layers._one_row_blocks))
        return forward(*args, **kwargs)

    model.forward = spy
    idx = torch.randint(VOCAB, (2, 3))
    tokens = generate(model, idx, 10, greedy=True, use_cache=use_cache, static_cache=static_cache)
    for _ in tokens:  # never set between steps: the settings are global
        assert torch.backends.mkldnn.enabled and layers._one_row_blocks == 1
    # the prompt, then one step per token but the last: oneDNN off, products split in two
    assert seen == [(False, 2)] * 10


def test_decoding_under_autocast_leaves_products_unsplit(two_threads):
    model = tiny_gpt(VOCAB, "rope", block_size=8)
    seen, forward = [], model.forward

    def spy(*args, **kwargs):
        seen.append(layers._one_row_blocks)
        return forward(*args, **kwargs)

    model.forward = spy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        run(model, torch.randint(VOCAB, (1, 3)), 3, greedy=True)
    assert seen == [1, 1, 1]


def test_decoding_restores_onednn_after_a_failing_step():
    model = tiny_gpt(VOCAB, "rope", block_size=8)
    with pytest.raises(IndexError):
        next(generate(model, torch.full((1, 2), VOCAB + 5), 3))  # an id past the vocabulary
    assert torch.backends.mkldnn.enabled


def test_bf16_decoding_keeps_onednn():
    # bf16 matmuls on the CPU run through oneDNN: switching it off would slow them down
    model = tiny_gpt(VOCAB, "rope").to(torch.bfloat16)
    seen = onednn_during_steps(model, "forward")
    run(model, torch.randint(VOCAB, (1, 3)), 4, greedy=True)
    assert seen == [True] * 4


def test_a_model_trains_on_after_generating():
    # decoding runs in inference mode: nothing it leaves behind may block a training step
    model = tiny_gpt(VOCAB, "rope").train()
    idx = torch.randint(VOCAB, (2, 6))
    tokens = run(model, idx, 5)
    sequence = torch.cat((idx, tokens), dim=1)
    _, loss = model(sequence[:, :-1], sequence[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
