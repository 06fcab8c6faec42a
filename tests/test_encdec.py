"""Tests of the encoder-decoder in model/encdec.py (and its use of model/blocks.py)."""

import pytest
import torch
import torch.nn.functional as F

from data.seq2seq_text import IGNORE_INDEX
from helpers import BOS, EOS, FIRST_WORD, PAD, sharpened, tiny_encdec
from model.attention import AttentionConfig
from model.blocks import POSITIONS
from model.encdec import EncDecConfig, EncoderDecoder
from model.generation import beam_search, decode_greedy_or_sample
from model.inspect import record_attention

VOCAB = 13


def padded_source(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random word ids (B, width), PAD after each row's length; mask True for real tokens."""
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    source = torch.randint(FIRST_WORD, VOCAB, (len(lengths), width))
    return source.masked_fill(~mask, PAD), mask


def scramble_padding(source: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The same source with other (non-PAD) token ids at every padded position."""
    scrambled = source.clone()
    scrambled[~mask] = torch.randint(FIRST_WORD, VOCAB, (int((~mask).sum()),))
    assert not torch.equal(scrambled, source)
    return scrambled


CASES = {
    **{position: {"position": position} for position in POSITIONS},
    "gqa_rope": {"position": "rope", "n_kv_head": 2},
    "mqa_alibi": {"position": "alibi", "n_kv_head": 1},
    "window_learned": {"position": "learned", "window": 3},
    "window_rope_gqa": {"position": "rope", "window": 2, "n_kv_head": 2},
    "cross_rope": {"position": "rope", "cross_position": "rope"},
    "cross_rope_learned_gqa": {"position": "learned", "cross_position": "rope", "n_kv_head": 2},
}
# Row 0 is padded: record_attention keeps the first sample only.
LENGTHS = [5, 9, 3]


# --------------------------------------------------------------------------- padding and masks


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_encoder_ignores_padded_source_tokens(case):
    model = sharpened(tiny_encdec(VOCAB, **CASES[case]))
    source, mask = padded_source(LENGTHS, 9)
    memory = model.encode(source, mask)
    scrambled = model.encode(scramble_padding(source, mask), mask)
    torch.testing.assert_close(scrambled[mask], memory[mask], atol=1e-6, rtol=0)
    assert torch.isfinite(memory).all()

    # A real token does matter, to its neighbours at least (a window limits the reach).
    changed = source.clone()
    changed[:, 1] = FIRST_WORD + (source[:, 1] - FIRST_WORD + 1) % (VOCAB - FIRST_WORD)
    difference = (model.encode(changed, mask) - memory).abs().amax(dim=-1)  # (B, S)
    reached = mask.clone() if "window" not in case else mask & (torch.arange(9) <= 2)
    assert (difference[reached] > 1e-4).all()


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_decoder_output_ignores_padded_source_tokens(case):
    model = sharpened(tiny_encdec(VOCAB, **CASES[case]))
    source, mask = padded_source(LENGTHS, 9)
    target_in = torch.randint(FIRST_WORD, VOCAB, (3, 6))
    logits, _ = model(source, target_in, mask)
    scrambled, _ = model(scramble_padding(source, mask), target_in, mask)
    torch.testing.assert_close(scrambled, logits, atol=1e-6, rtol=0)
    # ...while without the mask the padded tokens would be read: the mask is doing the work.
    unmasked, _ = model(source, target_in)
    assert not torch.allclose(unmasked[0], logits[0], atol=1e-4)
    torch.testing.assert_close(unmasked[1], logits[1], atol=1e-5, rtol=1e-5)  # row 1: no padding


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_decoder_position_never_sees_later_targets(case):
    model = sharpened(tiny_encdec(VOCAB, **CASES[case]))
    source, mask = padded_source(LENGTHS, 9)
    target_in = torch.randint(FIRST_WORD, VOCAB, (3, 8))
    logits, _ = model(source, target_in, mask)
    for t in (0, 3, 6):
        changed = target_in.clone()
        changed[:, t + 1 :] = FIRST_WORD + (target_in[:, t + 1 :] - FIRST_WORD + 1) % 10
        changed_logits, _ = model(source, changed, mask)
        torch.testing.assert_close(
            changed_logits[:, : t + 1], logits[:, : t + 1], atol=1e-6, rtol=0
        )
        # Position t + 1 reads its own (changed) token.
        assert (changed_logits[:, t + 1] - logits[:, t + 1]).abs().amax() > 1e-4

    # Earlier tokens matter: changing token 2 changes positions 2 and 3 (any window >= 2 sees it).
    changed = target_in.clone()
    changed[:, 2] = FIRST_WORD + (target_in[:, 2] - FIRST_WORD + 1) % 10
    changed_logits, _ = model(source, changed, mask)
    difference = (changed_logits - logits).abs().amax(dim=-1)  # (B, T)
    assert (difference[:, 2:4] > 1e-4).all()
    torch.testing.assert_close(changed_logits[:, :2], logits[:, :2], atol=1e-6, rtol=0)


def cross_and_self_records(model, source, mask, target_in):
    records = record_attention(model, lambda: model(source, target_in, mask))
    return {record.name: record for record in records}


@torch.no_grad()
def test_cross_attention_weights_are_zero_on_padded_source():
    model = tiny_encdec(VOCAB, "rope", n_kv_head=2)
    source, mask = padded_source(LENGTHS, 9)
    target_in = torch.randint(FIRST_WORD, VOCAB, (3, 6))
    records = cross_and_self_records(model, source, mask, target_in)
    layers = range(2)
    assert set(records) == {
        *(f"encoder/layer{i}/attn" for i in layers),
        *(f"decoder/layer{i}/attn" for i in layers),
        *(f"decoder/layer{i}/cross_attn" for i in layers),
    }
    real = mask[0]  # the records hold sample 0, which has 5 real tokens of 9
    assert real.sum() == 5
    for i in layers:
        cross = records[f"decoder/layer{i}/cross_attn"].weights  # (H, T, S)
        assert cross.shape == (4, 6, 9)
        assert (cross[..., ~real] == 0).all()
        assert (cross[..., real] > 0).all()
        torch.testing.assert_close(cross[..., real].sum(-1), torch.ones(4, 6))
        # The encoder's self-attention ignores padded keys too.
        encoder = records[f"encoder/layer{i}/attn"].weights  # (H, S, S)
        assert (encoder[..., ~real] == 0).all()
        torch.testing.assert_close(encoder.sum(-1), torch.ones(4, 9))
        # The decoder's self-attention is causal: nothing above the diagonal.
        decoder = records[f"decoder/layer{i}/attn"].weights  # (H, T, T)
        allowed = torch.ones(6, 6, dtype=torch.bool).tril()
        assert (decoder[..., ~allowed] == 0).all() and (decoder[..., allowed] > 0).all()


@torch.no_grad()
def test_attention_window_does_not_restrict_cross_attention():
    # Source and target positions are unrelated: the window is a self-attention setting.
    model = tiny_encdec(VOCAB, "learned", window=1)
    source, mask = padded_source(LENGTHS, 9)
    target_in = torch.randint(FIRST_WORD, VOCAB, (3, 6))
    records = cross_and_self_records(model, source, mask, target_in)
    real = mask[0]
    for i in range(2):
        cross = records[f"decoder/layer{i}/cross_attn"].weights
        assert (cross[..., real] > 0).all() and (cross[..., ~real] == 0).all()
        decoder = records[f"decoder/layer{i}/attn"].weights  # window 1: each sees only itself
        torch.testing.assert_close(decoder, torch.eye(6).expand(4, 6, 6))
        encoder = records[f"encoder/layer{i}/attn"].weights
        torch.testing.assert_close(encoder[:, real][:, :, real], torch.eye(5).expand(4, 5, 5))


# --------------------------------------------------------------------------- cached decoding


@pytest.mark.parametrize("prompt_len", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_cached_decode_matches_full_decode(case, prompt_len):
    model = tiny_encdec(VOCAB, **CASES[case])
    source, mask = padded_source(LENGTHS, 9)
    target_in = torch.randint(FIRST_WORD, VOCAB, (3, 10))
    memory = model.encode(source, mask)
    full = model.decode(target_in, memory, mask)
    cache = model.new_cache(source.size(1))
    steps = [model.decode(target_in[:, :prompt_len], memory, mask, cache=cache)]
    for t in range(prompt_len, target_in.size(1)):
        steps.append(model.decode(target_in[:, t : t + 1], memory, mask, cache=cache))
    assert cache.length == 10
    assert all(c.length == 9 for c in cache.cross_attn)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_cached_greedy_decoding_equals_uncached(case):
    model = sharpened(tiny_encdec(VOCAB, **CASES[case]))
    source, mask = padded_source([6, 9, 2, 4], 9)
    kwargs = {"bos_id": BOS, "eos_id": EOS, "max_new_tokens": 12, "greedy": True}
    cached = decode_greedy_or_sample(model, source, mask, use_cache=True, **kwargs)
    uncached = decode_greedy_or_sample(model, source, mask, use_cache=False, **kwargs)
    assert cached == uncached
    assert len(cached) == 4 and all(len(row) <= 12 and EOS not in row for row in cached)
    assert any(row for row in cached)


def count_calls(modules) -> tuple[list[int], list]:
    counts = [0] * len(modules)

    def counter(i):
        def hook(module, args, output):
            counts[i] += 1

        return hook

    return counts, [m.register_forward_hook(counter(i)) for i, m in enumerate(modules)]


@torch.no_grad()
def test_cross_attention_projects_the_memory_once_per_decode():
    model = tiny_encdec(VOCAB, "rope")
    source, mask = padded_source(LENGTHS, 9)
    target_in = torch.randint(FIRST_WORD, VOCAB, (3, 7))
    memory = model.encode(source, mask)
    layers = model.decoder
    kv_counts, handles = count_calls([block.cross_attn.kv_proj for block in layers])
    q_counts, more = count_calls([block.cross_attn.q_proj for block in layers])
    handles += more
    try:
        cache = model.new_cache(source.size(1))
        for t in range(target_in.size(1)):
            model.decode(target_in[:, t : t + 1], memory, mask, cache=cache)
        assert q_counts == [7, 7]  # a query per step...
        assert kv_counts == [1, 1]  # ...but keys and values once

        kv_counts[:] = [0, 0]
        for t in range(1, target_in.size(1) + 1):  # without a cache: every step re-projects
            model.decode(target_in[:, :t], memory, mask)
        assert kv_counts == [7, 7]

        # Beam search runs two decodes, the beam's and greedy's (which competes with it).
        for decode, extra, passes in (
            (decode_greedy_or_sample, {"greedy": True}, 1),
            (beam_search, {"beam_size": 1}, 1),
            (beam_search, {"beam_size": 3}, 2),
        ):
            kv_counts[:] = q_counts[:] = [0, 0]
            decode(model, source, mask, bos_id=BOS, eos_id=EOS, max_new_tokens=6, **extra)
            assert q_counts[0] > passes, decode.__name__  # several steps were taken
            assert kv_counts == [passes, passes], (decode.__name__, extra)
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------- training


def reverse_task(n_pairs: int, max_len: int):
    """Pairs (source, reversed source) as padded tensors, with targets -100 past EOS."""
    lengths = torch.randint(2, max_len + 1, (n_pairs,)).tolist()
    source, source_mask = padded_source(lengths, max_len)
    outputs = [source[i, :n].flip(0).tolist() for i, n in enumerate(lengths)]
    target_in = torch.full((n_pairs, max_len + 1), PAD)
    targets = torch.full((n_pairs, max_len + 1), -100)
    for i, out in enumerate(outputs):
        target_in[i, : len(out) + 1] = torch.tensor([BOS, *out])
        targets[i, : len(out) + 1] = torch.tensor([*out, EOS])
    return source, source_mask, target_in, target_in != PAD, targets, outputs


def test_overfits_small_batch_then_decoders_reproduce_targets_that_are_clearly_best():
    model = tiny_encdec(VOCAB, "learned", n_encoder_layer=1, n_decoder_layer=2).train()
    source, source_mask, target_in, target_mask, targets, outputs = reverse_task(8, 6)
    optimizer = torch.optim.AdamW(model.optimizer_groups(0.0), lr=1e-2)
    first_loss = None
    for _ in range(600):
        _, loss = model(source, target_in, source_mask, target_mask, targets)
        first_loss = first_loss or loss.item()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if loss.item() < 0.01:
            break
    assert first_loss > 2.0  # starts near uniform (log 13 = 2.56)
    assert loss.item() < 0.01
    model.eval()
    max_new_tokens = 12
    with torch.no_grad():
        log_probs = model(source, target_in, source_mask, target_mask)[0].double().log_softmax(-1)
    for i, out in enumerate(outputs):
        steps = log_probs[i, : len(out) + 1]  # the target tokens, then EOS
        target = torch.tensor([*out, EOS])
        chosen = steps.gather(-1, target[:, None]).squeeze(-1)
        best_other = steps.scatter(-1, target[:, None], float("-inf")).max(-1).values
        # Greedy is certain to follow the target: each of its tokens wins by a clear margin.
        assert (chosen - best_other).min() > 1.0, (i, chosen, best_other)
        # And no other sequence can score as well under beam search's mean log-probability
        # (length_penalty 1): one that leaves the target at step k scores at most its prefix
        # plus the best other token there, spread over the longest possible length.
        prefix = torch.cat((torch.zeros(1, dtype=chosen.dtype), chosen.cumsum(0)[:-1]))
        best_deviation = ((prefix + best_other) / max_new_tokens).max()
        assert chosen.mean() > best_deviation + 0.1, (i, chosen.mean(), best_deviation)
    kwargs = {"bos_id": BOS, "eos_id": EOS, "max_new_tokens": max_new_tokens}
    assert decode_greedy_or_sample(model, source, source_mask, greedy=True, **kwargs) == outputs
    assert beam_search(model, source, source_mask, beam_size=3, **kwargs) == outputs


# --------------------------------------------------------------------------- embeddings and loss


@torch.no_grad()
def test_shared_embeddings_tie_source_target_and_head():
    model = tiny_encdec(VOCAB, shared_embeddings=True)
    assert model.src_emb is model.tgt_emb
    assert model.lm_head.weight is model.src_emb.weight
    model.src_emb.weight[5].zero_()
    logits, _ = model(torch.randint(FIRST_WORD, VOCAB, (1, 4)), torch.randint(VOCAB, (1, 3)))
    assert (logits[..., 5] == 0).all()

    separate = tiny_encdec(VOCAB, shared_embeddings=False)
    assert separate.src_emb is not separate.tgt_emb
    assert separate.src_emb.weight is not separate.tgt_emb.weight
    assert separate.lm_head.weight is separate.tgt_emb.weight  # the head is still tied
    assert separate.num_parameters() - model.num_parameters() == VOCAB * 32
    # The source table feeds only the encoder: zeroing its row 5 leaves the head alone.
    source, target_in = torch.randint(FIRST_WORD, VOCAB, (1, 4)), torch.randint(VOCAB, (1, 3))
    before, _ = separate(source, target_in)
    separate.src_emb.weight[5].zero_()
    after, _ = separate(source, target_in)
    assert not (after[..., 5] == 0).all()
    separate.tgt_emb.weight[5].zero_()
    assert (separate(source, target_in)[0][..., 5] == 0).all()
    # Editing the source table changes the encoding of a source that uses token 5 only.
    with_five = torch.tensor([[5, 3, 4]])
    without_five = torch.tensor([[3, 4, 6]])
    fresh = tiny_encdec(VOCAB, shared_embeddings=False)
    memories = [fresh.encode(s) for s in (with_five, without_five)]
    fresh.src_emb.weight[5].mul_(3)
    assert not torch.allclose(fresh.encode(with_five), memories[0])
    torch.testing.assert_close(fresh.encode(without_five), memories[1])


def test_loss_label_smoothing_and_ignored_positions():
    """Target positions that the data pads (with its IGNORE_INDEX) add nothing to the loss."""
    plain = tiny_encdec(VOCAB, label_smoothing=0.0)
    # Smoothing is a training loss: in train mode, without dropout, for the same logits.
    smooth = tiny_encdec(VOCAB, label_smoothing=0.2, dropout=0.0).train()
    smooth.load_state_dict(plain.state_dict())
    source, mask = padded_source(LENGTHS, 9)
    target_in = torch.randint(FIRST_WORD, VOCAB, (3, 6))
    targets = torch.randint(VOCAB, (3, 6))
    targets[0, 4:] = IGNORE_INDEX
    targets[2, :2] = IGNORE_INDEX
    logits, loss = plain(source, target_in, mask, targets=targets)
    smooth_logits, smooth_loss = smooth(source, target_in, mask, targets=targets)
    torch.testing.assert_close(smooth_logits, logits)
    assert plain(source, target_in, mask)[1] is None

    keep = targets != IGNORE_INDEX
    log_probs = logits[keep].log_softmax(-1)
    nll = -log_probs.gather(-1, targets[keep][:, None]).squeeze(-1)
    torch.testing.assert_close(loss, nll.mean())
    by_hand = (0.8 * nll - 0.2 * log_probs.mean(-1)).mean()  # 0.2 of the mass spread uniformly
    torch.testing.assert_close(smooth_loss, by_hand)
    torch.testing.assert_close(
        smooth_loss, F.cross_entropy(logits[keep], targets[keep], label_smoothing=0.2)
    )
    assert abs(smooth_loss.item() - loss.item()) > 1e-3
    # Evaluated, its loss is the likelihood: runs of any smoothing compare.
    torch.testing.assert_close(smooth.eval()(source, target_in, mask, targets=targets)[1], loss)

    # What the ignored positions are fed does not matter to the loss.
    changed_in = target_in.clone()
    changed_in[0, 5] = FIRST_WORD + (target_in[0, 5] - FIRST_WORD + 1) % 10  # predicts ignored
    changed_logits, changed_loss = plain(source, changed_in, mask, targets=targets)
    assert not torch.allclose(changed_logits[0, 5], logits[0, 5])
    torch.testing.assert_close(changed_loss, loss)


# --------------------------------------------------------------------------- config and limits


def test_config_n_embd_not_divisible_by_n_head_names_both():
    with pytest.raises(ValueError) as info:
        EncDecConfig(n_embd=30, attention=AttentionConfig(n_head=4))
    assert "model.n_embd=30" in str(info.value) and "n_head=4" in str(info.value)


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5])
def test_config_label_smoothing_range(value):
    with pytest.raises(
        ValueError, match=rf"model\.label_smoothing must be in \[0, 1\), got {value}"
    ):
        EncDecConfig(label_smoothing=value)
    EncDecConfig(label_smoothing=0.0)
    EncDecConfig(label_smoothing=0.99)


def test_config_unknown_position_lists_valid_ones():
    with pytest.raises(ValueError, match="'absolute'") as info:
        EncDecConfig(position="absolute")
    for position in POSITIONS:
        assert position in str(info.value)


@pytest.mark.parametrize(
    "key", ["n_encoder_layer", "n_decoder_layer", "max_source_len", "max_target_len"]
)
def test_config_rejects_non_positive_sizes(key):
    with pytest.raises(ValueError, match=f"model.{key} must be a positive integer, got 0"):
        EncDecConfig(**{key: 0})


def test_config_from_dict_round_trip_and_unknown_key():
    config = EncDecConfig(vocab_size=10, n_encoder_layer=1, attention={"n_head": 8, "n_kv_head": 2})
    assert isinstance(config.attention, AttentionConfig) and config.attention.kv_heads == 2
    assert EncDecConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"model.n_layer is not an option of EncDecConfig") as info:
        EncDecConfig.from_dict({"n_layer": 2, "n_encoder_layer": 1})
    assert "n_encoder_layer" in str(info.value)  # the known keys are listed


def test_model_needs_vocab_size():
    with pytest.raises(ValueError, match="vocab_size"):
        EncoderDecoder(EncDecConfig())


@pytest.mark.parametrize("position", ["learned", "sinusoidal"])
@torch.no_grad()
def test_sequences_longer_than_the_limits_raise(position):
    model = tiny_encdec(VOCAB, position, max_source_len=8, max_target_len=5)
    model.encode(torch.full((1, 8), FIRST_WORD))
    with pytest.raises(ValueError, match=r"9 tokens .*model\.max_source_len=8"):
        model.encode(torch.full((1, 9), FIRST_WORD))
    with pytest.raises(ValueError, match=r"model\.max_source_len=8"):
        model(torch.full((2, 9), FIRST_WORD), torch.full((2, 3), BOS))
    memory = model.encode(torch.full((1, 4), FIRST_WORD))
    with pytest.raises(ValueError, match=r"6 tokens .*model\.max_target_len=5"):
        model.decode(torch.full((1, 6), FIRST_WORD), memory)
    # Decoding stops at max_target_len tokens, however many are asked for.
    source = torch.full((1, 4), FIRST_WORD)
    kwargs = {"bos_id": BOS, "eos_id": -1, "max_new_tokens": 50}  # no EOS: run to the limit
    assert len(decode_greedy_or_sample(model, source, None, greedy=True, **kwargs)[0]) == 5
    assert len(beam_search(model, source, None, beam_size=2, **kwargs)[0]) == 5


def test_config_cross_position_choices():
    with pytest.raises(ValueError, match="model.cross_position='alibi' is not one of none, rope"):
        EncDecConfig(vocab_size=VOCAB, cross_position="alibi")
    with pytest.raises(ValueError, match="model.cross_position=rope needs an even head dim"):
        EncDecConfig(vocab_size=VOCAB, n_embd=12, cross_position="rope")


@torch.no_grad()
def test_cross_rope_scores_depend_on_target_source_offset_only():
    """Shifting target and source positions together leaves cross-attention scores unchanged;
    with cross_position=none the scores do not depend on positions at all."""
    model = sharpened(tiny_encdec(VOCAB, "none", cross_position="rope"))
    cross = model.decoder[0].cross_attn
    x, memory = torch.randn(1, 1, 32), torch.randn(1, 6, 32)
    at_0 = cross.scores(x, memory, query_offset=0)[0, :, 0]  # (H, S): query at target position 0
    at_2 = cross.scores(x, memory, query_offset=2)[0, :, 0]
    assert not torch.allclose(at_0, at_2, atol=1e-3)
    # A query at position 2 sees source position j as the query at 0 saw j - 2.
    shifted_memory = torch.cat((torch.randn(1, 2, 32), memory[:, :4]), dim=1)
    at_2_shifted = cross.scores(x, shifted_memory, query_offset=2)[0, :, 0]
    torch.testing.assert_close(at_2_shifted[:, 2:], at_0[:, :4], atol=1e-5, rtol=1e-5)
    plain = sharpened(tiny_encdec(VOCAB, "none")).decoder[0].cross_attn
    torch.testing.assert_close(
        plain.scores(x, memory, query_offset=0), plain.scores(x, memory, query_offset=5)
    )
