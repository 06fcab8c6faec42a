"""Decoding speed with and without caches, measured side by side in one run:

- the GPT (6 layers, 6 heads, 384 wide, block 256: nanoGPT's shakespeare_char shape) sampling
  500 new tokens greedily, with the KV cache and without it (every step re-reads the context);
- the encoder-decoder (its default shape) decoding a 96-token source to its 96-token limit,
  with its caches (decoder self-attention KV cache + cross-attention keys/values of the
  memory, computed once) and without them.

    python bench/generate_speed.py [--device cuda] [--repeats 3]

Weights are random: speed does not depend on them. Outputs are checked identical.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.attention import AttentionConfig  # noqa: E402
from model.encdec import EncDecConfig, EncoderDecoder  # noqa: E402
from model.generation import decode_greedy_or_sample, generate  # noqa: E402
from model.gpt import GPT, GPTConfig  # noqa: E402

NEW_TOKENS = 500


def best_time(run, repeats: int, device: torch.device) -> tuple[float, object]:
    """The fastest of `repeats` runs (after one warm-up), and the run's output."""
    output = run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times), output


def gpt_speed(device: torch.device, repeats: int) -> dict[str, float]:
    config = GPTConfig(
        vocab_size=65, block_size=256, n_layer=6, n_embd=384, attention=AttentionConfig(n_head=6)
    )
    model = GPT(config).to(device).eval()
    prompt = torch.zeros((1, 1), dtype=torch.long, device=device)
    seconds, outputs = {}, {}
    for use_cache in (True, False):

        def run(use_cache=use_cache):
            steps = generate(model, prompt, NEW_TOKENS, use_cache=use_cache, greedy=True)
            return torch.stack(list(steps), dim=1)

        seconds[use_cache], outputs[use_cache] = best_time(run, repeats, device)
    same = torch.equal(outputs[True][:, :255], outputs[False][:, :255])
    return {
        "cached": NEW_TOKENS / seconds[True],
        "uncached": NEW_TOKENS / seconds[False],
        "same": same,
    }


def encdec_speed(device: torch.device, repeats: int) -> dict[str, float]:
    config = EncDecConfig(vocab_size=70, max_source_len=96, max_target_len=96, n_embd=128)
    model = EncoderDecoder(config).to(device).eval()
    source = torch.randint(4, 70, (1, 96), device=device)
    seconds, outputs = {}, {}
    for use_cache in (True, False):

        def run(use_cache=use_cache):
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

        seconds[use_cache], outputs[use_cache] = best_time(run, repeats, device)
    tokens = len(outputs[True][0])
    return {
        "cached": tokens / seconds[True],
        "uncached": tokens / seconds[False],
        "same": outputs[True] == outputs[False],
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"device: {device}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| model | cached tokens/s | uncached tokens/s | speed-up | same greedy output |")
    print("|---|---|---|---|---|")
    gpt = gpt_speed(device, args.repeats)
    print(
        f"| GPT 6x384, block 256, {NEW_TOKENS} new tokens | {gpt['cached']:,.0f} | "
        f"{gpt['uncached']:,.0f} | {gpt['cached'] / gpt['uncached']:.1f}x | {gpt['same']} |"
    )
    encdec = encdec_speed(device, args.repeats)
    print(
        f"| encoder-decoder 3+3x128, {encdec['tokens']} new tokens | {encdec['cached']:,.0f} | "
        f"{encdec['uncached']:,.0f} | {encdec['cached'] / encdec['uncached']:.1f}x | "
        f"{encdec['same']} |"
    )


if __name__ == "__main__":
    main()
