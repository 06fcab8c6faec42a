"""Decoding speed with and without caches, measured side by side in one run:

- the GPT (6 layers, 6 heads, 384 wide, block 256: nanoGPT's shakespeare_char shape) sampling
  500 new tokens greedily, with the KV cache and without it (every step re-reads the context);
- the encoder-decoder (its default shape) decoding a 96-token source to its 96-token limit,
  with its caches (decoder self-attention KV cache + cross-attention keys/values of the
  memory, computed once) and without them.

    python bench/generate_speed.py [--device cuda] [--repeats 5] \
        [--cuda-graph [--compile-step] [--tokens-per-replay 1] [--versus-tokens-per-replay 8]] \
        [--read-each-token]

With --cuda-graph the GPT's cached side decodes through StaticDecoding (model/generation.py):
on a GPU its steps are replays of CUDA graphs, each making --tokens-per-replay tokens (on the
CPU the same steps run one by one without a graph, each reading the whole block_size-long
cache); with --compile-step too (on a GPU), the graphs record the step's forward pass
compiled (the warm-up run compiles it). Each run makes its own StaticDecoding, so its time
includes the capture. --versus-tokens-per-replay adds a third side, the same graphs making that
many tokens a replay: its row gives the speed-up of --tokens-per-replay's graphs over it.
--read-each-token reads each GPT token on the host as it comes, as generate.py does to print
it (the host then waits for the device once a token, or once a replay); without it a run reads
its tokens at the end.

The sides run alternately, a cached run, an uncached one (and the third side), `--repeats`
rounds after a warm-up of each; a row gives two sides' median tokens/s and the median (min-max)
of the per-round speed-ups. Weights are random: speed does not depend on them. Outputs are
checked identical.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.attention import AttentionConfig  # noqa: E402
from model.encdec import EncDecConfig, EncoderDecoder  # noqa: E402
from model.generation import decode_greedy_or_sample, generate  # noqa: E402
from model.gpt import GPT, GPTConfig  # noqa: E402

NEW_TOKENS = 500


def timed(device: torch.device, run: Callable[[], object]) -> tuple[float, object]:
    """Seconds run() takes, and its output."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    output = run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, output


def alternating(runs: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict:
    """Each run once as a warm-up, then `repeats` rounds of every run one after the other, so
    that all sides see the same machine: each side's seconds per round and its last output."""
    seconds = {side: [] for side in runs}
    outputs = {side: run() for side, run in runs.items()}
    for _ in range(repeats):
        for side, run in runs.items():
            elapsed, outputs[side] = timed(device, run)
            seconds[side].append(elapsed)
    return {"seconds": seconds, "outputs": outputs}


def speedups(seconds: dict[str, list[float]], faster: str, slower: str) -> list[float]:
    """Per round: the `slower` side's seconds over the `faster` side's."""
    return [s / f for f, s in zip(seconds[faster], seconds[slower], strict=True)]


def gpt_speed(
    device: torch.device,
    repeats: int,
    cuda_graph: bool,
    compile_step: bool,
    per_replay: int,
    versus: int | None = None,
    read_each_token: bool = False,
) -> tuple[dict, int, bool]:
    """The rounds' figures ("cached", "uncached", and "versus": cached at `versus` tokens a
    replay, when given), the tokens a run makes, and whether all sides agree (on the first 255
    tokens: past the block the uncached side slides its context one token at a time, while the
    cached side restarts from the last half block)."""
    config = GPTConfig(
        vocab_size=65, block_size=256, n_layer=6, n_embd=384, attention=AttentionConfig(n_head=6)
    )
    model = GPT(config).to(device).eval()
    prompt = torch.zeros((1, 1), dtype=torch.long, device=device)

    def run(use_cache: bool, tokens_per_replay: int = per_replay) -> Tensor:
        static_cache = use_cache and cuda_graph
        steps = generate(
            model,
            prompt,
            NEW_TOKENS,
            use_cache=use_cache,
            static_cache=static_cache,
            compile_step=static_cache and compile_step,
            tokens_per_replay=tokens_per_replay,
            greedy=True,
        )
        if read_each_token:
            return torch.tensor([step.tolist() for step in steps]).T
        return torch.stack(list(steps), dim=1)

    runs = {"cached": lambda: run(True), "uncached": lambda: run(False)}
    if versus is not None:
        runs["versus"] = lambda: run(True, versus)
    rounds = alternating(runs, repeats, device)
    first = [output[:, :255] for output in rounds["outputs"].values()]
    return rounds, NEW_TOKENS, all(torch.equal(first[0], other) for other in first[1:])


def encdec_speed(device: torch.device, repeats: int) -> tuple[dict, int, bool]:
    config = EncDecConfig(vocab_size=70, max_source_len=96, max_target_len=96, n_embd=128)
    model = EncoderDecoder(config).to(device).eval()
    source = torch.randint(4, 70, (1, 96), device=device)

    def run(use_cache: bool) -> list[list[int]]:
        # eos_id outside the vocabulary: every run decodes the full 96 tokens
        return decode_greedy_or_sample(
            model,
            source,
            None,
            bos_id=1,
            eos_id=10**6,
            max_new_tokens=96,
            use_cache=use_cache,
            greedy=True,
        )

    rounds = alternating(
        {"cached": lambda: run(True), "uncached": lambda: run(False)}, repeats, device
    )
    outputs = rounds["outputs"]
    return rounds, len(outputs["cached"][0]), outputs["cached"] == outputs["uncached"]


def row(name: str, measured: tuple[dict, int, bool], faster: str, slower: str) -> str:
    """A table row: the two sides' median tokens/s, and the median (min-max) of the per-round
    speed-ups of `faster` over `slower`."""
    rounds, tokens, same = measured
    rate = {side: tokens / statistics.median(rounds["seconds"][side]) for side in (faster, slower)}
    ratios = speedups(rounds["seconds"], faster, slower)
    return (
        f"| {name} | {rate[faster]:,.0f} | {rate[slower]:,.0f} | "
        f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {same} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per model")
    parser.add_argument(
        "--cuda-graph", action="store_true", help="the GPT's cached side replays a CUDA graph"
    )
    parser.add_argument(
        "--compile-step", action="store_true", help="with --cuda-graph: the graphs' step compiled"
    )
    parser.add_argument(
        "--tokens-per-replay", type=int, default=1, help="with --cuda-graph: tokens a graph makes"
    )
    parser.add_argument(
        "--versus-tokens-per-replay",
        type=int,
        help="with --cuda-graph: a third side, the graphs making this many tokens a replay",
    )
    parser.add_argument(
        "--read-each-token",
        action="store_true",
        help="the GPT's tokens read on the host as they come, as generate.py prints them",
    )
    args = parser.parse_args()
    if args.compile_step and (not args.cuda_graph or args.device == "cpu"):
        parser.error("--compile-step compiles the CUDA graphs' step: add --cuda-graph on a GPU")
    versus = args.versus_tokens_per_replay
    if versus is not None and not args.cuda_graph:
        parser.error("--versus-tokens-per-replay is a third side, of graphs: add --cuda-graph")
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print(
        "| model | tokens/s, first side | tokens/s, second side | speed-up of the first, median "
        "(min-max) | same greedy output |"
    )
    print("|---|---|---|---|---|")
    per_replay = args.tokens_per_replay
    gpt = gpt_speed(
        device, args.repeats, args.cuda_graph, args.compile_step, per_replay, versus,
        args.read_each_token,
    )  # fmt: skip
    graph = ""
    if args.cuda_graph:
        graph = f", cached side: StaticDecoding, {per_replay} tokens a replay"
        graph += ", compiled" if args.compile_step else ""
    name = f"GPT 6x384, block 256, {NEW_TOKENS} new tokens"
    name += ", each read as it comes" if args.read_each_token else ""
    print(row(f"{name}: cached / uncached{graph}", gpt, "cached", "uncached"))
    if versus is not None:
        compiled = ", compiled" if args.compile_step else ""
        sides = f"StaticDecoding, {per_replay} / {versus} tokens a replay{compiled}"
        print(row(f"{name}: {sides}", gpt, "cached", "versus"))
    encdec = encdec_speed(device, args.repeats)
    print(
        row(
            f"encoder-decoder 3+3x128, {encdec[1]} new tokens: cached / uncached",
            encdec,
            "cached",
            "uncached",
        )
    )


if __name__ == "__main__":
    main()
