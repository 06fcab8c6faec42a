"""A run's start: importing train.py runs no full collection over the heap the imports build, and
leaves collection on with that heap frozen out of later ones (and out of the one at exit); and
starting W&B does not import W&B Launch unless Launch inputs may have been staged."""

import os
import subprocess
import sys

from helpers import ROOT

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


def start_wandb(tmp_path, stage: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", WANDB_PROBE, str(tmp_path), stage],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_a_wandb_run_starts_without_importing_wandb_launch(tmp_path):
    assert start_wandb(tmp_path, "none") == ["False", "0"]


def test_staged_launch_inputs_still_reach_the_run(tmp_path):
    assert start_wandb(tmp_path, "stage") == ["True", "1"]
