"""train.py's start: importing it runs no full collection over the heap the imports build, and
leaves collection on with that heap frozen out of later ones (and out of the one at exit)."""

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
