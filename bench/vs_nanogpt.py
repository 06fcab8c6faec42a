"""tinyformer against nanoGPT on nanoGPT's own recipes, side by side on this machine: the same
text and split, the same model shape and optimiser, runs alternated (nanoGPT, ours, nanoGPT,
ours, ...) so that both sides see the same machine.

    python bench/vs_nanogpt.py --nanogpt ../shared/anchors/nanoGPT [--recipe cpu|gpu]
        [--device cpu|cuda] [--pairs 3] [--steps N] [--ours 'compile=true ...']
        [--own 'experiment=cpu_fast'] [--variant 'compile_mode=default'] [--target-loss 1.65]

--ours adds overrides to our side of nanoGPT's recipe; --own runs our own recipe instead (only
the data is nanoGPT's), against nanoGPT's recipe: which reaches the lower loss in what time.
--variant V adds a third side to every pair, after ours: ours with V added as well, so that two
configurations of ours (say torch.compile's default mode against CUDA graphs) are measured in
the same pairs, each against nanoGPT and the variant against ours.

nanoGPT runs from a scratch copy (its data prepared there by its own prepare.py from
`--text`/input.txt); tinyformer trains on `--text`/train.txt and val.txt, which are nanoGPT's
90/10 split (`data.paths` + `data.val_paths`), with W&B offline and the attention maps of the
trained model (at the end) logged. Pair i runs seed 1337 + i on both sides. Per run:
whole-process wall seconds, steady tokens/s (median of the logged steps), seconds from launch
to the end of the first optimizer step, each side's own best validation figure, and the loss of
its best checkpoint on the whole validation text, computed the same way for both (every
non-overlapping block). Then medians over the pairs and the ratios ours / nanoGPT.

--target-loss L adds the seconds from launch to the end of each side's first validation at or
below L, on its own estimate ("never" if none is), and our time to L against nanoGPT's whole
wall: "reaches L within nanoGPT's wall time".
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.tokenizer import tokenizer_from_dict  # noqa: E402
from model.checkpoint import find_checkpoint, load_checkpoint  # noqa: E402
from training.precision import cpu_capabilities, fast_precision  # noqa: E402

# nanoGPT's README recipes, as its command-line flags (on top of its shakespeare_char config)
# and as ours. Both: AdamW (weight decay 0.1 on matrices), beta2 0.99, warm-up 100, cosine to
# lr/10, gradient clipping at 1, tied embeddings, learned positions, no biases, GELU MLP, one
# dropout rate on embeddings, attention weights and residual branches.
RECIPES = {
    "cpu": {
        "shape": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 12},
        "steps": 2000,
        "dropout": 0.0,
        "eval_iters": 20,
        "nanogpt": ["--device=cpu", "--compile=False"],
        # bf16 matmuls where the CPU has bf16 units (AMX, AVX512-BF16), else fp32 as nanoGPT:
        # its --dtype applies to CUDA only, so on a CPU it trains in fp32.
        "ours": [f"trainer.precision={fast_precision('cpu')}"],
    },
    "gpu": {
        "shape": {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "batch_size": 64},
        "steps": 5000,
        "dropout": 0.2,
        "eval_iters": 200,
        "nanogpt": ["--device=cuda", "--compile=True", "--dtype=bfloat16"],
        "ours": ["trainer=gpu", "compile=true"],
    },
}


# nanoGPT's shakespeare_char config evaluates (and saves its checkpoint) every 250 steps, and
# at the last step only where 250 divides it; ours validates its last step whatever the
# interval. So --steps is below 250 (both sides evaluate at the last step only) or a multiple
# of it, and both sides evaluate at the same steps.
EVAL_INTERVAL = 250


def eval_interval(steps: int) -> int:
    return min(EVAL_INTERVAL, steps)


# nanoGPT seeds torch with 1337 (+ the rank) in its train.py, a value no flag sets. Its
# configurator runs any config file it is given inside train.py, before that call: this one
# shifts the seed, so that both sides can run the same seeds.
SEED_SHIFT = """
import torch as _torch
_manual_seed = _torch.manual_seed
_torch.manual_seed = lambda seed: _manual_seed(seed + {shift})
"""


def nanogpt_command(recipe: dict, steps: int, out_dir: Path, seed: int = 1337) -> list[str]:
    shape = recipe["shape"]
    seed_config = []
    if seed != 1337:
        shift = out_dir.parent / f"seed_shift_{seed}.py"
        shift.write_text(SEED_SHIFT.format(shift=seed - 1337))
        seed_config = [str(shift)]
    return [
        sys.executable,
        "train.py",
        "config/train_shakespeare_char.py",
        *seed_config,
        *recipe["nanogpt"],
        *(f"--{key}={value}" for key, value in shape.items()),
        f"--max_iters={steps}",
        f"--lr_decay_iters={steps}",
        f"--dropout={recipe['dropout']}",
        f"--eval_iters={recipe['eval_iters']}",
        f"--eval_interval={eval_interval(steps)}",
        "--log_interval=1",
        f"--out_dir={out_dir}",
    ]


def nanogpt_data(text: Path) -> list[str]:
    """Our overrides for nanoGPT's split of the text: its train.txt and val.txt."""
    return [
        "data=text_files",
        f"data.paths=[{text / 'train.txt'}]",
        f"data.val_paths=[{text / 'val.txt'}]",
    ]


def own_command(text: Path, run_dir: Path, extra: list[str], steps: int | None = None) -> list:
    """train.py with our own recipe's overrides (`extra`) on nanoGPT's split; `steps` cuts it
    short (a warm-up run), None keeps the recipe's own."""
    steps_override = [] if steps is None else [f"trainer.max_steps={steps}"]
    return [sys.executable, str(ROOT / "train.py"), *nanogpt_data(text), *extra, *steps_override,
            f"hydra.run.dir={run_dir}"]  # fmt: skip


def recipe_command(
    recipe: dict, steps: int, text: Path, run_dir: Path, extra: list[str]
) -> list[str]:
    """train.py with nanoGPT's recipe as our overrides, `extra` on top, on its split."""
    shape = recipe["shape"]
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *nanogpt_data(text),
        f"data.batch_size={shape['batch_size']}",
        f"model.n_layer={shape['n_layer']}",
        f"model.n_embd={shape['n_embd']}",
        f"model.attention.n_head={shape['n_head']}",
        f"model.block_size={shape['block_size']}",
        "model.bias=false",
        # nanoGPT's one dropout also drops attention weights; ours has a separate knob for those
        f"model.dropout={recipe['dropout']}",
        f"model.attention.dropout={recipe['dropout']}",
        "optim.lr=1e-3",
        "optim.warmup_steps=100",
        "optim.min_lr_ratio=0.1",
        "optim.beta2=0.99",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={eval_interval(steps)}",
        f"trainer.limit_val_batches={recipe['eval_iters']}",
        f"callbacks.attention_maps.every_n_steps={steps}",  # the maps of the trained model
        *recipe["ours"],
        *extra,
        f"hydra.run.dir={run_dir}",
    ]


def timed(command: list[str], cwd: Path) -> tuple[float, list[tuple[float, str]]]:
    """(wall seconds, [(seconds since launch, line) of each stdout line]) of a command."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stderr:  # a file: a full stderr pipe would block
        # Unbuffered: each line is timed when it is printed, not when a block of output fills.
        unbuffered = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            command, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=unbuffered
        )
        lines = [(time.perf_counter() - start, line) for line in process.stdout]
        process.wait()
        wall = time.perf_counter() - start
        if process.returncode != 0:
            stderr.seek(0)
            failure = stderr.read()[-3000:]
            raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{failure}")
    return wall, lines


def seconds_to_target(validations: list[tuple[float, float]], target: float | None) -> float | None:
    """Seconds from launch to the first validation (seconds, loss) at or below `target`."""
    if target is None:
        return None
    return next((seconds for seconds, loss in validations if loss <= target), None)


NANOGPT_ITER = re.compile(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms")
NANOGPT_EVAL = re.compile(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)")


def run_nanogpt(
    copy: Path,
    recipe: dict,
    steps: int,
    out_dir: Path,
    seed: int = 1337,
    score: bool = True,
    target: float | None = None,
) -> dict:
    wall, lines = timed(nanogpt_command(recipe, steps, out_dir, seed), copy)
    milliseconds = [
        float(match[2])
        for _, line in lines
        if (match := NANOGPT_ITER.match(line)) and int(match[1]) >= 10
    ]
    evaluations = [  # (step, seconds from launch, loss) of its own estimate, once it is printed
        (int(match[1]), seconds, float(match[2]))
        for seconds, line in lines
        if (match := NANOGPT_EVAL.match(line)) and int(match[1]) > 0
    ]
    validations = [(seconds, loss) for _, seconds, loss in evaluations]
    tokens = recipe["shape"]["batch_size"] * recipe["shape"]["block_size"]
    return {
        "wall": wall,
        "tokens_per_sec": tokens / (statistics.median(milliseconds) / 1000),
        "first_step": next(
            (seconds for seconds, line in lines if line.startswith("iter 0: ")), None
        ),
        "to_target": seconds_to_target(validations, target),
        "best_val": min((loss for _, loss in validations), default=None),
        "full_val": nanogpt_full_val_loss(copy, out_dir / "ckpt.pt") if score else None,
        "validations": evaluations,
    }


# Runs inside the nanoGPT copy, with its model.py: the loss of its checkpoint on every
# non-overlapping block of its val.bin.
NANOGPT_EVALUATE = """
import sys, numpy as np, torch, torch.nn.functional as F
from model import GPT, GPTConfig
checkpoint = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
model = GPT(GPTConfig(**checkpoint["model_args"]))
state = {k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()}
model.load_state_dict(state)
ids = np.fromfile("data/shakespeare_char/val.bin", dtype=np.uint16)
ids = torch.from_numpy(ids.astype(np.int64))
T = model.config.block_size
n = (len(ids) - 1) // T
x, y = ids[: n * T].view(n, T), ids[1 : n * T + 1].view(n, T)
total = 0.0
with torch.no_grad():
    for i in range(0, n, 64):
        logits, _ = model.eval()(x[i : i + 64], y[i : i + 64])
        targets = y[i : i + 64].flatten()
        total += F.cross_entropy(logits.flatten(0, 1), targets, reduction="sum").item()
print(total / (n * T), len(ids))
"""


def nanogpt_full_val_loss(copy: Path, checkpoint: Path) -> float:
    result = subprocess.run(
        [sys.executable, "-c", NANOGPT_EVALUATE, str(checkpoint)],
        cwd=copy,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(result.stdout.strip().splitlines()[-1].split()[0])  # after its own prints


@torch.no_grad()
def our_full_val_loss(run_dir: Path, val_text: str) -> float:
    """The same measure for our best checkpoint: every non-overlapping block of the text."""
    model, hparams = load_checkpoint(find_checkpoint(run_dir, "best", "run"))
    ids = torch.tensor(tokenizer_from_dict(hparams["tokenizer"]).encode(val_text))
    block = model.config.block_size
    n = (len(ids) - 1) // block
    x, y = ids[: n * block].view(n, block), ids[1 : n * block + 1].view(n, block)
    total = 0.0
    for i in range(0, n, 64):
        logits, _ = model(x[i : i + 64])
        targets = y[i : i + 64].flatten()
        total += F.cross_entropy(logits.flatten(0, 1), targets, reduction="sum").item()
    return total / (n * block)


def run_ours(
    command: list[str], text: Path, run_dir: Path, score: bool = True, target: float | None = None
) -> dict:
    """The figures of our run of `command` (own_command's or recipe_command's, in run_dir)."""
    wall, _ = timed(command, ROOT)
    summary = json.loads((run_dir / "summary.json").read_text())
    validation_rows = [row for row in summary["history"] if "val/loss" in row]
    validations = [  # the end of each validation, from launch
        (summary["seconds_to_fit_start"] + row["time"], row["val/loss"]) for row in validation_rows
    ]
    return {
        "wall": wall,
        "tokens_per_sec": summary["train/tokens_per_sec"],
        "first_step": summary["seconds_to_first_step"],
        "to_target": seconds_to_target(validations, target),
        "best_val": summary["best_val_loss"],
        "full_val": our_full_val_loss(run_dir, (text / "val.txt").read_text()) if score else None,
        "validations": [  # (step, seconds from launch, loss)
            (row["step"], *validation)
            for row, validation in zip(validation_rows, validations, strict=True)
        ],
    }


def prepare_nanogpt(nanogpt: Path, text: Path, scratch: Path) -> Path:
    """A scratch copy of nanoGPT with its shakespeare_char data prepared by its own script."""
    copy = scratch / "nanoGPT"
    shutil.copytree(nanogpt, copy)
    data = copy / "data" / "shakespeare_char"
    shutil.copy(text / "input.txt", data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return copy


COLUMNS = ("wall", "tokens_per_sec", "first_step", "to_target", "best_val", "full_val")


def cell(value: float | None) -> str:
    return "never" if value is None else f"{value:.4g}"  # "never": the target was not reached


def show(label: str, row: dict, columns: list[str]) -> None:
    print(f"{label:<16}" + "".join(f"{cell(row[key]):>16}" for key in columns), flush=True)


def show_validations(row: dict) -> None:
    """Each validation of a run as step: seconds from launch, loss."""
    shown = ", ".join(
        f"{step}: {seconds:.1f} s {loss:.4f}" for step, seconds, loss in row["validations"]
    )
    print(f"{'':<16}{shown}", flush=True)


def median_and_spread(values: list[float | None]) -> str:
    """The values' median (min-max), or how many of them are None (a target never reached)."""
    if None in values:
        return f"{sum(v is None for v in values)} of {len(values)} never"
    return f"{statistics.median(values):.4g} ({min(values):.4g}-{max(values):.4g})"


def print_ratios(label: str, ours: list[float | None], theirs: list[float | None]) -> None:
    ratios = [o / t if None not in (o, t) else None for o, t in zip(ours, theirs, strict=True)]
    shown = " ".join(cell(r) for r in ratios)
    print(f"{label}: {shown} -> {median_and_spread(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="nanoGPT's folder")
    parser.add_argument("--text", type=Path, help="input.txt, train.txt and val.txt's folder")
    parser.add_argument("--recipe", choices=RECIPES, default="cpu")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: the recipe's")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, help="default: the recipe's")
    parser.add_argument("--ours", default="", help="more overrides for our runs")
    parser.add_argument("--own", help="our own recipe's overrides, instead of nanoGPT's recipe")
    parser.add_argument("--variant", help="overrides for a third side: ours, with these too")
    parser.add_argument(
        "--target-loss",
        type=float,
        help="also time each side from launch to its first validation at or below this loss",
    )
    args = parser.parse_args()
    recipe = dict(RECIPES[args.recipe])
    if args.device == "cpu" and args.recipe == "gpu":
        recipe["nanogpt"] = ["--device=cpu", "--compile=False"]
        recipe["ours"] = ["trainer=cpu"]
    elif args.device == "cuda" and args.recipe == "cpu":
        recipe["nanogpt"] = ["--device=cuda", "--compile=False", "--dtype=float32"]
        recipe["ours"] = ["trainer.accelerator=gpu"]
    steps = args.steps or recipe["steps"]
    if steps >= EVAL_INTERVAL and steps % EVAL_INTERVAL:
        parser.error(
            f"--steps {steps}: give fewer than {EVAL_INTERVAL} steps or a multiple of "
            f"{EVAL_INTERVAL}, nanoGPT's evaluation interval, so that both sides evaluate at "
            "the same steps"
        )
    text = (args.text or args.nanogpt.parent / "tinyshakespeare").resolve()
    own = args.own is not None
    extra = (args.own if own else args.ours).split()
    scratch = Path(tempfile.mkdtemp(prefix="vs_nanogpt-"))
    copy = prepare_nanogpt(args.nanogpt.resolve(), text, scratch)
    print(f"recipe {args.recipe}, {steps} steps, {args.pairs} pairs; scratch {scratch}")
    ours = "our own recipe" if own else f"the same recipe, with {' '.join(recipe['ours'])}"
    ours += f", {' '.join(extra)}" if extra else ""
    cpu = cpu_capabilities().get("cpu_name", "")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs {cpu}; ours: {ours}")

    # One short untimed run of each first: the data cache, the page cache and any compile cache
    # are then warm for both sides, as for a user's second run.
    run_nanogpt(copy, recipe, 20, scratch / "warm-nanogpt", score=False)

    def our_command(steps: int, run_dir: Path, overrides: list[str]) -> list[str]:
        if own:  # its own steps, except for the warm-up's
            return own_command(text, run_dir, overrides, steps if steps < 100 else None)
        return recipe_command(recipe, steps, text, run_dir, overrides)

    ours_sides = {"ours": extra}
    if args.variant:
        ours_sides["variant"] = [*extra, *args.variant.split()]
        print(f"variant: ours with {args.variant}")
    for side, overrides in ours_sides.items():
        warm_dir = scratch / f"warm-{side}"
        run_ours(our_command(20, warm_dir, overrides), text, warm_dir, score=False)
    target = args.target_loss
    columns = [key for key in COLUMNS if target is not None or key != "to_target"]
    print(f"\n{'run':<16}" + "".join(f"{key:>16}" for key in columns))
    results: dict[str, list[dict]] = {"nanogpt": [], **{side: [] for side in ours_sides}}
    for pair in range(args.pairs):
        # Each pair runs its own seed, on both sides: one seed moves the loss by about 0.01.
        seed = 1337 + pair
        nanogpt_dir = scratch / f"nanogpt-{pair}"
        results["nanogpt"].append(
            run_nanogpt(copy, recipe, steps, nanogpt_dir, seed, target=target)
        )
        show(f"nanogpt {pair}", results["nanogpt"][-1], columns)
        if target is not None:
            show_validations(results["nanogpt"][-1])
        for side, overrides in ours_sides.items():
            run_dir = scratch / f"{side}-{pair}"
            command = our_command(steps, run_dir, [*overrides, f"seed={seed}"])
            results[side].append(run_ours(command, text, run_dir, target=target))
            show(f"{side} {pair}", results[side][-1], columns)
            if target is not None:
                show_validations(results[side][-1])

    print("\nmedians (min-max)")
    for side, rows in results.items():
        cells = [f"{key} {median_and_spread([row[key] for row in rows])}" for key in columns]
        print(f"{side}: " + ", ".join(cells))
    timings = [key for key in columns if key not in ("best_val", "full_val")]
    compared = [(side, "nanogpt") for side in ours_sides]
    compared += [("variant", "ours")] if args.variant else []
    for side, other in compared:
        print(f"\n{side} / {other}, per pair and median (min-max):")
        ours, theirs = results[side], results[other]
        for key in timings:
            print_ratios(key, [row[key] for row in ours], [row[key] for row in theirs])
        if target is not None and other == "nanogpt":
            print_ratios(
                f"time to {target} / nanoGPT's whole wall",
                [row["to_target"] for row in ours],
                [row["wall"] for row in theirs],
            )
    (scratch / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nall figures: {scratch / 'results.json'}")


if __name__ == "__main__":
    main()
