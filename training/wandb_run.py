"""The W&B side of a run: the logger (Lightning's, quieter, with best-value summaries) and the
run's name and group, which say what was trained without opening the run."""

import importlib.util
import os
import secrets
import string
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import lightning as L
import yaml
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig

from kinds import KINDS
from training.sweep import in_sweep

# Which way each validation metric improves (as the tasks declare them): a run's summary holds
# its best value, as the checkpoint and the Optuna search judge a run, not its last.
# (val/best_loss, the running minimum, stays a plain value: W&B Sweeps can only optimise a
# top-level number.)
BEST = {
    name: way
    for kind in KINDS.values()
    for name, way in kind.module_class.validation_metrics.items()
    if name != "val/best_loss"
}


# Where W&B Launch keeps the job inputs that code in this process staged for the next run.
STAGED_LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"


def skip_launch_inputs_never_staged() -> None:
    """wandb.init ends by applying the W&B Launch job inputs staged in this process, and imports
    W&B Launch and W&B's public API to look for them: about 1 s of a run's start on a 2-core CPU.
    Inputs can only have been staged by code that imported the module that stages them, so
    while it is not loaded there are none, and the look (with its imports) is skipped, for every
    W&B run this process starts. A W&B whose step (a private one) is missing or looks in another
    module is left as it is."""
    from wandb.sdk.wandb_run import Run

    apply_staged = getattr(Run, "_detect_and_apply_job_inputs", None)
    if apply_staged is None or getattr(apply_staged, "skips_unstaged", False):
        return
    if STAGED_LAUNCH_INPUTS not in apply_staged.__code__.co_names:
        return  # a W&B that stages them elsewhere: skipping could drop staged inputs

    def apply_if_any_staged(run: Run) -> None:
        if STAGED_LAUNCH_INPUTS in sys.modules:
            apply_staged(run)

    apply_if_any_staged.skips_unstaged = True
    Run._detect_and_apply_job_inputs = apply_if_any_staged


class StartingRun:
    """The W&B run while it is starting in the background: at its first use it waits for the
    run, and passes that use on. Lightning reads every logger's `experiment` at setup, only so
    that it exists (or, with sync_tensorboard, which never starts in the background, before
    TensorBoard's writers); with this stand-in the first steps need not wait for the run."""

    def __init__(self, logger: "WandbLogger") -> None:
        self._logger = logger

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copy's and pickle's probes, before _logger is set
            raise AttributeError(name)
        self._logger.wait_for_start()
        return getattr(self._logger.experiment, name)


# The loggers whose run starts in the background: finish_wandb settles them, whatever became
# of the training run.
STARTING: list["WandbLogger"] = []

# W&B's run ids: 8 characters of these.
RUN_ID_CHARACTERS = string.ascii_lowercase + string.digits


def import_what_logging_images_needs() -> None:
    """W&B imports pandas (and pyarrow with it: 0.4-0.7 s of a 2-core CPU) the first time a
    run logs anything but a plain number, an attention map say, on the thread that logs it,
    wherever pandas is installed (datasets needs it). Called on the background start's thread,
    so that the training thread's first map need not wait for it."""
    if importlib.util.find_spec("pandas") is not None:
        import pandas  # noqa: F401


def new_run_id() -> str:
    """A W&B run id, from the system's randomness: the seeded `random` module would give a
    sweep's jobs, each seeded alike, the same ids."""
    return "".join(secrets.choice(RUN_ID_CHARACTERS) for _ in range(8))


class WandbLogger(LightningWandbLogger):
    """Lightning's W&B logger, with summaries of the best values (BEST), W&B's quiet console
    output (where the run is saved, not its banner and closing tables), without the
    `anonymous` argument, which W&B warns has no effect, and without W&B's second of looking
    for Launch inputs that were never staged (skip_launch_inputs_never_staged).

    An offline run can start on a thread of its own (start_in_background): importing W&B and
    starting its service take 0.6-0.9 s of a 2-core CPU's start, which training need not wait
    for, and most of which runs beside the training steps' kernels.
    """

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("settings", {"quiet": True})
        super().__init__(**kwargs)
        self._wandb_init.pop("anonymous", None)
        self._no_start_in_background()

    def _no_start_in_background(self) -> None:
        self._starter: ThreadPoolExecutor | None = None  # a start no one has waited for yet
        self._starter_thread: int | None = None
        self._start_tasks: list[Future] = []
        self._released = threading.Event()
        self._cancelled = False

    @property
    def uploads_checkpoints(self) -> bool:
        """log_model: Lightning's W&B logger reads checkpoint files as soon as they are saved
        (log_model="all") or at the end, so they must be written at once, not beside training
        (training/checkpoint_io.py)."""
        return bool(self._log_model)

    def start_in_background(self) -> None:
        """Have the run start on a thread once release_start() is called, if it is offline and
        this is the first process (an online start may ask for a login at the terminal, so it
        starts when first used, on the training thread, as ever; so does one that syncs
        TensorBoard). The run's id is drawn now, so `version` needs no wait. Until the run is
        up, hyper-parameters queue behind its start on that thread, and `experiment` is a
        StartingRun."""
        if not self._offline or self._experiment is not None or rank_zero_only.rank != 0:
            return
        if self._wandb_init.get("sync_tensorboard"):
            return
        if self._wandb_init.get("id") is None:
            self._id = self._wandb_init["id"] = new_run_id()
        # What Lightning's start sets, set first here, on the training thread: the starter's
        # own setting then replaces an existing variable, which never moves the environment
        # array that other threads may be reading.
        os.environ["WANDB_MODE"] = "dryrun"
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wandb-start")
        self._start_tasks.append(self._starter.submit(self._create_run_when_released))
        STARTING.append(self)

    def release_start(self, cancel: bool = False) -> None:
        """Let a start prepared by start_in_background begin (`cancel`: end it unbegun, if it
        was not released yet). Never waits."""
        if not self._released.is_set():
            self._cancelled = cancel
            self._released.set()

    def wait_for_start(self) -> None:
        """Wait for a start in the background (beginning it if it was not released yet); raise
        what it, or what queued behind it, raised first."""
        for task in self._join_starter():
            task.result()

    def _join_starter(self) -> list[Future]:
        """The tasks of a start in the background, once all are done or cancelled; none seen
        from the starter's own thread, which runs them in turn."""
        if not self._starting():
            return []
        self.release_start()
        self._starter.shutdown(wait=True, cancel_futures=self._cancelled)
        self._starter = None
        tasks, self._start_tasks = self._start_tasks, []
        return [task for task in tasks if not task.cancelled()]

    def _starting(self) -> bool:
        """A start in the background that no one has waited for, seen from another thread."""
        return self._starter is not None and threading.get_ident() != self._starter_thread

    def _create_run_when_released(self) -> None:
        self._starter_thread = threading.get_ident()
        self._released.wait()
        if not self._cancelled:
            self._create_run()
            import_what_logging_images_needs()

    def _create_run(self) -> None:
        skip_launch_inputs_never_staged()
        run = super().experiment
        for key, summary in BEST.items():
            run.define_metric(key, summary=summary)

    @property
    def experiment(self):  # the parent's (a stand-in on ranks other than zero), or a StartingRun
        if self._starting():
            return StartingRun(self)
        if self._experiment is None and rank_zero_only.rank == 0:
            self._create_run()
        return super().experiment

    def run_record(self) -> dict | None:
        """The run's id and group for a checkpoint, without waiting for a start in the
        background (None where neither the run nor its arguments name it yet)."""
        if self._experiment is not None:
            run = self._experiment
            return {"id": run.id, "group": run.group or run.id}
        run_id = self._wandb_init.get("id")
        if run_id is None:
            return None
        return {"id": run_id, "group": self._wandb_init.get("group") or run_id}

    @rank_zero_only
    def log_hyperparams(self, params) -> None:
        if self._starting():
            self._start_tasks.append(self._starter.submit(self._log_hyperparams_if_up, params))
        else:
            super().log_hyperparams(params)

    def _log_hyperparams_if_up(self, params) -> None:
        """On the starter: after a start that failed, there is no run (the failure is raised
        to whoever waits for the start)."""
        if self._experiment is not None:
            super().log_hyperparams(params)

    def __getstate__(self) -> dict:
        """For the copies of Lightning's ddp_spawn: the run is started first (Lightning's
        copies attach to it), and the thread's parts stay in this process."""
        self.wait_for_start()
        state = super().__getstate__()
        for key in ("_starter", "_starter_thread", "_start_tasks", "_released", "_cancelled"):
            del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._no_start_in_background()


class ReleaseWandbStart(L.Callback):
    """Releases the W&B starts that train.py prepared once the first optimizer step is done:
    on a 2-core CPU they would slow it by a few tenths of a second."""

    def __init__(self, loggers: list[WandbLogger]) -> None:
        self.loggers = loggers

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        while self.loggers and trainer.global_step >= 1:
            self.loggers.pop().release_start()


def finish_wandb() -> None:
    """End the W&B run of this process, if it started one, once every start in the background
    is settled (one never released is not begun): a sweep's next job must not log into it, and
    a starter left waiting would keep the process from exiting. A start that failed is a
    warning here, where the run ends anyway, perhaps with an error of its own."""
    for logger in STARTING:
        logger.release_start(cancel=True)  # all at once: a join interrupted leaves none waiting
    while STARTING:
        for task in STARTING.pop()._join_starter():
            if task.exception() is not None:
                print(f"warning: the W&B run did not start: {task.exception()}", file=sys.stderr)
    if "wandb" in sys.modules:  # imported only by a run that logs to W&B
        sys.modules["wandb"].finish()


def run_names(node: DictConfig, model: DictConfig, run_dir: str) -> dict:
    """For a W&B logger, what its config leaves unset: a name from the model's shape and the
    key config choices, led in a sweep by the job's swept values; the run directory as the
    group (the sweep's directory in a sweep), so a run and its resumptions, or a sweep's jobs,
    group together; and in a sweep, the job's overrides as tags (W&B allows 64 characters)."""
    if not node.get("_target_", "").endswith("WandbLogger"):
        return {}
    hydra = HydraConfig.get()
    choices = hydra.runtime.choices
    if "n_encoder_layer" in model:
        shape = f"encdec-{model.n_encoder_layer}+{model.n_decoder_layer}x{model.n_embd}"
    else:
        shape = f"gpt-{model.n_layer}x{model.n_embd}"
    parts = [shape, choices.get("data"), choices.get("experiment")]
    name = "-".join(str(p) for p in parts if p and p != "null")
    names = {"name": name, "group": str(Path(run_dir).resolve())}
    if in_sweep():
        swept = swept_overrides(list(hydra.overrides.task), Path(hydra.sweep.dir))
        names["name"] = f"{','.join(short_names(swept))}-{name}"[:128]
        names["group"] = str(Path(hydra.sweep.dir).resolve())
        names["tags"] = [o[:64] for o in hydra.overrides.task]
    return {key: value for key, value in names.items() if not node.get(key)}


def swept_overrides(job_overrides: list[str], sweep_dir: Path) -> list[str]:
    """The job's overrides that the sweep chose: those not given as such on its command line
    (recorded in multirun.yaml, which both sweepers write before the first job)."""
    record = sweep_dir / "multirun.yaml"
    given = set()
    if record.is_file():
        given = set(yaml.safe_load(record.read_text())["hydra"]["overrides"]["task"])
    return [o for o in job_overrides if o not in given]


def short_names(overrides: list[str]) -> list[str]:
    """key=value with each key's last part (n_head=4), unless two keys share it."""
    keys = [o.split("=", 1)[0] for o in overrides]
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return [
        f"{short if last.count(short) == 1 else key}={o.split('=', 1)[1]}"
        for o, key, short in zip(overrides, keys, last, strict=True)
    ]
