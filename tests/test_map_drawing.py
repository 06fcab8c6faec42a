"""The attention-map drawing process (training/map_drawing.py): what the trainer sends comes back
drawn as PNG files, a map that cannot be drawn is reported without ending the others, and
close() ends the process."""

import os
import pickle
import subprocess
import sys

import numpy as np
from matplotlib.image import imread

from model.figures import HeadMaps
from training.map_drawing import ROOT, MapDrawer, MapJob


def job(tmp_path, step: int, shape: tuple = (2, 3, 3), labels: list[str] | None = None) -> MapJob:
    weights = np.full(shape, 1 / 3, dtype=np.float32)
    return MapJob(
        step=step,
        key="attention/layer0/attn",
        path=str(tmp_path / f"map{step}.png"),
        title=f"step {step}",
        maps=[HeadMaps("layer0/attn", weights, np.zeros(len(weights)))],
        query_labels=labels,
        key_labels=labels,
    )


def test_maps_are_drawn_in_another_process_and_failures_reported(tmp_path):
    drawer = MapDrawer()
    try:
        drawer.submit(job(tmp_path, 10, labels=["a", "b", "c"]))
        drawer.submit(job(tmp_path, 20, shape=(2, 3)))  # no query axis: cannot be drawn
        drawer.submit(job(tmp_path, 30, shape=(4, 3, 3)))
        drawn = drawer.drawn(wait=True)
        # the lowest priority (set before its imports): the trainer's CPU time comes first
        assert os.getpriority(os.PRIO_PROCESS, drawer._process.pid) == 19
    finally:
        drawer.close()
    assert [(d.step, d.path is None) for d in drawn] == [(10, False), (20, True), (30, False)]
    assert drawn[1].error
    wide, narrow = imread(drawn[2].path), imread(drawn[0].path)
    assert wide.shape[1] > narrow.shape[1] > 100  # four head panels against two
    assert drawer._process.returncode == 0
    assert drawer.drawn() == [] and drawer.failure is None


def test_close_without_waiting_ends_the_process_at_once(tmp_path):
    drawer = MapDrawer()
    for step in range(50):
        drawer.submit(job(tmp_path, step, shape=(8, 48, 48)))
    drawer.close(wait=False)
    assert drawer._process.returncode is not None
    assert len(list(tmp_path.glob("*.png"))) < 50


def test_a_killed_drawing_process_is_reported_not_raised(tmp_path):
    drawer = MapDrawer()
    drawer._process.kill()  # as a scheduler's SIGKILL or the OOM killer would
    drawer.submit(job(tmp_path, 10))
    assert drawer.drawn(wait=True) == []
    assert drawer.failure.startswith("the drawing process ended (status -9) with 1 maps undrawn")
    assert drawer.drawn(wait=True) == []  # and later calls return at once
    drawer.close()


DRAW_AND_LIST_IMPORTS = """
import pickle, sys
from training.map_drawing import draw
draw(pickle.loads(sys.stdin.buffer.read()))
print(sorted(name for name in ("torch", "numpy", "matplotlib") if name in sys.modules))
"""


def test_the_drawing_process_draws_without_importing_torch(tmp_path):
    # torch takes seconds to import on a small CPU, which the last maps of a run waited for
    drawing = job(tmp_path, 10, labels=["a", "b", "c"])
    result = subprocess.run(
        [sys.executable, "-c", DRAW_AND_LIST_IMPORTS],
        input=pickle.dumps(drawing),
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    assert result.stdout.decode().strip().splitlines()[-1] == "['matplotlib', 'numpy']"
    assert imread(drawing.path).shape[1] > 100
