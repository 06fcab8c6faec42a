"""Attention maps drawn in a process of their own, so that training never waits for matplotlib.

Drawing a layer's heads takes 0.1-1 s of Python, which on the training thread stalls every
step behind it (88 s of a 302 s GPU run). The training process records the maps on its device
and sends them here as numpy arrays; a plain Python process (not a fork of the trainer: it
imports numpy and matplotlib only, no torch, whose import the last maps of a run would otherwise
wait for) draws each into a PNG file at low priority and answers with the path, which the
callback then logs.
"""

import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from model.figures import HeadMaps

# The project's root: the drawing process runs there.
ROOT = Path(__file__).resolve().parents[1]

# The drawing process lowers its priority before it imports anything: it starts beside the
# first training step, which on a 2-core CPU its imports would otherwise slow.
SERVE = "import os; os.nice(19); from training.map_drawing import serve; serve()"


@dataclass
class MapJob:
    """One figure: the maps of one layer."""

    step: int
    key: str  # the logged name, e.g. attention/layer0/attn
    path: str  # the PNG file to write
    title: str
    maps: list[HeadMaps]
    query_labels: list[str] | None
    key_labels: list[str] | None


@dataclass
class DrawnMap:
    step: int
    key: str
    path: str | None  # None: drawing failed, `error` says why
    seconds: float
    error: str | None = None


class MapDrawer:
    """The parent's side: submit() never blocks; drawn() returns the maps finished so far (all
    of them with wait=True); close() ends the drawing process. If the process dies (killed by
    a scheduler, out of memory), drawn() returns what came back and `failure` says why:
    training never fails for a picture."""

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=ROOT,  # the project's own packages, not same-named ones where the run started
            start_new_session=True,  # a Ctrl-C at the terminal is the trainer's to handle
        )
        self._outbox: queue.Queue = queue.Queue()
        self._inbox: queue.Queue = queue.Queue()
        self.pending = 0
        self.failure: str | None = None
        # Threads move the pickles through the pipes: a full pipe blocks them, never training.
        threading.Thread(target=self._send, daemon=True).start()
        threading.Thread(target=self._receive, daemon=True).start()

    def _send(self) -> None:
        try:
            for job in iter(self._outbox.get, None):
                pickle.dump(job, self._process.stdin)
                self._process.stdin.flush()
            self._process.stdin.close()
        except BrokenPipeError:
            pass  # the process was ended (close(wait=False)) or died: drawn() says so

    def _receive(self) -> None:
        try:
            while True:
                self._inbox.put(pickle.load(self._process.stdout))
        except (EOFError, OSError, pickle.UnpicklingError):
            self._inbox.put(None)  # the process ended
            self._process.stdout.close()  # here, where nothing reads it any more

    def submit(self, job: MapJob) -> None:
        self.pending += 1
        self._outbox.put(job)

    def drawn(self, wait: bool = False) -> list[DrawnMap]:
        maps = []
        while self.pending and self.failure is None:
            try:
                reply = self._inbox.get(block=wait)
            except queue.Empty:
                break
            if reply is None:
                self.failure = (
                    f"the drawing process ended (status {self._process.wait()}) with "
                    f"{self.pending} maps undrawn"
                )
                break
            self.pending -= 1
            maps.append(reply)
        return maps

    def close(self, wait: bool = True) -> None:
        """End the process: once the maps submitted are drawn, or at once (wait=False)."""
        self._outbox.put(None)
        try:
            self._process.wait(timeout=30 if wait else 0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def draw(job: MapJob) -> DrawnMap:
    from matplotlib.image import imsave

    from model.figures import figure_to_array, plot_heads

    started = time.perf_counter()
    figure = plot_heads(job.maps, job.query_labels, job.key_labels, job.title)
    Path(job.path).parent.mkdir(parents=True, exist_ok=True)
    imsave(job.path, figure_to_array(figure))
    return DrawnMap(job.step, job.key, job.path, time.perf_counter() - started)


def serve() -> None:
    """Draw jobs from stdin until it closes; answer each on stdout."""
    jobs, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a library's print goes to stderr, not into the replies
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return
        try:
            reply = draw(job)
        except Exception as error:  # a map that cannot be drawn must not end the others
            reply = DrawnMap(job.step, job.key, None, 0.0, f"{type(error).__name__}: {error}")
        pickle.dump(reply, replies)
        replies.flush()
