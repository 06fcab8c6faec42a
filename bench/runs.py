"""Run train.py as a user would and read back what it logged (logger=csv), time two or more
sides alternately, and measure a device's matmul peak: shared by the benchmark scripts, which
compare side by side in one invocation."""

import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def train(*overrides: str, env: dict | None = None) -> tuple[float, list[dict]]:
    """Wall seconds of `python train.py overrides...` and its logged rows (metrics.csv), from a
    run directory that is deleted afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench_run_") as run_dir:
        command = [sys.executable, str(ROOT / "train.py"), *overrides, "logger=csv"]
        command.append(f"hydra.run.dir={run_dir}")
        start = time.perf_counter()
        result = subprocess.run(
            command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True
        )
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
        (metrics,) = Path(run_dir).glob("csv/**/metrics.csv")
        with open(metrics) as f:
            rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return seconds, rows


def last(rows: list[dict], key: str) -> float:
    return [row[key] for row in rows if key in row][-1]


def median_after(rows: list[dict], key: str, skip: int) -> float:
    """Median of `key` over rows past the first `skip` logged values (warm-up)."""
    values = [row[key] for row in rows if key in row][skip:]
    return statistics.median(values)


def spread(values: list[float], digits: int = 2) -> str:
    """'median (min-max)'."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def alternating_seconds(sides: dict, repeats: int, calls: int = 1) -> dict[object, list[float]]:
    """Seconds a call of each side (a function of no arguments) takes, averaged over `calls`
    calls, in `repeats` rounds after one warm-up call of each; every other round runs the sides
    in reverse order, so that none always runs first."""
    for work in sides.values():
        work()
    times: dict[Any, list[float]] = {side: [] for side in sides}
    for round_ in range(repeats):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for side in order:
            start = time.perf_counter()
            for _ in range(calls):
                sides[side]()
            times[side].append((time.perf_counter() - start) / calls)
    return times


def measured_in_a_process(script: str, *arguments: str) -> Callable[[Path], Any]:
    """A `measure` for compare_checkouts that runs `python script --measure ROOT arguments...`
    in a fresh process (each side imports its own checkout's code, and nothing stays warm from
    the other side), and reads back the JSON it prints: one figure, or several by name."""

    def measure(root: Path) -> Any:
        command = [sys.executable, script, "--measure", str(root), *arguments]
        run = subprocess.run(command, capture_output=True, text=True, check=True)
        return json.loads(run.stdout)

    return measure


def compare_checkouts(
    measure: Callable[[Path], float | dict[str, float]], other: Path, repeats: int, unit: str = "s"
) -> None:
    """Run `measure(root)` for another checkout and this one, alternately, `repeats` times
    each, and print each side's median (min, max) and the ratio this / other. `measure` returns
    one figure, or several by name ({"first step": ..., "whole process": ...})."""
    roots = {"other": other.resolve(), "this": ROOT}
    values: dict[str, list[dict[str, float]]] = {name: [] for name in roots}
    for _ in range(repeats):
        for name, root in roots.items():
            figures = measure(root)
            values[name].append(figures if isinstance(figures, dict) else {"": figures})
    for figure in values["this"][0]:
        label = f"{figure}, " if figure else ""
        medians = {}
        for name, rows in values.items():
            series = [row[figure] for row in rows]
            medians[name] = statistics.median(series)
            print(
                f"{label}{name:5s} ({roots[name]}): median {medians[name]:.2f} {unit} "
                f"(min {min(series):.2f}, max {max(series):.2f}, {repeats} runs)"
            )
        print(f"{label}this / other: {medians['this'] / medians['other']:.2f}")


def matmul_peak(device: str = "cpu", dtype: str = "float32") -> float:
    """FLOP/s of a large square matmul in `dtype`, best of a few: the device's practical peak
    (8192² on a GPU, whose smaller matmuls do not fill it; 2048² on a CPU)."""
    import torch  # here: the scripts that only run train.py never import it

    n = 8192 if device == "cuda" else 2048
    a, b = (torch.randn(n, n, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
    best = math.inf
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best
