"""Decoding: temperature, top-k and top-p (nucleus) sampling or greedy for both models, and
beam search for the encoder-decoder.

Decoding runs in inference mode rather than under no_grad: a decoding step is a few hundred
small operations, and inference mode spares each of them autograd's bookkeeping (version
counters, view tracking). The tensors it returns cannot enter autograd later; nothing here
needs them to."""

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from model.attention import KVCache
from model.encdec import EncoderDecoder
from model.gpt import GPT
from model.layers import split_one_rows


class Tokenizer(Protocol):
    """What decoding and its printouts use of a tokenizer (data/tokenizer.py's two kinds; model/
    may not import data/)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int | None: ...

    @property
    def special_ids(self) -> set[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_with_masks(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


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
        # The most likely token stays even where top_p is below float32's smallest number, so
        # that the comparison above reads it as 0 (top_p=1e-300).
        drop_sorted[..., 0] = False
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
    # Shifted so that the best logits are 0 and stay 0: a temperature too small for float32
    # (1e-40, or 1e-50, which it reads as 0) then leaves 0 for the best and -inf for the rest,
    # where the plain quotient gives inf - inf and 0 / 0, both NaN.
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    scaled = torch.where(shifted == 0, shifted, shifted / temperature)
    probs = torch.softmax(filter_logits(scaled, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# A decoding's choice of the next tokens (B,) from a forward pass's logits (B, T, V)
Pick = Callable[[Tensor], Tensor]


@torch.inference_mode()
def generate(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    static_cache: bool = False,
    compile_step: bool = False,
    tokens_per_replay: int = 1,
    vocab_size: int | None = None,
    **sampling,
) -> Iterator[Tensor]:
    """Yield max_new_tokens new tokens (B,) one step at a time, continuing idx (B, T). Only
    ids below vocab_size (the tokenizer's) are produced, where the model's vocabulary is padded.

    The KV cache makes a step cost one position instead of the whole context. The context is
    the last block_size tokens; when the cache fills up it is rebuilt from the last half block,
    so that the cost of re-reading the context is paid once every block_size/2 tokens.
    static_cache (with use_cache) decodes through StaticDecoding: on a GPU, CUDA graphs of
    tokens_per_replay steps each, whose step compile_step compiles first.
    """
    if static_cache and not use_cache:
        raise ValueError("static_cache=True is a KV cache: it needs use_cache=True")
    if compile_step and not static_cache:
        raise ValueError("compile_step=True compiles StaticDecoding's step: it needs static_cache")
    if max_new_tokens == 0:
        return
    block_size = model.config.block_size

    def pick(logits: Tensor) -> Tensor:
        return next_token(logits[:, -1, :vocab_size], **sampling)

    if not use_cache:
        decoding = UncachedDecoding(model, pick)
    elif static_cache:
        generator = sampling.get("generator")
        decoding = StaticDecoding(model, pick, generator, compile_step, tokens_per_replay)
    else:
        decoding = CachedDecoding(model, pick)
    context = idx[:, -block_size:]
    token = decoding.start(context)
    since_start = []  # the tokens after context, which a restart reads with it
    for step in range(max_new_tokens):
        yield token
        if step == max_new_tokens - 1:
            return  # no forward pass for logits nobody will read
        if use_cache:  # the uncached decoding keeps its own context
            since_start.append(token)
        if decoding.length < block_size:
            token = decoding.step(token)
        else:
            context = torch.cat((context, torch.stack(since_start, dim=1)), dim=1)
            context = context[:, -max(1, block_size // 2) :]  # block_size 1: keep 1, not all
            since_start = []
            token = decoding.start(context)


class UncachedDecoding:
    """Decoding without a cache: each step reads the whole context again, the last block_size
    tokens. start(context (B, T)) and step(token (B,)) return the next tokens (B,), and keep
    the logits (B, T, V) they came from in self.logits."""

    length = 0  # nothing cached: the context never fills a cache

    def __init__(self, model: GPT, pick: Pick):
        self.forward = decoding_step(model, model)
        self.pick = pick
        self.block_size = model.config.block_size
        self.context: Tensor | None = None
        self.logits: Tensor | None = None

    def start(self, context: Tensor) -> Tensor:
        self.context = context
        self.logits = self.forward(context)[0]
        return self.pick(self.logits)

    def step(self, token: Tensor) -> Tensor:
        return self.start(torch.cat((self.context, token[:, None]), dim=1)[:, -self.block_size :])


class CachedDecoding:
    """A GPT's decoding steps with a KVCache per layer: start(context (B, T)) reads a context
    into new caches, step(token (B,)) adds one position; both return the next tokens (B,), and
    keep the logits (B, T, V) they came from in self.logits."""

    def __init__(self, model: GPT, pick: Pick):
        self.model = model
        self.forward = decoding_step(model, model)
        self.pick = pick
        self.cache: list[KVCache] = []
        self.logits: Tensor | None = None

    def start(self, context: Tensor) -> Tensor:
        self.cache = self.model.new_cache()
        self.logits = self.forward(context, cache=self.cache)[0]
        return self.pick(self.logits)

    def step(self, token: Tensor) -> Tensor:
        self.logits = self.forward(token[:, None], cache=self.cache)[0]
        return self.pick(self.logits)

    @property
    def length(self) -> int:
        """The positions the caches hold."""
        return self.cache[0].length if self.cache else 0


class StaticDecoding:
    """CachedDecoding's steps with a StaticKVCache per layer, whose shapes and memory never
    change, run tokens_per_replay steps at a time. On a GPU those runs are captured as CUDA
    graphs and replayed: at batch 1 a step is a hundred-odd small kernels, which take longer to
    launch one by one from Python than to run.

    A run holds whole steps: the forward pass, the choice of the next tokens (`pick`, sampling
    included: a CUDA `generator` is registered with the graphs), writing them where the next
    step reads its input, and advancing the position. So after the first step (which captures
    the graphs) the host launches one replay and one copy of its tokens per tokens_per_replay
    tokens, and waits for the device only where the caller reads a token. The tokens a run
    makes ahead are handed out by the steps that follow; a step given other tokens than the last
    one handed out, or a start(), drops them. Near the end of the block, where tokens_per_replay
    positions no longer fit, runs make one token each. One token a replay is the default: on an
    H200, runs of eight made 0.91x the tokens/s of runs of one, in three paired benchmarks, with
    each token read as it came too (BENCHMARKS.md).

    With compile_step the graphs record the forward pass compiled (torch.compile, static shapes,
    on a GPU only): fewer, fused kernels, for a compilation on the first step (once per process
    and model; Inductor's caches keep it for later processes). On the CPU the runs are plain
    calls (each step slower than CachedDecoding's: it reads all block_size slots), which lets a
    test set them against CachedDecoding's.

    start() runs outside the graphs (its length varies), into the same caches, from position 0:
    slots left from before lie after the queries, where causality hides them. Each instance
    captures its own graphs, on its first step, for the batch size of its first start():
    generate() makes one per call.
    """

    def __init__(
        self,
        model: GPT,
        pick: Pick,
        generator: torch.Generator | None = None,
        compile_step: bool = False,
        tokens_per_replay: int = 1,
    ):
        if tokens_per_replay < 1:
            raise ValueError(f"tokens_per_replay={tokens_per_replay}: make it 1 or more")
        self.forward = decoding_step(model, model)
        device = next(model.parameters()).device
        self.on_gpu = device.type == "cuda"
        self.step_forward = self.forward  # what the runs call, and the graphs record
        if compile_step and self.on_gpu:
            self.step_forward = torch.compile(self.forward, fullgraph=True, dynamic=False)
        self.pick = pick
        self.generator = generator
        self.tokens_per_replay = tokens_per_replay
        self.max_len = model.config.block_size
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.cache = model.new_static_cache(self.position)
        self.length = 0  # the positions handed out, which the host knows without asking
        self.batch: int | None = None  # the caches', set by the first start()
        self.logits: Tensor | None = None
        self.tokens: Tensor | None = None  # a run's input (B, 1), which it leaves for the next
        # per tokens a replay makes: its graph, and the tokens (N, B) and logits (N, B, 1, V)
        # each replay writes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, tuple[Tensor, Tensor]] = {}
        self.ahead: list[tuple[Tensor, Tensor]] = []  # made, not yet handed out: (tokens, logits)
        self.handed_out: Tensor | None = None  # what the last step returned

    def start(self, context: Tensor) -> Tensor:
        self._check_room(context.size(1), from_position=0)
        if self.batch is not None and context.size(0) != self.batch:
            raise ValueError(
                f"a context of {context.size(0)} rows, but this StaticDecoding decodes "
                f"{self.batch} (its caches and graphs are made for them): make a StaticDecoding "
                "per batch size"
            )
        self.batch = context.size(0)
        self.length, self.ahead, self.handed_out = 0, [], None
        self.position.fill_(0)
        self.logits = self.forward(context, cache=self.cache)[0]
        self.position.fill_(context.size(1))
        self.length = context.size(1)
        return self.pick(self.logits)

    def step(self, token: Tensor) -> Tensor:
        """The next tokens (B,) after token (B,): a tensor of their own, which later steps
        leave as they are. self.logits holds their logits (B, 1, V) until the next run."""
        if self.batch is None:
            raise ValueError("a step before any start(): start from a context first")
        self._check_room(1, from_position=self.length)
        if not (self.ahead and token is self.handed_out):
            self._run(token)
        self.handed_out, self.logits = self.ahead.pop(0)
        self.length += 1
        return self.handed_out

    def _run(self, token: Tensor) -> None:
        """Make as many tokens as fit after token (B,), and keep them in self.ahead."""
        if token.shape != (self.batch,):
            raise ValueError(
                f"a step of {tuple(token.shape)} tokens, but this StaticDecoding decodes "
                f"{self.batch} rows: give one token per row, or make a StaticDecoding per batch "
                "size"
            )
        count = self.tokens_per_replay
        if self.length + count > self.max_len:
            count = 1
        if self.tokens is None:
            self.tokens = token[:, None].clone()
            if self.on_gpu:
                self._capture_graphs()
        elif token is not self.handed_out:  # else the last run left it in place
            self.tokens.copy_(token[:, None])
        if self.ahead:  # dropped: the position goes back to the last token handed out
            self.position.fill_(self.length)
        if self.on_gpu:
            self.graphs[count].replay()
            tokens, logits = self.graph_outputs[count]
            made = tokens.clone()  # the next replay overwrites the graph's own
            self.ahead = list(zip(made, logits, strict=True))
        else:
            self.ahead = list(zip(*self._steps(count), strict=True))

    def _steps(self, count: int) -> tuple[Tensor, Tensor]:
        """`count` steps from self.tokens, each leaving its token there and advancing the
        position: their tokens (count, B) and logits (count, B, 1, V)."""
        logits, tokens = [], []
        for _ in range(count):
            logits.append(self.step_forward(self.tokens, cache=self.cache)[0])
            tokens.append(self.pick(logits[-1]))
            self.tokens.copy_(tokens[-1][:, None])
            self.position += 1
        return torch.stack(tokens), torch.stack(logits)

    def _check_room(self, positions: int, from_position: int) -> None:
        """The host knows the length, so an overrun fails here, not as a device-side assert that
        would leave the GPU unusable."""
        if from_position + positions > self.max_len:
            raise ValueError(
                f"the static cache holds {self.max_len} positions (model.block_size), asked for "
                f"{from_position + positions}: start again from a shorter context"
            )

    def _capture_graphs(self) -> None:
        """Capture both runs, of tokens_per_replay tokens and of one, now: capturing makes the
        host wait for the device, which it need not do later. Two warm-up steps first, on a
        side stream as CUDA graphs require, set up the libraries' handles and workspaces (and
        compile the step, with compile_step) outside any capture; they write the position that
        the first replay writes again. Capturing records the steps without running them."""
        with torch.cuda.device(self.position.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.step_forward(self.tokens, cache=self.cache)
            torch.cuda.current_stream().wait_stream(side)
            for count in {self.tokens_per_replay, 1}:
                graph = torch.cuda.CUDAGraph()
                if self.generator is not None:
                    graph.register_generator_state(self.generator)
                with torch.cuda.graph(graph):
                    self.graph_outputs[count] = self._steps(count)
                self.graphs[count] = graph


def decoding_step(model: nn.Module, call: Callable) -> Callable:
    """call (one of model's methods) run as a decoding step. For an fp32 model on the CPU, two
    global settings are made once a step rather than checked by each of its few hundred
    operations:
    - oneDNN off: torch sends GELU, among others, through oneDNN there, at a fixed cost of ~8 µs
      a call that a decoding step's one-token tensors feel (off, cached decoding of nanoGPT's
      6x384 shape ran ~9% faster, and the uncached no slower: BENCHMARKS.md);
    - one-row products split over the threads (split_one_rows: ThreadSplitLinear), but under
      autocast.
    Its callers run in inference mode, so no step needs autograd.
    Other dtypes keep oneDNN (bf16 matmuls need it) and unsplit products. The settings are
    global, so they are made around each step, never across a yield."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return call

    def step(*args, **kwargs):
        enabled = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        # under autocast the products run in bf16, as nn.Linear's path would give them
        blocks = 1 if torch.is_autocast_enabled("cpu") else torch.get_num_threads()
        try:
            with split_one_rows(blocks):
                return call(*args, **kwargs)
        finally:
            torch.backends.mkldnn.enabled = enabled

    return step


def _until_eos(row: list[int], eos_id: int) -> list[int]:
    return row[: row.index(eos_id)] if eos_id in row else row


def decoding_ids(tokenizer: Tokenizer) -> dict:
    """The decoders' bos_id, eos_id and `never` (every other special token) for a tokenizer."""
    eos = tokenizer.eos_id
    never = sorted(set(tokenizer.special_ids) - {eos})
    return {"bos_id": tokenizer.bos_id, "eos_id": eos, "never": never}


def _forbid(logits: Tensor, never: Sequence[int]) -> Tensor:
    """Logits (B, V) with the ids in `never` (padding, BOS, mask) made impossible."""
    if not never:
        return logits
    return logits.index_fill(-1, torch.tensor(list(never), device=logits.device), float("-inf"))


@torch.inference_mode()
def decode_greedy_or_sample(
    model: EncoderDecoder,
    source: Tensor,
    source_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
    never: Sequence[int] = (),
    use_cache: bool = True,
    **sampling,
) -> list[list[int]]:
    """Decode each source (B, S) token by token until EOS; returns the tokens before EOS.

    At most max_target_len tokens are produced: the decoder never saw longer targets. Ids in
    `never` (the special tokens other than EOS) are never produced.
    """
    memory = decoding_step(model, model.encode)(source, source_mask)
    ids = {"bos_id": bos_id, "eos_id": eos_id, "max_new_tokens": max_new_tokens, "never": never}
    return _decode(model, memory, source_mask, **ids, use_cache=use_cache, **sampling)[0]


def _decode(
    model: EncoderDecoder,
    memory: Tensor,
    source_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
    never: Sequence[int] = (),
    use_cache: bool = True,
    **sampling,
) -> tuple[list[list[int]], list[float]]:
    """decode_greedy_or_sample from the encoder's memory (B, S, C): the outputs, and the summed
    log-probability of each one's tokens and of its EOS, if it produced one."""
    max_new_tokens = min(max_new_tokens, model.config.max_target_len)
    batch, device = memory.size(0), memory.device
    tokens = torch.full((batch, 1), bos_id, dtype=torch.long, device=device)
    cache = model.new_cache(memory.size(1), max_new_tokens) if use_cache else None
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    totals = torch.zeros(batch, device=device)
    decode = decoding_step(model, model.decode)
    for _ in range(max_new_tokens):
        step_input = tokens[:, -1:] if use_cache else tokens
        logits = _forbid(decode(step_input, memory, source_mask, cache=cache)[:, -1], never)
        token = next_token(logits, **sampling).masked_fill(finished, eos_id)
        picked = torch.log_softmax(logits.float(), dim=-1).gather(-1, token[:, None])[:, 0]
        totals += picked.masked_fill(finished, 0.0)
        tokens = torch.cat((tokens, token[:, None]), dim=1)
        finished |= token == eos_id
        if finished.all():
            break
    return [_until_eos(row, eos_id) for row in tokens[:, 1:].tolist()], totals.tolist()


@torch.inference_mode()
def beam_search(
    model: EncoderDecoder,
    source: Tensor,
    source_mask: Tensor | None,
    *,
    bos_id: int,
    eos_id: int,
    max_new_tokens: int,
    beam_size: int = 4,
    length_penalty: float = 1.0,
    never: Sequence[int] = (),
) -> list[list[int]]:
    """Keep the beam_size best partial targets per source; return the best finished one.

    A hypothesis's score is its summed log-probability divided by length ** length_penalty,
    where length counts its tokens including EOS (0: raw sum, which favours short outputs;
    1: mean per token). Hypotheses still open after max_new_tokens are scored the same way,
    without EOS. A hypothesis ending in EOS is finished when it ranks among the step's top
    beam_size; a source is done once it has beam_size finished hypotheses. That early stop can
    settle for a shorter output than greedy would, so the greedy decode competes too: the
    returned score is never below greedy's under the same length penalty. With beam_size=1
    this is exactly greedy decoding. Ids in `never` (the special tokens other than EOS) are
    never produced.
    """
    max_new_tokens = min(max_new_tokens, model.config.max_target_len)
    batch, width = source.size(0), beam_size
    rows = torch.arange(batch, device=source.device).repeat_interleave(width)
    encoded = decoding_step(model, model.encode)(source, source_mask)
    memory = encoded[rows]
    mask = source_mask[rows] if source_mask is not None else None
    cache = model.new_cache(source.size(1), max_new_tokens)
    tokens = torch.full((batch * width, 1), bos_id, dtype=torch.long, device=source.device)
    scores = torch.full((batch, width), float("-inf"), device=source.device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    done = [False] * batch

    decode = decoding_step(model, model.decode)
    for step in range(max_new_tokens):
        logits = _forbid(decode(tokens[:, -1:], memory, mask, cache=cache)[:, -1], never)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        vocab = log_probs.size(-1)
        total = (scores[..., None] + log_probs.view(batch, width, vocab)).view(batch, -1)
        top_scores, top_index = total.topk(2 * width, dim=-1)
        next_scores = torch.full_like(scores, float("-inf"))
        next_beams = torch.zeros_like(scores, dtype=torch.long)
        next_tokens = torch.full_like(scores, eos_id, dtype=torch.long)
        for b in range(batch):
            if done[b]:
                continue
            alive = 0
            for rank, (score, index) in enumerate(
                zip(top_scores[b].tolist(), top_index[b].tolist(), strict=True)
            ):
                beam, token = divmod(index, vocab)
                if score == float("-inf") or alive == width:
                    break
                if token == eos_id:
                    if rank < width:
                        hypothesis = tokens[b * width + beam, 1:].tolist()
                        finished[b].append((score / (step + 1) ** length_penalty, hypothesis))
                    continue
                next_scores[b, alive], next_beams[b, alive], next_tokens[b, alive] = (
                    score,
                    beam,
                    token,
                )
                alive += 1
            done[b] = len(finished[b]) >= width or alive == 0
        if all(done):
            break
        index = (torch.arange(batch, device=source.device)[:, None] * width + next_beams).flatten()
        tokens = torch.cat((tokens[index], next_tokens.flatten()[:, None]), dim=1)
        cache.reorder(index)
        scores = next_scores

    length = max(tokens.size(1) - 1, 1)  # max_new_tokens=0: one empty hypothesis, no 0/0
    for b in range(batch):
        if not done[b]:  # out of steps: the surviving hypotheses compete as they are
            for k in range(width):
                if scores[b, k] > float("-inf"):
                    hypothesis = tokens[b * width + k, 1:].tolist()
                    finished[b].append((scores[b, k].item() / length**length_penalty, hypothesis))
    if width > 1:  # the greedy decode competes (with beam_size 1 it is the beam)
        ids = {"bos_id": bos_id, "eos_id": eos_id, "max_new_tokens": max_new_tokens, "never": never}
        greedy, totals = _decode(model, encoded, source_mask, **ids, greedy=True)
        for b, (hypothesis, total) in enumerate(zip(greedy, totals, strict=True)):
            length = len(hypothesis) + 1 if len(hypothesis) < max_new_tokens else len(hypothesis)
            finished[b].append((total / max(length, 1) ** length_penalty, hypothesis))
    return [max(hypotheses, key=lambda h: h[0])[1] for hypotheses in finished]
