"""Tests of beam search (model/generation.py) against greedy decoding and exhaustive search."""

import itertools
from contextlib import contextmanager

import pytest
import torch

from helpers import BOS, EOS, FIRST_WORD, PAD, sharpened, tiny_encdec
from model.encdec import DecoderCache, EncoderDecoder
from model.generation import beam_search, decode_greedy_or_sample


@torch.no_grad()
def random_model(
    seed: int, vocab: int = 9, position: str = "learned", sharpness: float = 5.0
) -> EncoderDecoder:
    """A tiny untrained model whose weight matrices are scaled by `sharpness`, so that its
    next-token distributions are peaky, EOS comes up at varied lengths and outputs depend on
    the source."""
    torch.manual_seed(seed)
    model = tiny_encdec(
        vocab,
        position,
        n_head=2,
        n_embd=16,
        n_encoder_layer=1,
        n_decoder_layer=1,
        max_source_len=12,
        max_target_len=12,
    )
    sharpened(model, sharpness)
    for block in model.decoder:  # let the source weigh more against the decoder's own state
        block.cross_attn.out_proj.weight.mul_(3.0)
    return model


def padded_sources(seed: int, vocab: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    source = torch.randint(FIRST_WORD, vocab, (len(lengths), width), generator=generator)
    return source.masked_fill(~mask, PAD), mask


@torch.no_grad()
def sequence_log_probs(model, source, source_mask, sequences, finished):
    """Summed log-probability and length of each sequence for one source (1, S), by teacher
    forcing, with EOS appended where `finished`. Length counts the tokens scored, EOS included."""
    rows = [
        [*seq, EOS] if done else list(seq) for seq, done in zip(sequences, finished, strict=True)
    ]
    width = max(1, max(len(row) for row in rows))
    target_in = torch.full((len(rows), width), PAD)
    targets = torch.full((len(rows), width), -100)
    for i, row in enumerate(rows):
        target_in[i, : len(row)] = torch.tensor([BOS, *row[:-1]], dtype=torch.long)
        targets[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    batch = len(rows)
    mask = None if source_mask is None else source_mask.expand(batch, -1)
    logits, _ = model(source.expand(batch, -1), target_in, mask)
    log_probs = logits.double().log_softmax(-1)
    picked = log_probs.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    keep = targets != -100
    return (picked * keep).sum(-1), keep.sum(-1)


def normalised_scores(model, source, source_mask, sequences, max_new_tokens, length_penalty):
    """The beam search score: sum log p / length ** length_penalty. A sequence shorter than
    max_new_tokens ended with EOS; one of max_new_tokens tokens was cut off, without EOS."""
    finished = [len(seq) < max_new_tokens for seq in sequences]
    total, length = sequence_log_probs(model, source, source_mask, sequences, finished)
    return total / length.double() ** length_penalty


def decode_kwargs(max_new_tokens):
    return {"bos_id": BOS, "eos_id": EOS, "max_new_tokens": max_new_tokens}


@contextmanager
def logit_bias(model: EncoderDecoder, bias: dict[int, float]):
    """Add bias[token] to the model's every logit of token: in teacher forcing and in cached
    decoding alike, as the hook sees the head's output only."""

    def hook(module, args, logits):
        logits = logits.clone()
        for token, value in bias.items():
            logits[..., token] += value
        return logits

    handle = model.lm_head.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


# --------------------------------------------------------------------------- against greedy


def test_beam_size_one_is_greedy():
    lengths = [7, 3, 5, 2, 6]
    outputs = []
    for seed, position in zip(range(8), ["learned", "rope", "alibi", "none"] * 2, strict=True):
        model = random_model(seed, position=position, sharpness=3.0 + seed)
        source, mask = padded_sources(seed, 9, lengths)
        greedy = decode_greedy_or_sample(model, source, mask, greedy=True, **decode_kwargs(8))
        beam = beam_search(model, source, mask, beam_size=1, **decode_kwargs(8))
        assert beam == greedy, (seed, position)
        outputs += greedy
    # Not vacuous: some outputs stopped at EOS, some ran to max_new_tokens, and they vary.
    assert any(len(out) < 8 for out in outputs) and any(len(out) == 8 for out in outputs)
    assert len({tuple(out) for out in outputs}) > 5


def test_wider_beam_never_scores_below_greedy_and_often_above():
    """The early stop (a source is done once beam_size hypotheses have finished) can drop
    unfinished beams that are better, length-normalised; the greedy decode competing with the
    beam is what keeps the promise in every case, not on aggregate."""
    max_new_tokens = 8
    better = cases = 0
    for seed in range(10):
        model = random_model(seed, sharpness=(1.0, 5.0, 10.0)[seed % 3])
        source, mask = padded_sources(seed, 9, [7, 4, 6, 2])
        kwargs = decode_kwargs(max_new_tokens)
        greedy = decode_greedy_or_sample(model, source, mask, greedy=True, **kwargs)
        for length_penalty in (0.0, 1.0, 2.0):
            beam = beam_search(
                model, source, mask, beam_size=4, length_penalty=length_penalty, **kwargs
            )
            for i in range(source.size(0)):
                greedy_score, beam_score = normalised_scores(
                    model,
                    source[i : i + 1],
                    mask[i : i + 1],
                    [greedy[i], beam[i]],
                    max_new_tokens,
                    length_penalty,
                ).tolist()
                cases += 1
                assert beam_score >= greedy_score - 1e-6, (seed, i, length_penalty)
                better += beam_score > greedy_score + 1e-6
    assert better >= 0.3 * cases


@torch.no_grad()
def reference_beam_search(model, source, source_mask, beam_size, max_new_tokens, length_penalty):
    """The rule of beam_search's docstring, for one source (1, S), written plainly: no batch, no
    cache, every step a full teacher-forced decode of the live beams."""
    greedy = decode_greedy_or_sample(
        model, source, source_mask, greedy=True, **decode_kwargs(max_new_tokens)
    )[0]
    greedy_score = normalised_scores(
        model, source, source_mask, [greedy], max_new_tokens, length_penalty
    ).item()
    greedy_floor = [(greedy_score, greedy)] if beam_size > 1 else []
    beams = [(0.0, [])]  # (summed log-probability, tokens after BOS)
    finished = []
    for step in range(max_new_tokens):
        target_in = torch.tensor([[BOS, *tokens] for _, tokens in beams])
        mask = None if source_mask is None else source_mask.expand(len(beams), -1)
        logits, _ = model(source.expand(len(beams), -1), target_in, mask)
        log_probs = logits[:, -1].double().log_softmax(-1)
        candidates = sorted(
            (
                (total + log_probs[i, token].item(), tokens, token)
                for i, (total, tokens) in enumerate(beams)
                for token in range(log_probs.size(-1))
            ),
            key=lambda c: -c[0],
        )
        beams = []
        for rank, (total, tokens, token) in enumerate(candidates):
            if len(beams) == beam_size:
                break
            if token != EOS:
                beams.append((total, [*tokens, token]))
            elif rank < beam_size:  # EOS among the step's top beam_size: finished
                finished.append((total / (step + 1) ** length_penalty, tokens))
        if len(finished) >= beam_size or not beams:
            return max(finished + greedy_floor, key=lambda f: f[0])[1]
    cut_off = [(total / max_new_tokens**length_penalty, tokens) for total, tokens in beams]
    return max(finished + cut_off + greedy_floor, key=lambda f: f[0])[1]


@pytest.mark.parametrize("beam_size, length_penalty", [(2, 1.0), (3, 0.0), (4, 0.6), (5, 2.0)])
def test_beam_search_follows_its_documented_rule(beam_size, length_penalty):
    outputs = []
    for seed, eos_bias in zip(range(4), (-1.0, 0.0, 1.0, 2.0), strict=True):
        model = random_model(seed, sharpness=(2.0, 5.0, 9.0, 5.0)[seed])
        source, mask = padded_sources(seed, 9, [6, 3, 5])
        with logit_bias(model, {EOS: eos_bias}):  # hypotheses finish at many different steps
            found = beam_search(
                model,
                source,
                mask,
                beam_size=beam_size,
                length_penalty=length_penalty,
                **decode_kwargs(6),
            )
            for i in range(source.size(0)):
                expected = reference_beam_search(
                    model, source[i : i + 1], mask[i : i + 1], beam_size, 6, length_penalty
                )
                assert found[i] == expected, (seed, i)
        outputs += found
    assert any(len(out) < 6 for out in outputs) and any(len(out) == 6 for out in outputs)


# Vocabulary of 5 with 3 new tokens: EOS excluded, 4 tokens can follow (PAD and BOS too, the
# decoders do not forbid them), so there are 1 + 4 + 16 finished and 64 cut-off sequences.
EXHAUSTIVE_VOCAB, EXHAUSTIVE_STEPS = 5, 3
# Per seed an EOS logit bias, so that the winners range from [] to cut-off length-3 sequences.
EXHAUSTIVE_CASES = list(zip(range(4), (-1.0, 0.5, 2.0, 3.5), strict=True))


def all_sequences() -> list[list[int]]:
    others = [t for t in range(EXHAUSTIVE_VOCAB) if t != EOS]
    return [
        list(seq)
        for n in range(EXHAUSTIVE_STEPS + 1)
        for seq in itertools.product(others, repeat=n)
    ]


@pytest.mark.parametrize("length_penalty", [0.0, 0.5, 1.0, 2.0])
def test_large_beam_finds_the_best_sequence_exhaustively(length_penalty):
    candidates = all_sequences()
    assert len(candidates) == 85
    winners = []
    for seed, eos_bias in EXHAUSTIVE_CASES:
        model = random_model(seed, vocab=EXHAUSTIVE_VOCAB, sharpness=6.0)
        source, mask = padded_sources(seed, EXHAUSTIVE_VOCAB, [5, 3])
        with logit_bias(model, {EOS: eos_bias}):
            found = beam_search(
                model,
                source,
                mask,
                beam_size=len(candidates),
                length_penalty=length_penalty,
                **decode_kwargs(EXHAUSTIVE_STEPS),
            )
            for i in range(source.size(0)):
                scores = normalised_scores(
                    model,
                    source[i : i + 1],
                    mask[i : i + 1],
                    candidates,
                    EXHAUSTIVE_STEPS,
                    length_penalty,
                )
                best, runner_up = scores.argsort(descending=True)[:2].tolist()
                found_score = scores[candidates.index(found[i])].item()
                assert found_score >= scores[best].item() - 1e-5, (seed, i, found[i])
                if scores[best] - scores[runner_up] > 1e-4:  # no near tie: the same sequence
                    assert found[i] == candidates[best], (seed, i)
                winners.append(candidates[best])
    # Not vacuous: the winners differ (in length too) from case to case.
    assert len({len(w) for w in winners}) > 1


@torch.no_grad()
def test_length_penalty_moves_the_exhaustive_winner_to_longer_outputs():
    # Raw sums (0) favour short outputs; normalising by length ** 2 favours long ones.
    total_length = {}
    for length_penalty in (0.0, 2.0):
        total_length[length_penalty] = 0
        for seed, eos_bias in EXHAUSTIVE_CASES:
            model = random_model(seed, vocab=EXHAUSTIVE_VOCAB, sharpness=6.0)
            source, mask = padded_sources(seed, EXHAUSTIVE_VOCAB, [5, 3])
            with logit_bias(model, {EOS: eos_bias}):
                found = beam_search(
                    model,
                    source,
                    mask,
                    beam_size=85,
                    length_penalty=length_penalty,
                    **decode_kwargs(EXHAUSTIVE_STEPS),
                )
            total_length[length_penalty] += sum(len(out) for out in found)
    assert total_length[2.0] > total_length[0.0] + 4


# --------------------------------------------------------------------------- batching and limits


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
@pytest.mark.parametrize("beam_size", [1, 3])
def test_batch_decoding_equals_decoding_each_source_alone(position, beam_size):
    lengths = [6, 2, 4, 3]
    for seed in range(2):
        model = random_model(seed, position=position)
        source, mask = padded_sources(seed, 9, lengths)
        kwargs = {"beam_size": beam_size, **decode_kwargs(7)}
        batched = beam_search(model, source, mask, **kwargs)
        alone = [
            beam_search(model, source[i : i + 1, :n], None, **kwargs)[0]
            for i, n in enumerate(lengths)
        ]
        padded_alone = [
            beam_search(model, source[i : i + 1], mask[i : i + 1], **kwargs)[0]
            for i in range(len(lengths))
        ]
        assert batched == alone == padded_alone
        assert len({tuple(out) for out in batched}) > 1  # the sources are decoded differently


@torch.no_grad()
def test_max_new_tokens_is_respected_and_outputs_hold_no_specials():
    model = random_model(3, position="rope", sharpness=4.0)
    source, mask = padded_sources(0, 9, [6, 2, 5, 4, 3, 6])
    lengths = []
    # A model that never predicts BOS (a BOS in an output could only be the start token
    # leaking through), and ends often enough for EOS to be exercised.
    with logit_bias(model, {BOS: float("-inf"), EOS: 0.5}):
        for max_new_tokens in (0, 1, 3, 6, 40):
            limit = min(max_new_tokens, model.config.max_target_len)
            kwargs = decode_kwargs(max_new_tokens)
            runs = [decode_greedy_or_sample(model, source, mask, greedy=True, **kwargs)]
            for beam_size, length_penalty in ((1, 1.0), (3, 1.0), (3, 0.0), (5, 2.0)):
                runs.append(
                    beam_search(
                        model,
                        source,
                        mask,
                        beam_size=beam_size,
                        length_penalty=length_penalty,
                        **kwargs,
                    )
                )
            for outputs in runs:
                assert len(outputs) == source.size(0)
                for out in outputs:
                    assert len(out) <= limit
                    assert EOS not in out and BOS not in out
                    lengths.append(len(out))
    assert 0 in lengths and 12 in lengths  # both limits were reached...
    assert any(0 < n < 6 for n in lengths)  # ...and EOS ended some outputs in between


# --------------------------------------------------------------------------- the cache


@torch.no_grad()
def test_decoder_cache_reorder_selects_rows():
    model = random_model(0, position="rope")
    source, mask = padded_sources(0, 9, [5, 3, 4])
    memory = model.encode(source, mask)
    target_in = torch.randint(FIRST_WORD, 9, (3, 5))
    cache = model.new_cache(source.size(1))
    assert isinstance(cache, DecoderCache)
    model.decode(target_in[:, :4], memory, mask, cache=cache)
    before = [(c.keys.clone(), c.values.clone()) for c in (*cache.self_attn, *cache.cross_attn)]

    index = torch.tensor([2, 0, 0, 1])  # rows may repeat and the batch may grow (beams)
    cache.reorder(index)
    after = [(c.keys, c.values) for c in (*cache.self_attn, *cache.cross_attn)]
    for (keys, values), (new_keys, new_values) in zip(before, after, strict=True):
        torch.testing.assert_close(new_keys, keys[index], atol=0, rtol=0)
        torch.testing.assert_close(new_values, values[index], atol=0, rtol=0)
    assert cache.length == 4

    # Decoding on from the reordered cache equals decoding the reordered rows from scratch.
    stepped = model.decode(target_in[index, 4:], memory[index], mask[index], cache=cache)
    full = model.decode(target_in[index], memory[index], mask[index])
    torch.testing.assert_close(stepped[:, 0], full[:, 4], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("decoder", ["greedy", "beam"])
def test_fp32_decoding_runs_without_onednn_and_leaves_the_flag_as_it_was(decoder):
    # as for the GPT (test_generation.py): the encoder and each decoding step, never between
    model = random_model(0)
    seen = []
    for method in ("encode", "decode"):
        call = getattr(model, method)

        def spy(*args, call=call, **kwargs):
            seen.append(torch.backends.mkldnn.enabled)
            return call(*args, **kwargs)

        setattr(model, method, spy)
    source, mask = padded_sources(0, 9, [5, 3])
    if decoder == "greedy":
        decode_greedy_or_sample(model, source, mask, greedy=True, **decode_kwargs(6))
    else:
        beam_search(model, source, mask, beam_size=2, **decode_kwargs(6))
    assert seen and not any(seen)
    assert torch.backends.mkldnn.enabled
