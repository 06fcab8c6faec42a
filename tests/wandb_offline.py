"""Read an offline W&B run's records (run-*.wandb), so tests can check what a run logged.

The file is W&B's transaction log: a 7-byte header (":W&B", magic 0xBEE1, version), then
32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type) carrying protobuf
`Record`s split as FULL / FIRST, MIDDLE..., LAST, as in LevelDB's log format.
"""

import json
import struct
from collections.abc import Iterator
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B transaction log")
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk if kind == LAST else chunk)
            pending = b""
            yield record


def run_files(run_dir: Path) -> list[Path]:
    """Every offline-run-*/run-*.wandb under <run_dir>/wandb, oldest first."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))


def run_file(run_dir: Path) -> Path:
    """`run_dir` itself if it is a run-*.wandb file, else the single one under <run_dir>/wandb."""
    if Path(run_dir).suffix == ".wandb":
        return Path(run_dir)
    files = run_files(run_dir)
    if len(files) != 1:
        raise AssertionError(f"expected one offline W&B run under {run_dir}, found {files}")
    return files[0]


def history(run_dir: Path) -> list[dict]:
    """Every logged history row, as {key: value}."""
    rows = []
    for record in records(run_file(run_dir)):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def _updates(run_dir: Path, record_type: str) -> dict:
    """Every key set by the run's `record_type` records, the last value of each (nested keys
    joined the way W&B stores them)."""
    values = {}
    for record in records(run_file(run_dir)):
        if record.WhichOneof("record_type") == record_type:
            for item in getattr(record, record_type).update:
                values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return values


def config(run_dir: Path) -> dict:
    """The run's config as logged."""
    return _updates(run_dir, "config")


def summary(run_dir: Path) -> dict:
    """The run's summary as W&B last recorded it."""
    return _updates(run_dir, "summary")


def run_info(run_dir: Path) -> dict:
    """The run's id, name, group, job type and tags, from its first run record."""
    for record in records(run_file(run_dir)):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            return {
                "id": run.run_id,
                "name": run.display_name,
                "group": run.run_group,
                "job_type": run.job_type,
                "tags": list(run.tags),
            }
    raise AssertionError(f"no run record in {run_file(run_dir)}")
