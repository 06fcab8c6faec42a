"""The GPU kernels of one static-cache decoding step (what StaticDecoding captures as a CUDA
graph), eager and compiled: how many a step launches, their device time a step, and the kernels
that take the most, from torch.profiler.

    python bench/decode_kernels.py [--root CHECKOUT]

The GPT is generate_speed.py's (nanoGPT's 6 x 384 shape, block 256, random weights, fp32) at
batch 1, its cache holding 100 positions; each side runs 3 steps as a warm-up (compiling the
compiled one), then 10 under the profiler. `--root` profiles another checkout's model (say an
older commit: `git worktree add /tmp/old <commit>`). Needs a GPU.
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

STEPS = 10
CONTEXT = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the kernels profiled are a GPU's: run it on a machine with CUDA")
    sys.path.insert(0, str(args.root.resolve()))
    from model.attention import AttentionConfig
    from model.gpt import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=65, block_size=256, n_layer=6, n_embd=384, attention=AttentionConfig(n_head=6)
    )
    model = GPT(config).cuda().eval()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False)
    print(f"model code: {args.root}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    with torch.inference_mode():
        for name, forward in (("eager", model.forward), ("compiled", compiled)):
            position = torch.zeros((), dtype=torch.long, device="cuda")
            cache = model.new_static_cache(position)
            model(torch.zeros((1, CONTEXT), dtype=torch.long, device="cuda"), cache=cache)
            position.fill_(CONTEXT)
            token = torch.zeros((1, 1), dtype=torch.long, device="cuda")
            for _ in range(3):
                forward(token, cache=cache)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as profiled:
                for _ in range(STEPS):
                    forward(token, cache=cache)
                torch.cuda.synchronize()
            kernels = [
                event
                for event in profiled.events()
                if event.device_type == torch.autograd.DeviceType.CUDA
            ]
            device_us = sum(event.device_time for event in kernels) / STEPS
            print(
                f"== {name}: {len(kernels) / STEPS:.0f} kernels a step, "
                f"{device_us:.1f} us of kernel time a step"
            )
            print(
                profiled.key_averages().table(
                    sort_by="device_time_total", row_limit=14, max_name_column_width=70
                )
            )


if __name__ == "__main__":
    main()
