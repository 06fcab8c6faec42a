"""The prepared-data cache under real faults: a build killed while its worker processes live on,
a process waiting for another's build, damaged entries, a source file edited behind the
cache's back, and a full disk. Each test makes its fault happen rather than imitating its
symptoms, and the cache must neither hang, nor load damaged data, nor need a manual delete."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import pytest

import data.lm
from data.cache import write_marker
from data.lm import LMDataModule, TokenWriter
from data.seq2seq import Seq2SeqDataModule
from helpers import ROOT, TINY, clean_env, run_script, small_disk

PARAGRAPHS = [
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * 7}." for i in range(200)
]


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(PARAGRAPHS) + "\n")
    return path


def prepared(corpus: Path, cache: Path) -> LMDataModule:
    module = LMDataModule(
        source="text_files", paths=[str(corpus)], block_size=8, batch_size=4, cache_dir=str(cache)
    )
    module.prepare_data()
    module.setup()
    return module


def token_lists(module: LMDataModule) -> dict[str, list[int]]:
    return {split: module._split(split).tolist() for split in ("train", "val")}


def leftovers(cache: Path) -> list[str]:
    """The temporary build directories under the cache's LM entries."""
    return [p.name for p in (cache / "lm").glob(".tmp-*")]


def wait_until(condition: Callable[[], bool], what: str, seconds: float = 300) -> None:
    # Generous: what is waited for starts a Python that imports torch, 19 s on a loaded 2-core CI
    # machine
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


# --- A build killed while its workers live on ---------------------------------------------------

# Prepares the corpus with two `datasets.map` workers, which say they have started and then
# stay inside the map, so the test kills their parent at a known point: mid-build, pool alive.
BUILD_WITH_STUCK_WORKERS = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import data.lm

    corpus, cache = sys.argv[1:]

    def split_slowly(*args, **kwargs):
        Path(cache, f"worker-{os.getpid()}").touch()
        time.sleep(600)

    data.lm._split_rows = split_slowly
    module = data.lm.LMDataModule(
        source="text_files", paths=[corpus], block_size=8, num_proc=2, cache_dir=cache
    )
    module.prepare_data()
    """
)

PREPARE = textwrap.dedent(
    """
    import json, sys
    from data.lm import LMDataModule

    corpus, cache = sys.argv[1:]
    module = LMDataModule(source="text_files", paths=[corpus], block_size=8, cache_dir=cache)
    module.prepare_data()
    module.setup()
    print(json.dumps({"hit": module.cache_hit, "train": module._split("train").tolist()}))
    """
)
NEXT_RUN_SECONDS = 120  # a fresh run prepares this corpus in about 5 s


@pytest.mark.slow
def test_a_run_killed_mid_build_with_its_workers_alive_does_not_block_the_next(corpus, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    env = clean_env(cache, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-c", BUILD_WITH_STUCK_WORKERS, str(corpus), str(cache)]
    # A process group of its own, so that the test can end the orphaned workers too.
    killed = subprocess.Popen(
        command, env=env, cwd=ROOT, start_new_session=True, stderr=subprocess.DEVNULL
    )
    try:
        wait_until(lambda: len(list(cache.glob("worker-*"))) == 2, "the two map workers")
        assert leftovers(cache)  # mid-build: its temporary directory is there
        killed.kill()
        killed.wait()
        os.killpg(killed.pid, 0)  # raises if no process of its group is left: its workers live
        command = [sys.executable, "-c", PREPARE, str(corpus), str(cache)]
        try:
            after = subprocess.run(
                command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=NEXT_RUN_SECONDS
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"the next run still waited for the killed run after {NEXT_RUN_SECONDS} s")
    finally:
        with suppress(ProcessLookupError):
            os.killpg(killed.pid, signal.SIGKILL)
    assert after.returncode == 0, after.stderr[-3000:]
    result = json.loads(after.stdout.splitlines()[-1])
    assert result["hit"] is False and len(result["train"]) > 1000
    assert leftovers(cache) == []  # the killed build's directory is gone, not left as litter


def test_num_proc_1_maps_in_this_process_without_a_pool(corpus, tmp_path, monkeypatch):
    """A pool, even of one worker, is a set of forked processes that outlive a killed parent."""
    mapped_in = []
    split_rows = data.lm._split_rows

    def recording_split_rows(*args, **kwargs):
        mapped_in.append(os.getpid())  # lands in this list only when run by this process
        return split_rows(*args, **kwargs)

    monkeypatch.setattr(data.lm, "_split_rows", recording_split_rows)
    prepared(corpus, tmp_path)
    assert set(mapped_in) == {os.getpid()}


# A build that holds the entry's lock until the test creates the file `release`.
LOCKED_BUILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import data.cache
    from data.cache import build_once, write_marker

    entry, flags, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    data.cache.WAIT_NOTICE_SECONDS = 0.5

    def build(out):
        (flags / f"building-{name}").touch()
        while not (flags / "release").exists():
            time.sleep(0.05)
        (out / "data.bin").write_bytes(b"built by " + name.encode())
        write_marker(out, {})

    # Both start together; the waiter asks for the entry once the builder holds its lock.
    while name == "waiter" and not (flags / "building-builder").exists():
        time.sleep(0.05)
    print(build_once(entry, build))
    """
)


@pytest.mark.slow
def test_a_process_waiting_for_a_build_says_once_which_process_builds_it(tmp_path):
    entry, flags = tmp_path / "cache" / "lm" / "0123456789ab", tmp_path / "flags"
    flags.mkdir()
    env = clean_env(tmp_path / "cache", PYTHONPATH=str(ROOT))

    def start(name: str, stderr) -> subprocess.Popen:
        command = [sys.executable, "-c", LOCKED_BUILD, str(entry), str(flags), name]
        return subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True
        )

    waiter_log = tmp_path / "waiter.stderr"
    with open(waiter_log, "w") as waiter_stderr:
        builder = start("builder", subprocess.DEVNULL)
        try:
            waiter = start("waiter", waiter_stderr)
            try:
                wait_until(lambda: "waiting" in waiter_log.read_text(), "the notice")
                time.sleep(1)  # waiting on, it says nothing more
                (flags / "release").touch()
                outputs = [p.communicate(timeout=60)[0].strip() for p in (builder, waiter)]
            finally:
                waiter.kill()
        finally:
            builder.kill()
    assert outputs == ["False", "True"]  # the waiter reused the builder's entry
    assert (entry / "data.bin").read_bytes() == b"built by builder"
    holder = f"process {builder.pid} on {socket.gethostname()}"
    notice = f"waiting for {holder} to finish building the cache entry {entry}"
    assert waiter_log.read_text().splitlines() == [notice]
    assert not (flags / "building-waiter").exists()


# --- Damaged entries ----------------------------------------------------------------------------


def truncate(path: Path, by: int) -> None:
    os.truncate(path, path.stat().st_size - by)


def flip_a_byte(path: Path) -> None:
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0xFF
    path.write_bytes(bytes(content))


def meta_without_checksums(entry: Path) -> None:
    """meta.json as versions before the checksums wrote it."""
    meta = json.loads((entry / "meta.json").read_text())
    del meta["files"]
    (entry / "meta.json").write_text(json.dumps(meta))


def meta_replaced_by_a_folder(entry: Path) -> None:
    """An unreadable meta.json (tests run as root, for whom permissions do not stop a read)."""
    (entry / "meta.json").unlink()
    (entry / "meta.json").mkdir()


DAMAGES = [
    # 64 bytes: whole uint16 tokens gone, so the short file still reads as an array
    pytest.param(lambda e: truncate(e / "train.bin", 64), "train.bin is", id="train.bin-truncated"),
    pytest.param(lambda e: flip_a_byte(e / "train.bin"), "checksum", id="train.bin-corrupted"),
    pytest.param(lambda e: (e / "val.bin").unlink(), "val.bin is missing", id="val.bin-missing"),
    pytest.param(lambda e: truncate(e / "tokenizer.json", 10), "tokenizer.json is", id="tokenizer"),
    pytest.param(
        lambda e: truncate(e / "tinyformer_tokenizer.json", 10),
        "tinyformer_tokenizer.json is",
        id="tokenizer-extras",
    ),
    pytest.param(lambda e: (e / "meta.json").unlink(), "no meta.json", id="meta.json-missing"),
    pytest.param(meta_replaced_by_a_folder, "cannot be read", id="meta.json-unreadable"),
    pytest.param(
        lambda e: (e / "meta.json").write_text('{"dtype": "uint1'), "cannot be read", id="garbage"
    ),
    pytest.param(meta_without_checksums, "no file sizes", id="meta.json-of-an-older-version"),
]


@pytest.mark.parametrize("damage, problem", DAMAGES)
def test_a_damaged_entry_is_rebuilt_saying_why_in_one_line(
    corpus, tmp_path, capsys, damage, problem
):
    intact = prepared(corpus, tmp_path)
    entry, tokens = intact.cache_entry, token_lists(intact)
    damage(entry)
    capsys.readouterr()
    rebuilt = prepared(corpus, tmp_path)
    stderr = capsys.readouterr().err
    assert not rebuilt.cache_hit
    assert token_lists(rebuilt) == tokens
    notices = [line for line in stderr.splitlines() if str(entry) in line]
    assert len(notices) == 1 and notices[0].startswith("rebuilding the cache entry"), stderr
    assert problem in notices[0] and "Traceback" not in stderr
    assert leftovers(tmp_path) == []
    assert prepared(corpus, tmp_path).cache_hit  # and now it is whole again


def test_an_entry_with_a_tokenizer_json_of_the_old_format_is_still_used(corpus, tmp_path):
    intact = prepared(corpus, tmp_path)
    entry, tokens = intact.cache_entry, token_lists(intact)
    # What versions before wrote: our tokenizer dict as tokenizer.json, alone, and checksummed.
    (entry / "tokenizer.json").write_text(json.dumps(intact.tokenizer.to_dict()))
    (entry / "tinyformer_tokenizer.json").unlink()
    meta = json.loads((entry / "meta.json").read_text())
    del meta["files"]
    write_marker(entry, meta)
    reused = prepared(corpus, tmp_path)
    assert reused.cache_hit and token_lists(reused) == tokens
    assert reused.tokenizer.to_dict() == intact.tokenizer.to_dict()


def test_a_damaged_seq2seq_entry_is_rebuilt(tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"source": f"question {i}?", "target": f"answer {i * 3}."} for i in range(40)]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))

    def prepare() -> Seq2SeqDataModule:
        module = Seq2SeqDataModule(
            task="pairs", paths=[str(pairs)], batch_size=4, cache_dir=str(tmp_path / "cache")
        )
        module.prepare_data()
        module.setup()
        return module

    intact = prepare()
    truncate(intact.cache_entry / "train_target_ids.npy", 2)  # np.load would refuse it
    rebuilt = prepare()
    assert not rebuilt.cache_hit
    assert rebuilt.val_pairs(100) == intact.val_pairs(100)
    assert "train_target_ids.npy is" in capsys.readouterr().err


# --- A source edited behind the cache's back ----------------------------------------------------


def test_an_edit_that_keeps_the_size_and_restores_the_mtime_gets_a_new_entry(corpus, tmp_path):
    first = prepared(corpus, tmp_path)
    before = corpus.stat()
    corpus.write_text(corpus.read_text().replace("quick", "QUICK"))  # same length
    os.utime(corpus, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = corpus.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    edited = prepared(corpus, tmp_path)
    assert not edited.cache_hit and edited.cache_entry != first.cache_entry
    text = edited.tokenizer.decode(token_lists(edited)["train"])
    assert "QUICK" in text and "quick" not in text


# --- A full disk --------------------------------------------------------------------------------


def test_a_full_disk_while_writing_tokens_is_a_value_error_naming_the_fix(
    corpus, tmp_path, monkeypatch
):
    """The token writer's write fails as on a full disk (the next test fills a real one)."""

    def append_to_a_full_disk(self, ids):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.file.name))

    monkeypatch.setattr(TokenWriter, "append", append_to_a_full_disk)
    full = rf"the disk holding the data cache {tmp_path} is full \(No space left on device\)"
    with pytest.raises(ValueError, match=full + ".*TINYFORMER_CACHE"):
        prepared(corpus, tmp_path)
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_full_disk_ends_train_py_with_one_error_line_and_no_litter(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(PARAGRAPHS * 10) + "\n")  # 130 kB: more than the disk holds
    with small_disk(tmp_path / "disk", "128k") as disk:  # the test above injects ENOSPC
        overrides = [*TINY, "logger=none", "data=text_files", f"data.paths=[{corpus}]"]
        run_dir = f"hydra.run.dir={tmp_path / 'run'}"
        result = run_script("train.py", *overrides, run_dir, cache_dir=disk / "cache")
        litter = leftovers(disk / "cache")
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith(f"error: the disk holding the data cache {disk / 'cache'} is full")
    assert "TINYFORMER_CACHE" in errors[0]
    assert litter == []
