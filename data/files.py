"""Files written so that no reader, and no process killed midway, ever sees half of one, and the
full disk that such a write can meet, recognised however a library wraps it.

No fsync: a power cut may still lose the newest such file. Each is a record that is checked
(a cache entry's checksums) or written again (summary.json), never a run's only copy of its
state; checkpoints are made durable in training/checkpoint_io.py."""

import errno
import os
from pathlib import Path

# What a write fails with when the disk, or the user's quota on it, is full.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary name of this process's beside `path`, then rename it over
    `path`: readers (other DDP ranks, a report running meanwhile) see the old file or the new
    one, never half of one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def disk_full_cause(error: BaseException | None) -> OSError | None:
    """The full-disk OSError that is `error` or led to it (libraries wrap it), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
