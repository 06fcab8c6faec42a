"""A run's start: importing train.py runs no full collection over the heap the imports build, and
leaves collection on with that heap frozen out of later ones (and out of the one at exit);
starting W&B does not import W&B Launch unless Launch inputs may have been staged; a W&B run
started in the background has imported what logging its first attention map needs; and in a log
the libraries that read data draw no progress bars."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, clean_env
from wandb_offline import config, run_info

PROBE = """
import gc
full_collections = []
gc.callbacks.append(
    lambda phase, info: phase == "start" and info["generation"] == 2 and full_collections.append(1)
)
import train
print(gc.isenabled(), gc.get_freeze_count(), len(full_collections))
"""


def test_importing_train_collects_nothing_and_freezes_what_it_imported():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    enabled, frozen, full_collections = result.stdout.split()
    assert enabled == "True"  # a run's own garbage is still collected
    assert int(frozen) > 100_000  # torch, Lightning and Hydra's objects
    assert full_collections == "0"


BARS_PROBE = """
import sys
if sys.argv[1] == "hub imported first":  # as train.py has it, through its imports
    import huggingface_hub
from data.sources import progress_bars_on_terminals_only
progress_bars_on_terminals_only()
import datasets
from huggingface_hub.utils import are_progress_bars_disabled
print(datasets.utils.are_progress_bars_disabled(), are_progress_bars_disabled())
"""


@pytest.mark.parametrize("order", ["hub imported first", "hub imported later"])
@pytest.mark.parametrize(
    ("settings", "disabled"),
    [({}, "True True"), ({"HF_DATASETS_DISABLE_PROGRESS_BARS": "0"}, "False True")]
    + [({"HF_HUB_DISABLE_PROGRESS_BARS": "0"}, "True False")],
    ids=["unset", "datasets' kept", "the hub's kept"],
)
def test_a_log_gets_no_progress_bars_from_datasets_or_the_hub(order, settings, disabled):
    result = subprocess.run(  # conftest.py took the shell's HF_ settings out of os.environ
        [sys.executable, "-c", BARS_PROBE, order],
        cwd=ROOT,
        env={**os.environ, **settings},
        capture_output=True,  # stderr a pipe, not a terminal
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == disabled


# An offline W&B run started by our logger; with "stage", Launch inputs staged first through
# W&B's public API, with a spy that counts (and passes on) the inputs W&B publishes to the run.
WANDB_PROBE = """
import sys
from training.wandb_run import WandbLogger
published = []
if sys.argv[2] == "stage":
    from wandb.sdk.launch import manage_wandb_config
    import wandb.sdk.launch.inputs.internal as internal
    publish = internal._publish_job_input
    internal._publish_job_input = lambda *args: (published.append(1), publish(*args))
    manage_wandb_config(include=["lr"])
logger = WandbLogger(offline=True, save_dir=sys.argv[1], config={"lr": 0.1})
logger.experiment.finish()
print("wandb.sdk.launch" in sys.modules, len(published))
"""


def wandb_probe(probe: str, run_dir: Path, *arguments: str) -> list[str]:
    """The words a probe prints, given `run_dir` and `arguments`, run in a fresh interpreter
    with W&B offline and quiet, and none of the calling shell's W&B settings (clean_env)."""
    result = subprocess.run(
        [sys.executable, "-c", probe, str(run_dir), *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(run_dir / "cache", WANDB_MODE="offline"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_a_wandb_run_starts_without_importing_wandb_launch(tmp_path):
    assert wandb_probe(WANDB_PROBE, tmp_path, "none") == ["False", "0"]


def test_staged_launch_inputs_still_reach_the_run(tmp_path):
    assert wandb_probe(WANDB_PROBE, tmp_path, "stage") == ["True", "1"]


# An offline W&B run prepared to start in the background, read as Lightning's setup reads it,
# given hyper-parameters, then (with "release") used; finish_wandb settles it either way.
BACKGROUND_PROBE = """
import sys
from pathlib import Path
from training.wandb_run import WandbLogger, finish_wandb
save_dir, run_id, release = sys.argv[1:]
logger = WandbLogger(offline=True, save_dir=save_dir, id=None if run_id == "-" else run_id)
logger.start_in_background()
stand_in = logger.experiment
logger.log_hyperparams({"lr": 0.1})
known = logger.version  # for the progress bar and checkpoint paths, before the run is up
started = "wandb" in sys.modules or any(Path(save_dir).glob("wandb/offline-run-*"))
used = "unused"
if release == "release":
    logger.release_start()
    try:
        used = stand_in.id  # its first use waits for the run
    except Exception as error:
        used = type(error).__name__
finish_wandb()
print(type(stand_in).__name__, started, used, known)
"""


def start_in_background(tmp_path, run_id: str, release: str) -> list[str]:
    return wandb_probe(BACKGROUND_PROBE, tmp_path, run_id, release)


def test_a_run_started_in_the_background_gets_what_was_logged_before_it_was_up(tmp_path):
    # Until released, nothing of W&B is imported or written: the first step does not wait.
    assert start_in_background(tmp_path, "bg1", "release") == [
        "StartingRun",
        "False",
        "bg1",
        "bg1",
    ]
    assert run_info(tmp_path)["id"] == "bg1"
    assert config(tmp_path)["lr"] == 0.1


def test_a_run_started_in_the_background_has_its_id_from_the_start(tmp_path):
    kind, started, used, known = start_in_background(tmp_path, "-", "release")
    assert (kind, started) == ("StartingRun", "False")
    assert used == known == run_info(tmp_path)["id"] and len(known) == 8


def test_a_failed_start_in_the_background_is_raised_at_the_runs_first_use(tmp_path):
    # W&B refuses this id: the error reaches whoever uses the run, not a thread's log
    words = start_in_background(tmp_path, "bad/id", "release")
    assert words[:3] == ["StartingRun", "False", "UsageError"]


def test_a_start_never_released_is_never_begun(tmp_path):
    # a run that fails before its first step leaves no W&B run behind
    assert start_in_background(tmp_path, "bg2", "hold") == [
        "StartingRun",
        "False",
        "unused",
        "bg2",
    ]
    assert not list(tmp_path.glob("wandb/offline-run-*"))


# A logger prepared to start in the background, copied as Lightning's ddp_spawn copies it.
PICKLE_PROBE = """
import pickle, sys
from training.wandb_run import WandbLogger, finish_wandb
logger = WandbLogger(offline=True, save_dir=sys.argv[1])
logger.start_in_background()
copy = pickle.loads(pickle.dumps(logger))
print(copy.version == logger.experiment.id, copy._starting())
finish_wandb()
"""


def test_a_logger_starting_in_the_background_can_be_copied_to_another_process(tmp_path):
    # the copy names the run, started first, and has no starter of its own
    assert wandb_probe(PICKLE_PROBE, tmp_path) == ["True", "False"]


# An offline run started in the background, then an attention map (a tiny PNG written by hand:
# the drawing process's pictures never pass through this one) logged as the training thread
# logs it; the modules that log call imported.
IMAGE_PROBE = """
import struct, sys, zlib
from pathlib import Path
from training.wandb_run import WandbLogger, finish_wandb


def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


picture = Path(sys.argv[1]) / "map.png"
rows = b"".join(b"\\x00" + bytes([row * 60, 0, 0] * 4) for row in range(4))
header = struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0)  # 4 x 4, 8-bit RGB
picture.write_bytes(b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", header)
                    + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
logger = WandbLogger(offline=True, save_dir=sys.argv[1])
logger.start_in_background()
logger.release_start()
logger.wait_for_start()
import wandb
before = set(sys.modules)
logger.log_metrics({"attention/map": wandb.Image(str(picture))}, step=1)
print("none", *sorted({name.split(".")[0] for name in set(sys.modules) - before}))
finish_wandb()
"""


def test_the_first_attention_map_logged_imports_nothing_on_the_training_thread(tmp_path):
    # W&B's first image imports pandas (half a second); the background start imports it first.
    assert wandb_probe(IMAGE_PROBE, tmp_path) == ["none"]
