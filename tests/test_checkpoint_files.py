"""Checkpoint files: a write killed at any moment leaves the previous checkpoint whole, writes
in the background keep the state of the moment they were asked for and their order, loading
never runs pickled code, and compiled and plain models share one state-dict layout."""

import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, damage_checkpoint, small_disk, tiny_gpt_config
from model.checkpoint import find_checkpoint, load_safely, model_state
from model.gpt import GPT
from training.checkpoint_io import DurableCheckpointIO, host_copy, partial_files, save_durably

# Saves a new checkpoint over argv[1], with a fault that kills the process (SIGKILL) midway:
# "fsync" after the whole file is written but before its rename, "write" once half of its bytes
# are on disk. The writer kills itself at that point, so no machine is too slow or too fast.
WRITER = """
import io, os, signal, sys
from pathlib import Path
import torch
sys.path.insert(0, {root!r})
from training import checkpoint_io

path, fault = Path(sys.argv[1]), sys.argv[2]
if fault == "fsync":
    os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
else:
    real_save = torch.save

    def half_save(obj, f):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_io.torch.save = half_save
checkpoint_io.save_durably({{"step": 2, "weights": torch.full((1 << 20,), 2.0)}}, path)
"""


@pytest.mark.parametrize("fault", ["fsync", "write"])
def test_checkpoint_write_killed_midway_leaves_previous_one_loadable(tmp_path, fault):
    path = tmp_path / "checkpoints" / "last.ckpt"
    save_durably({"step": 1, "weights": torch.ones(4)}, path)
    before = path.read_bytes()
    writer = subprocess.run(
        [sys.executable, "-c", WRITER.format(root=str(ROOT)), str(path), fault],
        capture_output=True,
        timeout=300,
    )
    assert writer.returncode == -signal.SIGKILL, writer.stderr.decode()
    (partial,) = partial_files(path)
    if fault == "write":  # the kill came with half of the new file on disk
        assert partial.stat().st_size > 2 << 20

    assert path.read_bytes() == before
    assert load_safely(path)["step"] == 1
    # The half-written file is hidden and is no *.ckpt: nothing that looks for checkpoints
    # (generate.py ckpt=<run dir>, ckpt_path=last) can pick it.
    assert list(path.parent.glob("*.ckpt")) == [path]
    # The next save goes through, beside the leftover.
    save_durably({"step": 3, "weights": torch.zeros(4)}, path)
    assert load_safely(path)["step"] == 3 and partial_files(path) == [partial]


class RunsCode:
    """A pickle payload that, when unpickled, would create a file: a stand-in for any code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_checkpoint_that_would_run_code_is_refused(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": RunsCode(marker)}, path)
    with pytest.raises(ValueError, match=f"{path} is not a readable tinyformer checkpoint"):
        load_safely(path)
    assert not marker.exists()
    # A plain pickle file is refused the same way.
    path.write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(ValueError, match="not a readable tinyformer checkpoint"):
        load_safely(path)
    assert not marker.exists()


def test_truncated_checkpoint_error_names_the_file(tmp_path):
    path = tmp_path / "last.ckpt"
    save_durably({"weights": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(ValueError, match=f"^{path} is not a readable tinyformer checkpoint"):
        load_safely(path)


def test_a_damaged_checkpoint_is_refused_naming_it(tmp_path):
    """torch.load does not check the archive's checksums: the damaged bytes loaded as weights."""
    path = tmp_path / "last.ckpt"
    save_durably({"weights": torch.ones(1000)}, path)
    assert torch.equal(load_safely(path)["weights"], torch.ones(1000))
    damage_checkpoint(path)
    with pytest.raises(ValueError, match=f"^{path} is damaged: its .* does not match"):
        load_safely(path)
    assert not torch.equal(load_safely(path, mmap=True)["weights"], torch.ones(1000))


def test_compiled_and_plain_models_load_each_others_weights():
    config = tiny_gpt_config(11, block_size=8, n_layer=1, n_embd=16)
    plain = GPT(config)
    in_place = GPT(config)
    in_place.compile()  # what train.py's compile=true does: the keys do not change
    assert in_place.state_dict().keys() == plain.state_dict().keys()
    in_place.load_state_dict(plain.state_dict())

    wrapped = torch.compile(GPT(config))  # torch.compile's wrapper prefixes `_orig_mod.`
    state = {f"model.{key}": value for key, value in wrapped.state_dict().items()}
    assert all("_orig_mod." in key for key in state)
    plain.load_state_dict(model_state(state))
    for key, value in wrapped.state_dict().items():
        assert torch.equal(plain.state_dict()[key.removeprefix("_orig_mod.")], value)
    wrapped.load_state_dict({f"_orig_mod.{k}": v for k, v in plain.state_dict().items()})


def test_a_full_disk_while_checkpointing_is_one_error_and_keeps_the_previous_checkpoint(tmp_path):
    with small_disk(tmp_path / "disk", "256k") as disk:
        path = disk / "checkpoints" / "last.ckpt"
        save_durably({"step": 1, "weights": torch.ones(1 << 10)}, path)  # 4 kB: it fits
        with pytest.raises(ValueError) as error:
            save_durably({"step": 2, "weights": torch.ones(1 << 18)}, path)  # 1 MB: it does not
        message = str(error.value)
        remaining = sorted(p.name for p in path.parent.iterdir())
        step = load_safely(path)["step"]
    assert message.startswith(
        f"no space left on the disk of {path.parent} to write last.ckpt (the previous checkpoint "
        f"is intact): free some space and resume with ckpt_path={disk}"
    )
    assert "\n" not in message
    assert step == 1 and remaining == ["last.ckpt"]  # the previous one, and no half-written file


def test_a_full_disk_at_the_first_checkpoint_says_there_is_nothing_to_resume(tmp_path):
    with small_disk(tmp_path / "disk", "256k") as disk:
        path = disk / "checkpoints" / "best-step10.ckpt"
        with pytest.raises(ValueError) as error:
            save_durably({"step": 10, "weights": torch.ones(1 << 18)}, path)  # 1 MB: no room
        remaining = list(path.parent.iterdir())
    assert str(error.value) == (
        f"no space left on the disk of {path.parent} to write best-step10.ckpt (no checkpoint "
        "was saved before it): free some space and start again"
    )
    assert remaining == []


def test_a_checkpoint_written_in_the_background_holds_the_state_of_its_save(tmp_path):
    checkpoint_io = DurableCheckpointIO()
    weights = torch.ones(1 << 22)  # 16 MB: its write is still under way when the save returns
    path = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint_io.save_checkpoint({"step": 1, "weights": weights}, path)
    weights.add_(1)  # the next optimizer step, in place, while the file is written
    checkpoint_io.teardown()
    assert torch.equal(load_safely(path)["weights"], torch.ones(1 << 22))
    assert checkpoint_io.write_seconds > 0


def test_background_writes_links_and_removals_keep_the_order_they_were_asked_in(tmp_path):
    checkpoint_io = DurableCheckpointIO()
    folder = tmp_path / "checkpoints"
    first, second, last = folder / "step=1.ckpt", folder / "step=2.ckpt", folder / "last.ckpt"
    checkpoint_io.save_checkpoint({"step": 1, "weights": torch.ones(1 << 22)}, first)
    checkpoint_io.link(first, last)  # asked for while first is being written
    checkpoint_io.save_checkpoint({"step": 2, "weights": torch.zeros(1 << 22)}, second)
    checkpoint_io.link(second, last)
    checkpoint_io.remove_checkpoint(first)
    checkpoint_io.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=2.ckpt"]
    assert last.stat().st_ino == second.stat().st_ino and load_safely(last)["step"] == 2


def test_a_full_disk_in_a_background_write_fails_the_next_save_and_drops_what_was_queued_after(
    tmp_path,
):
    with small_disk(tmp_path / "disk", "256k") as disk:
        checkpoint_io = DurableCheckpointIO()
        folder = disk / "checkpoints"
        best, new_best, last = folder / "best-1.ckpt", folder / "best-2.ckpt", folder / "last.ckpt"
        checkpoint_io.save_checkpoint({"step": 1, "weights": torch.ones(1 << 10)}, best)
        checkpoint_io.link(best, last)
        checkpoint_io.save_checkpoint({"step": 2, "weights": torch.ones(1 << 18)}, new_best)  # 1 MB
        # what Lightning asks for next, had step 2's write worked: neither may run now
        checkpoint_io.remove_checkpoint(best)
        checkpoint_io.link(new_best, last)
        with pytest.raises(ValueError) as error:  # the write of step 2 failed meanwhile
            checkpoint_io.save_checkpoint({"step": 3, "weights": torch.ones(1 << 10)}, last)
        checkpoint_io.teardown()
        remaining = sorted(p.name for p in folder.iterdir())
        steps = load_safely(best)["step"], load_safely(last)["step"]
    assert str(error.value).startswith(f"no space left on the disk of {folder}")
    assert remaining == ["best-1.ckpt", "last.ckpt"] and steps == (1, 1)


def test_a_failed_write_found_while_the_run_already_fails_is_reported_not_raised(tmp_path, capsys):
    with small_disk(tmp_path / "disk", "256k") as disk:
        checkpoint_io = DurableCheckpointIO()
        checkpoint_io.save_checkpoint({"weights": torch.ones(1 << 18)}, disk / "last.ckpt")
        with pytest.raises(RuntimeError, match="the run's own failure"):
            try:
                raise RuntimeError("the run's own failure")
            finally:  # as Lightning tears down a failing run: the run's error must go on
                checkpoint_io.teardown()
    assert "warning: a checkpoint write failed: no space left" in capsys.readouterr().err


def test_tied_weights_are_written_once_from_the_background(tmp_path):
    model = GPT(tiny_gpt_config(4096, block_size=8, n_layer=1, n_embd=64))  # embedding: 1 MB
    checkpoint_io = DurableCheckpointIO()
    path = tmp_path / "last.ckpt"
    checkpoint_io.save_checkpoint({"state_dict": model.state_dict()}, path)
    checkpoint_io.teardown()
    state = load_safely(path)["state_dict"]
    head, embedding = state["lm_head.weight"], state["tok_emb.weight"]
    assert head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr()
    assert torch.equal(head, model.tok_emb.weight)
    assert path.stat().st_size < 1.5 * embedding.nbytes  # the embedding once, and a little more


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's tensors")
def test_a_gpus_tensors_are_copied_whole_into_pinned_memory_as_they_were_at_the_save():
    values = torch.arange(1 << 24, dtype=torch.float32)  # 64 MB: the copy takes milliseconds
    weights = values.to("cuda")
    view = weights[16:32].view(4, 4)  # a view of the same storage, at an offset
    copied = host_copy({"weights": weights, "view": view, "step": 3})
    weights.add_(1)  # the next optimizer step: queued after the copies, so it cannot reach them
    # read at once, with no wait here: the copies must be complete when host_copy returns
    assert torch.equal(copied["weights"], values) and copied["weights"].is_pinned()
    assert torch.equal(copied["view"], values[16:32].view(4, 4))
    storages = {copied[k].untyped_storage().data_ptr() for k in ("weights", "view")}
    assert len(storages) == 1 and copied["step"] == 3


def test_a_failed_background_save_drops_the_removal_and_link_queued_after_it(tmp_path):
    folder = tmp_path / "checkpoints"
    best, last = folder / "best-1.ckpt", folder / "last.ckpt"
    checkpoint_io = DurableCheckpointIO()
    checkpoint_io.save_checkpoint({"step": 1}, best)
    checkpoint_io.link(best, last)
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")  # a file where the new checkpoint's folder should be
    checkpoint_io.save_checkpoint({"step": 2}, unwritable / "best-2.ckpt")
    checkpoint_io.remove_checkpoint(best)  # what Lightning asks for once step 2 is the best
    checkpoint_io.link(unwritable / "best-2.ckpt", last)
    with pytest.raises(OSError):
        checkpoint_io.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["best-1.ckpt", "last.ckpt"]
    assert load_safely(best)["step"] == load_safely(last)["step"] == 1


def test_without_background_a_failed_save_fails_at_once(tmp_path):
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    background, at_once = DurableCheckpointIO(), DurableCheckpointIO(background=False)
    background.save_checkpoint({"step": 1}, unwritable / "last.ckpt")  # fails on the writer
    with pytest.raises(OSError):  # for loggers that read checkpoints as soon as they are saved
        at_once.save_checkpoint({"step": 1}, unwritable / "last.ckpt")
    with pytest.raises(OSError):
        background.wait()


def test_of_several_best_checkpoints_a_run_directory_gives_the_one_its_record_names(
    tmp_path, trained_run
):
    # save_top_k=2: the latest best*.ckpt is the second best, and its checkpoint callback's
    # record (Lightning's own, as the trained run wrote it) names the best, in the run's
    # directory of the time. Latest by step: a copied folder's file times say nothing.
    (real,) = (trained_run / "checkpoints").glob("best*.ckpt")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    best, second = folder / "best-step20.ckpt", folder / "best-step40.ckpt"
    shutil.copyfile(real, best)
    checkpoint = torch.load(real, weights_only=True)
    checkpoint["global_step"] += 20
    (record,) = [r for r in checkpoint["callbacks"].values() if "best_model_path" in r]
    record["best_model_path"] = f"/where/it/ran/checkpoints/{best.name}"
    torch.save(checkpoint, second)
    os.utime(second, (1, 1))  # the older file all the same
    assert find_checkpoint(tmp_path / "run", "best", "ckpt") == best
    record["best_model_path"] = f"/where/it/ran/checkpoints/{second.name}"
    torch.save(checkpoint, second)
    assert find_checkpoint(tmp_path / "run", "best", "ckpt") == second
    # A record naming a file that is gone: the latest.
    record["best_model_path"] = "/where/it/ran/checkpoints/best-step60.ckpt"
    torch.save(checkpoint, second)
    assert find_checkpoint(folder, "best", "ckpt") == second
