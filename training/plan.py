"""train.py's check step: every option a user can get wrong, checked before any data loads
(check_options), into the Plan that the later steps take instead of the raw config."""

import dataclasses
from pathlib import Path

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator, XLAAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from errors import (
    check,
    check_int,
    check_known,
    check_seed,
    check_writable,
    config_from,
    is_int,
    is_number,
    override_key,
)
from kinds import ModelKind, kind_of
from model.encdec import EncDecConfig
from model.gpt import GPTConfig
from model.sampling import SamplingConfig
from training.checkpoint_io import RunCheckpoint
from training.failures import instantiate_checked, target_of
from training.guard import check_nonfinite_action
from training.init_from import InitFrom, check_starts_or_continues, prepare_init
from training.module import OptimConfig
from training.resume import Resume, prepare_resume
from training.sweep import in_sweep

# torch.compile's modes (compile_mode=)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# trainer.accelerator's names for what a machine may lack: Lightning's test of it, what torch
# finds, and the machine that has one
ACCELERATORS = {
    "gpu": (CUDAAccelerator, "GPU", "a GPU machine"),
    "cuda": (CUDAAccelerator, "GPU", "a GPU machine"),
    "mps": (MPSAccelerator, "Apple GPU", "an Apple silicon Mac"),
    "tpu": (XLAAccelerator, "TPU", "a TPU machine with torch_xla"),
}
# generate.py's options that the end-of-run sample (on the CPU: a GPT's continuation of
# sample.prompt, an encoder-decoder's greedy decodes of validation sources) has no use for, and
# the values that turn them off
GENERATE_ONLY = {
    "source": "null",
    "attention_plot": "null",
    "cuda_graph": "false",
    "compile": "false",
}
# beam search's options: decoding=beam is generate.py's alone, so the end-of-run sample would
# ignore them
BEAM_OPTIONS = ("beam_size", "length_penalty")
# The options the end-of-run sample takes: generate.py's, less those above.
END_OF_RUN_SAMPLE_OPTIONS = [
    field.name
    for field in dataclasses.fields(SamplingConfig)
    if field.name not in (*GENERATE_ONLY, *BEAM_OPTIONS)
]


@dataclasses.dataclass
class Plan:
    """A run's checked settings: every later step takes these, not the raw config."""

    resume: Resume
    kind: ModelKind
    model: GPTConfig | EncDecConfig
    optim: OptimConfig
    sample: SamplingConfig
    init: InitFrom | None = None  # init_from's weights and tokenizer, for a new run

    @property
    def cfg(self) -> DictConfig:
        return self.resume.cfg

    @property
    def run_dir(self) -> str:
        return self.resume.cfg.paths.output_dir


def check_options(cfg: DictConfig) -> Plan:
    """Every option a user can get wrong, before any data loads; given ckpt_path, the config is
    the checkpoint's run's under this command's overrides, given init_from, this command's
    under the model settings of the weights it starts from."""
    given = HydraConfig.get().overrides.task
    check_starts_or_continues(cfg, given)
    resume, init = prepare_init(prepare_resume(cfg, given, in_sweep()), given)
    cfg = resume.cfg
    check_seed("seed", cfg.seed)
    check(isinstance(cfg.compile, bool), "compile", "true or false", cfg.compile)
    modes = ", ".join(COMPILE_MODES)
    check(cfg.compile_mode in COMPILE_MODES, "compile_mode", f"one of {modes}", cfg.compile_mode)
    check(
        cfg.compile or cfg.compile_mode == "default",
        "compile_mode",
        "default unless compile=true (add compile=true, or drop compile_mode)",
        cfg.compile_mode,
    )
    check_nonfinite_action(cfg.on_nonfinite)
    check_accelerator(cfg.trainer.get("accelerator"))
    # the schedule needs a length
    check_int("trainer.max_steps", cfg.trainer.get("max_steps"))
    check_trainer_options(cfg.trainer)
    check_loggers_and_callbacks(cfg)
    kind = kind_of(cfg.model)
    check_monitored_metrics(cfg.get("callbacks"), kind)
    check_saves_last(cfg.get("callbacks"))
    check_callback_folders(cfg.get("callbacks"))
    check_fits_data(kind, cfg.data, HydraConfig.get().runtime.choices)
    check_data_follows_model(kind, cfg.model, cfg.data)
    if kind.name == "encdec":
        check_no_sample_options(resume.overrides)
    model = instantiate_checked(cfg.model)
    if init:
        init.check_model(model)
    return Plan(
        resume,
        kind,
        model=model,
        optim=config_from(OptimConfig, cfg.optim, "optim.", "optim"),
        sample=end_of_run_sample(
            OmegaConf.to_container(cfg.sample, resolve=True),
            {override_key(o) for o in given},
        ),
        init=init,
    )


def check_fits_data(kind: ModelKind, data: DictConfig, choices: dict) -> None:
    """Before the data config is instantiated: its interpolations may name keys that only the
    fitting model has (a character GPT's data reads model.block_size). `choices` are Hydra's
    runtime choices, for the message."""
    if data.get("_target_") != kind.datamodule:
        raise ValueError(
            f"model={choices.get('model')} cannot train on data={choices.get('data')}: use "
            f"{kind.data_choices}"
        )


# What a callback may judge by besides the validation metrics: the counters Lightning adds to
# every set of candidates (monitor=step mode=max keeps the latest checkpoints).
COUNTERS = ("step", "epoch")
# A callback's options under which it judges while training rather than at validations: by the
# training metrics too, as Lightning's own check allows then.
JUDGES_WHILE_TRAINING = ("every_n_train_steps", "train_time_interval", "check_on_train_epoch_end")


def check_monitored_metrics(callbacks: DictConfig | None, kind: ModelKind) -> None:
    """Each callback that judges the run by a metric at validations (the checkpoint's
    `monitor`, an early stop's) names one that this kind's validation logs, or a counter, and
    for a metric its `mode` is the way that metric improves. Lightning would find a missing name
    only at the first validation, after the training before it, and under the wrong mode would
    keep the worst checkpoint without a word. Training metrics are refused there too: at a
    validation a training metric holds the value of the last step that logged (every
    trainer.log_every_n_steps), or none yet."""
    metrics = kind.module_class.validation_metrics
    for name, callback in (callbacks or {}).items():
        if not isinstance(callback, DictConfig) or "monitor" not in callback:
            continue
        if any(callback.get(option) for option in JUDGES_WHILE_TRAINING):
            continue
        key, monitor = f"callbacks.{name}", callback.monitor
        target = target_of(callback)
        # a checkpoint callback that monitors nothing keeps the latest checkpoint
        keeps_latest = isinstance(target, type) and issubclass(target, ModelCheckpoint)
        if monitor in COUNTERS or (monitor is None and keeps_latest):
            continue
        check(
            monitor in metrics,
            f"{key}.monitor",
            f"a metric that validation logs for the {kind.name} model ({', '.join(metrics)}), "
            f"{' or '.join(COUNTERS)}"
            + (", or null (keep the latest checkpoint only)" if keeps_latest else ""),
            monitor,
        )
        best, mode = metrics[monitor], callback.get("mode", "min")  # Lightning's default mode
        check(
            mode == best,
            f"{key}.mode",
            f"{best} for {monitor} (its {'lowest' if best == 'min' else 'highest'} is its best)",
            mode,
        )


def check_saves_last(callbacks: DictConfig | None) -> None:
    """The run's checkpoint callback writes last.ckpt: it is what a run continues from
    (ckpt_path=<run dir>, ckpt_path=last) and what tells train.py that a directory holds a run.
    Without it, ckpt_path=last started the run over from scratch, and a new run went ahead in
    the directory, over its best checkpoint."""
    for name, callback in (callbacks or {}).items():
        if not isinstance(callback, DictConfig) or "save_last" not in callback:
            continue
        target = target_of(callback)
        if (
            isinstance(target, type)
            and issubclass(target, RunCheckpoint)
            and not callback.save_last
        ):
            given = str(callback.save_last).lower()
            raise ValueError(
                f"callbacks.{name}.save_last={given}: last.ckpt is what a run "
                "continues from (ckpt_path=<run dir>, ckpt_path=last) and what marks its "
                "directory as holding a run; drop the override (at the best checkpoint's step, "
                "last.ckpt is a second name of that file, not a copy)"
            )


def check_callback_folders(callbacks: DictConfig | None) -> None:
    """The folders callbacks write to (the checkpoints' dirpath, the attention maps' out_dir)
    can be written: the first write comes at the first validation, and a run that cannot make
    its checkpoints' folder failed there, after training, with its checkpoint lost."""
    for name, callback in (callbacks or {}).items():
        for key in ("dirpath", "out_dir"):
            folder = callback.get(key) if isinstance(callback, DictConfig) else None
            if folder:
                given = f"callbacks.{name}.{key}"
                fix = f"give {given}= a directory on a disk you can write to"
                check_writable(Path(folder) / "file", f"{given}={folder}", fix)


def check_data_follows_model(kind: ModelKind, model: DictConfig, data: DictConfig) -> None:
    """The lengths the data and the model share (configs/data/ take the model's): a block
    shorter than the model's would leave its later positions untrained without a word, and a
    longer one cannot go through it."""
    for key in kind.lengths:
        if key in data and key in model and data[key] != model[key]:
            raise ValueError(
                f"data.{key}={data[key]} differs from model.{key}={model[key]}: drop "
                f"data.{key} (it follows model.{key}), or set model.{key}={data[key]}"
            )


def check_no_sample_options(overrides: list[str]) -> None:
    """An encoder-decoder's end-of-run printout decodes validation sources greedily; it takes
    no `sample.*` option, which would otherwise be ignored without a word."""
    given = next((key for key in map(override_key, overrides) if key.startswith("sample.")), None)
    if given is not None:
        raise ValueError(
            f"{given} is for a GPT's end-of-run sample; an encoder-decoder's decodes validation "
            f"sources: drop {given}, and after the run use python generate.py ckpt=<run dir> "
            "source=..."
        )


def check_accelerator(accelerator: object) -> None:
    """trainer.accelerator is one this machine has (cpu and auto always are), by Lightning's own
    test: Lightning would refuse it only after the data module is built, and a TPU without
    torch_xla in a traceback. A name it does not know it refuses in one line itself."""
    if accelerator not in ACCELERATORS:
        return
    found, device, machine = ACCELERATORS[accelerator]
    # Lightning's "gpu" is an Apple GPU where there is one, else CUDA's
    apple_gpu = accelerator == "gpu" and MPSAccelerator.is_available()
    check(
        found.is_available() or apple_gpu,
        "trainer.accelerator",
        f"cpu or auto where torch finds no {device} (use trainer=cpu or trainer=ddp_cpu, or "
        f"{machine})",
        accelerator,
    )


def check_loggers_and_callbacks(cfg: DictConfig) -> None:
    """Each entry under logger and callbacks is a config with a _target_. A key set on an entry
    that the chosen config lacks (`+logger.wandb.offline=false` with logger=none) makes one
    without, and `callbacks.progress_bar=null` leaves one empty: either would reach the Trainer
    as it is and fail there in a traceback, once the data is prepared."""
    for group, kind in (("logger", "logger"), ("callbacks", "callback")):
        for name, node in (cfg.get(group) or {}).items():
            entry = f"{group}.{name}"
            if node is None:
                raise ValueError(f"{entry}=null is no {kind}: to go without it, give ~{entry}")
            if isinstance(node, DictConfig) and "_target_" in node:
                continue
            keys = list(node) if isinstance(node, DictConfig) else []
            given = f"{entry}.{keys[0]}" if keys else entry  # what to drop: a key set on it
            choice = HydraConfig.get().runtime.choices.get(group)
            options = GlobalHydra.instance().config_loader().get_group_options(group)
            fix = f"use {group}={name}" if name in options else f"give {entry}._target_"
            raise ValueError(f"{entry} is no {kind} of {group}={choice}: drop {given}, or {fix}")


def check_trainer_options(trainer: DictConfig) -> None:
    """Trainer options that Lightning takes unchecked: a zero divides by zero once training
    runs, and a negative clipping norm flips every gradient (gradient ascent, silently)."""
    clip = trainer.get("gradient_clip_val")
    check(
        clip is None or (is_number(clip) and clip >= 0),
        "trainer.gradient_clip_val",
        "a number >= 0 or null",
        clip,
    )
    check_int("trainer.log_every_n_steps", trainer.get("log_every_n_steps", 50))
    interval = trainer.get("val_check_interval")  # Lightning checks its other forms itself
    check(
        not (is_number(interval) and interval <= 0),
        "trainer.val_check_interval",
        "a positive integer (training batches)",
        interval,
    )
    train_batches = trainer.get("limit_train_batches")  # 0 would train nothing, in silence
    check(
        train_batches is None
        or is_int(train_batches, 1)
        or (is_number(train_batches) and 0 < train_batches <= 1),
        "trainer.limit_train_batches",
        "a positive integer (batches) or a fraction in (0, 1]",
        train_batches,
    )
    val_batches = trainer.get("limit_val_batches")
    check(
        val_batches is None
        or is_int(val_batches, 0)
        or (is_number(val_batches) and 0 <= val_batches <= 1),
        "trainer.limit_val_batches",
        "an integer >= 0 (batches; 0: no validation) or a fraction in [0, 1]",
        val_batches,
    )
    accelerator = trainer.get("accelerator")
    gpu = CUDAAccelerator.is_available() or MPSAccelerator.is_available()
    if accelerator == "cpu" or (accelerator == "auto" and not gpu):
        # Lightning refuses any other with a TypeError, in a traceback ("0,1" and -1 name GPUs)
        devices = trainer.get("devices")
        processes = int(devices) if isinstance(devices, str) and devices.isdigit() else devices
        check(
            devices == "auto" or is_int(processes, 1),
            "trainer.devices",
            "a positive integer on the CPU (processes: trainer=ddp_cpu runs 2) or auto",
            devices,
        )
    sanity = trainer.get("num_sanity_val_steps")
    check(
        sanity is None or is_int(sanity, -1),
        "trainer.num_sanity_val_steps",
        "an integer >= 0 (validation batches before training), or -1 for all of them",
        sanity,
    )


def end_of_run_sample(options: dict, given_now: set[str]) -> SamplingConfig:
    """train.py's `sample.*`: generate.py's sampling options, less those the end-of-run sample
    cannot honour, which would otherwise fail or be ignored only once the run is over.
    `given_now` are the keys this command's overrides set (not a resumed run's record)."""
    for key, off in GENERATE_ONLY.items():
        if options.get(key) not in (None, False):
            raise ValueError(
                f"sample.{key}={options[key]!r} is generate.py's option, not the end-of-run "
                f"sample's: drop it (or set sample.{key}={off}), and after the run use python "
                f"generate.py ckpt=<run dir> {key}=..."
            )
    if options.get("decoding") == "beam":
        raise ValueError(
            "sample.decoding='beam' is for generate.py on an encoder-decoder; the end-of-run "
            "sample is sample or greedy"
        )
    # generate.py's options, turned off, pass (a resumed run's record may hold them), and so do
    # beam search's from such a record: the code that started the run took them, and ignored
    # them, and a run that cannot be resumed would be lost. The message lists only the
    # end-of-run sample's own options.
    recorded = {key for key in BEAM_OPTIONS if f"sample.{key}" not in given_now}
    given = options.keys() - GENERATE_ONLY.keys() - recorded
    check_known(given, END_OF_RUN_SAMPLE_OPTIONS, "sample.", "sample")
    return SamplingConfig(**options, key_prefix="sample.")
