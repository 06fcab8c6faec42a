"""train.py's Hydra callbacks (configs/train.yaml's hydra.callbacks): checks that must run before
Hydra makes the run directory, where a failure is Hydra's traceback rather than our one line.

Hydra imports this module at every start (it scans hydra_plugins/ for plugins): it is small.
"""

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from errors import check_writable, exit_on_user_error


class WritableOutputDir(Callback):
    """hydra.run.dir (hydra.sweep.dir with -m) is a folder that can be written: on a read-only
    disk Hydra's own mkdir, or its open of train.log, would fail in a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_output_dir(config, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_output_dir(config, "hydra.sweep.dir")


def check_output_dir(config: DictConfig, key: str) -> None:
    """Exit with one line unless the folder at `key` of config can be written (made, where it
    is not there yet)."""
    # Its value may read ${hydra:...}, which resolves against the config Hydra's run_job sets
    # first thing; set here, where that has not happened yet.
    HydraConfig.instance().set_config(config)
    folder = Path(OmegaConf.select(config, key))
    exit_on_user_error(
        lambda: check_writable(
            folder / ".hydra",
            f"{key}={folder}",
            f"give {key}= a directory on a disk you can write to",
        )
    )
