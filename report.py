"""Summarise a sweep from its jobs' own summaries, no logging service needed:

    python report.py multirun/ablation_scale/2026-11-23_10-00-00 [--wandb]

Reads <sweep dir>/<job>/summary.json (written by train.py) and writes into the sweep directory
report.md (a table: swept values, final train/val loss, bits per character, tokens/s, mean
attention entropy, wall time), val_loss.png (best val loss against each swept value) and
loss_curves.png (every job's validation curve). When the jobs logged to W&B online, or with
--wandb, the table and plots also go to a summary run in the sweep's group.
"""

import argparse
import json
import math
import reprlib
import sys
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from data.files import disk_full_cause, write_files_atomic  # noqa: E402
from errors import USER_ERRORS, check_writable, exit_on_broken_pipe  # noqa: E402

COLUMNS = [
    ("train loss", "train/loss", "{:.3f}"),
    ("val loss", "val/loss", "{:.3f}"),
    ("best val loss", "best_val_loss", "{:.3f}"),
    ("val bits/char", "val/bits_per_char", "{:.3f}"),
    ("tokens/s", "train/tokens_per_sec", "{:,.0f}"),
    ("attention entropy", "attention/entropy_mean", "{:.2f}"),
    ("wall s", "wall_seconds", "{:.0f}"),
    ("s to 1st step", "seconds_to_first_step", "{:.1f}"),
]


# The status of a job that started (Hydra wrote its record) but never wrote summary.json.
UNFINISHED = "no summary.json: killed, or still running"
# The status of a job whose summary.json is not one (cut short, edited...); why follows.
UNREADABLE = "unreadable summary.json"


def read_summary(path: Path) -> dict | str:
    """The job's summary in `path`, or the status that says why it cannot be read."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: not JSON, or not text
        return f"{UNREADABLE} ({type(error).__name__}: {error})"
    if not isinstance(summary, dict) or not isinstance(summary.get("status"), str):
        return f"{UNREADABLE} (a JSON {type(summary).__name__} without a status)"
    problem = misread_field(summary)
    return summary if problem is None else f"{UNREADABLE} ({problem})"


def _is_number(value: object) -> bool:
    """A JSON number: NaN and infinity included (a diverged run's loss), a bool not."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def misread_field(summary: dict) -> str | None:
    """What makes a field the report reads the wrong type for it (formatted as a number,
    plotted, iterated), in words; None when every one is right. A field may be absent, and
    the numbers null, as train.py writes them where a run never reached them."""
    overrides = summary.get("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return "its overrides are not a list of strings"
    for key, expected, right in (
        ("job", "a job number", lambda job: isinstance(job, int) and not isinstance(job, bool)),
        ("error", "a message", lambda error: isinstance(error, str)),
        # The plots' scale: train.py writes the best finite loss, or null where there is none.
        ("best_val_loss", "a finite number", lambda loss: _is_number(loss) and math.isfinite(loss)),
        *((key, "a number", _is_number) for _, key, _ in COLUMNS),
    ):
        value = summary.get(key)
        if value is not None and not right(value):
            return f"{key} is {reprlib.repr(value)}, not {expected}"
    history = summary.get("history", [])
    if not isinstance(history, list) or not all(isinstance(row, dict) for row in history):
        return f"history is {reprlib.repr(history)}, not a list of rows"
    for index, row in enumerate(history):
        for key, value in row.items():
            if not _is_number(value):
                return f"history row {index}: {key} is {reprlib.repr(value)}, not a number"
    return None


def load_jobs(sweep_dir: Path) -> list[dict]:
    """The jobs' summaries, in job order, each with its parsed overrides under "values". A job
    that started but never wrote its summary is listed too, as UNFINISHED, and one whose
    summary cannot be read as UNREADABLE, with its overrides from Hydra's record."""
    started = {p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")}
    summarised = {p.parent for p in sweep_dir.glob("*/summary.json")}
    folders = sorted(started | summarised, key=lambda p: (len(p.name), p))
    if not summarised:
        raise FileNotFoundError(
            f"no */summary.json under {sweep_dir}: point report.py at the directory of a sweep "
            "made by `python train.py -m ...` (its jobs are numbered subdirectories)"
        )
    jobs = []
    for folder in folders:
        job = read_summary(folder / "summary.json") if folder in summarised else UNFINISHED
        if isinstance(job, str):
            record = folder / ".hydra" / "overrides.yaml"
            overrides = yaml.safe_load(record.read_text()) if record.is_file() else []
            job = {"status": job, "overrides": overrides or []}
            job["job"] = int(folder.name) if folder.name.isdigit() else None
        job["dir"] = folder
        job["values"] = dict(o.split("=", 1) for o in job.get("overrides", []) if "=" in o)
        if job.get("job") is None:  # a single run's summary: name it by its directory
            job["job"] = folder.name
        jobs.append(job)
    return jobs


def swept_keys(jobs: list[dict]) -> list[str]:
    """The override keys whose values differ between jobs, in the order the jobs give them."""
    keys = list(dict.fromkeys(k for job in jobs for k in job["values"]))
    return [k for k in keys if len({job["values"].get(k) for job in jobs}) > 1]


def fixed_overrides(jobs: list[dict], swept: list[str]) -> list[str]:
    first = jobs[0]["values"]
    return [f"{k}={v}" for k, v in first.items() if k not in swept]


def shown(value: str) -> str:
    """An override value for a table: long decimals (Optuna's draws) cut to 4 digits."""
    try:
        number = float(value)
    except ValueError:
        return value
    return f"{number:.4g}" if "." in value and len(value) > 6 else value


def cell(job: dict, key: str, fmt: str) -> str:
    value = job.get(key)
    return "–" if value is None else fmt.format(value)


def markdown_table(jobs: list[dict], swept: list[str]) -> str:
    header = ["job", *swept, "status", *(name for name, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for job in jobs:
        status = job["status"] if job["status"] != "failed" else f"failed: {job.get('error', '')}"
        values = (shown(job["values"].get(k, "")) for k in swept)
        row = [str(job["job"]), *values]
        row += [status.replace("|", "/"), *(cell(job, key, fmt) for _, key, fmt in COLUMNS)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _as_numbers(values: list[str]) -> list[float] | None:
    try:
        numbers = [float(v) for v in values]
    except ValueError:
        return None
    return numbers if all(math.isfinite(n) for n in numbers) else None


def validated(jobs: list[dict]) -> list[dict]:
    """The completed jobs with a best validation loss (a run that never validated has none:
    trainer.limit_val_batches=0, say)."""
    return [j for j in jobs if j["status"] == "completed" and j.get("best_val_loss") is not None]


def plot_loss_vs_values(jobs: list[dict], swept: list[str], path: Path) -> None:
    """Best val loss against each swept key: one panel per key, of the validated jobs."""
    done = validated(jobs)
    keys = swept or ["job"]
    figure, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        labels = [job["values"].get(key, str(job.get("job"))) for job in done]
        losses = [job["best_val_loss"] for job in done]
        numbers = _as_numbers(labels)
        if numbers is not None and len(set(numbers)) > 2:
            order = sorted(range(len(done)), key=lambda i: numbers[i])
            ax.plot([numbers[i] for i in order], [losses[i] for i in order], "o-")
        else:  # names, or too few numbers for a line: one bar per job
            ax.bar(range(len(done)), losses, color="tab:blue")
            ax.set_xticks(range(len(done)), labels, rotation=30, ha="right")
            ax.set_ylim(min(losses) * 0.97, max(losses) * 1.02)
        ax.set_xlabel(key)
        ax.set_ylabel("best val loss")
        ax.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110, format="png")  # `path` is a temporary name: no .png
    plt.close(figure)


def plot_loss_curves(jobs: list[dict], swept: list[str], path: Path) -> None:
    """Every completed or pruned job's val loss (solid) and train loss (faint), against the step
    and against wall time since fitting started (what a budget in minutes buys)."""
    done = [j for j in jobs if j["status"] in ("completed", "pruned")]
    timed = any("time" in row for job in done for row in job.get("history", []))
    xs = ("step", "time") if timed else ("step",)  # summaries before "time" was recorded
    figure, axes = plt.subplots(1, len(xs), figsize=(6 * len(xs), 4.2), sharey=True, squeeze=False)
    axes = axes[0]
    for job in done:
        # The swept keys this job sets (runs compared side by side need not set the same ones);
        # a job that sets none is named by its directory.
        setting = [k for k in swept if k in job["values"]]
        label = ", ".join(f"{k.split('.')[-1]}={shown(job['values'][k])}" for k in setting)
        label = label or str(job.get("job"))
        history = job.get("history", [])
        for ax, x in zip(axes, xs, strict=True):
            train = [(r[x], r["train/loss"]) for r in history if "train/loss" in r and x in r]
            val = [(r[x], r["val/loss"]) for r in history if "val/loss" in r and x in r]
            if not val:
                continue
            (line,) = ax.plot(*zip(*val, strict=True), "o-", label=label or f"job {job['job']}")
            if train:
                ax.plot(*zip(*train, strict=True), color=line.get_color(), alpha=0.25, lw=1)
    for ax, x in zip(axes, xs, strict=True):
        ax.set_xlabel("seconds of training" if x == "time" else "step")
    axes[0].set_ylabel("loss (val solid, train faint)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110, format="png")  # `path` is a temporary name: no .png
    plt.close(figure)


def optuna_best(sweep_dir: Path) -> str:
    results = sweep_dir / "optimization_results.yaml"
    if not results.is_file():
        return ""
    try:
        best = yaml.safe_load(results.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        best = f"{type(error).__name__}: {' '.join(str(error).split())}"
    value = best.get("best_value") if isinstance(best, dict) else None
    params = best.get("best_params", {}) if isinstance(best, dict) else None
    if not (_is_number(value) and isinstance(params, dict)):  # a hand's edit, a cut-off write
        why = best if isinstance(best, str) else "no best_value number and best_params mapping"
        return f"\nBest trial (Optuna): {results.name} cannot be read ({why})\n"
    # as a command line gives them: null and true, not Python's None and True
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in params.items()}
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    return f"\nBest trial (Optuna): val loss {value:.4f} with {shown}\n"


def jobs_logged_online(jobs: list[dict]) -> bool:
    config = jobs[0]["dir"] / ".hydra" / "config.yaml"
    if not config.is_file():
        return False
    wandb_logger = (yaml.safe_load(config.read_text()).get("logger") or {}).get("wandb")
    return bool(wandb_logger) and wandb_logger.get("offline") is False


class WandbUnavailable(Exception):
    """W&B refused the report's run."""


def log_to_wandb(sweep_dir: Path, jobs: list[dict], swept: list[str], plots: list[Path]) -> str:
    """A W&B run in the sweep's group holding the table and the plots; returns its directory."""
    import wandb

    header = ["job", *swept, "status", *(name for name, _, _ in COLUMNS)]
    rows = [
        [job.get("job"), *(job["values"].get(k) for k in swept), job["status"]]
        + [job.get(key) for _, key, _ in COLUMNS]
        for job in jobs
    ]
    try:
        run = wandb.init(
            project="tinyformer",
            group=str(sweep_dir.resolve()),  # the jobs' group (training/wandb_run.py)
            job_type="sweep-report",
            name=f"report: {sweep_dir.resolve().name}",
            dir=str(sweep_dir),
            config={"sweep_dir": str(sweep_dir), "swept": swept},
        )
    except wandb.errors.Error as error:  # no login (UsageError), no server (CommError)...
        raise WandbUnavailable(
            f"logging the report to W&B failed ({str(error).splitlines()[0]}); log in with "
            "`wandb login`, or set WANDB_MODE=offline to write it offline and `wandb sync` it "
            "later"
        ) from None
    run.log(
        {"sweep/table": wandb.Table(columns=header, data=rows)}
        | {f"sweep/{p.stem}": wandb.Image(str(p)) for p in plots}
    )
    run_dir = run.dir
    run.finish()
    return run_dir


def report(sweep_dir: Path, to_wandb: bool = False) -> str:
    """Write report.md and the plots into `sweep_dir`; return the markdown."""
    jobs = load_jobs(sweep_dir)
    report_file = sweep_dir / "report.md"
    check_writable(
        report_file,
        f"the sweep directory {sweep_dir}",
        "report.py writes report.md and its plots there: copy the sweep to a disk you can "
        "write to and report on the copy",
    )
    swept = swept_keys(jobs)
    writers = {}
    if validated(jobs):
        writers[sweep_dir / "val_loss.png"] = partial(plot_loss_vs_values, jobs, swept)
    if any(job["status"] == "completed" for job in jobs):
        writers[sweep_dir / "loss_curves.png"] = partial(plot_loss_curves, jobs, swept)
    plots = list(writers)
    fixed = ", ".join(f"`{o}`" for o in fixed_overrides(jobs, swept)) or "none"
    text = f"# Sweep {sweep_dir}\n\nCommon overrides: {fixed}\n\n"
    text += markdown_table(jobs, swept) + "\n" + optuna_best(sweep_dir)
    text += "".join(f"\n![{p.stem}]({p.name})\n" for p in plots)
    writers[report_file] = lambda temporary: temporary.write_text(text, encoding="utf-8")
    try:  # all the files or none: an earlier report is never left half replaced
        write_files_atomic(writers)
    except Exception as error:
        if disk_full_cause(error) is None:
            raise
        raise ValueError(
            f"no space left on the disk of {sweep_dir} to write the report (an earlier report "
            "there is intact): free some space, and run report.py again"
        ) from None
    finally:
        plt.close("all")  # a figure whose saving failed
    if to_wandb or jobs_logged_online(jobs):
        log_to_wandb(sweep_dir, jobs, swept, plots)
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="a multirun directory made by train.py -m")
    parser.add_argument("--wandb", action="store_true", help="also log to a W&B summary run")
    args = parser.parse_args(argv)
    try:
        # Flushed here, where a reader gone (`| head`) is caught, rather than at exit
        print(report(args.sweep_dir, args.wandb), flush=True)
    except (*USER_ERRORS, WandbUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the report's files are written before it is printed
        exit_on_broken_pipe()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
