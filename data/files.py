"""Files written so that no reader, and no process killed midway, ever sees half of one, and the
full disk that such a write can meet, recognised however a library wraps it.

No fsync: a power cut may still lose the newest such file. Each is a record that is checked
(a cache entry's checksums) or written again (summary.json), never a run's only copy of its
state; checkpoints are made durable in training/checkpoint_io.py."""

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path

# What a write fails with when the disk, or the user's quota on it, is full.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# How a Rust I/O error ends its message: libraries written in Rust (safetensors) raise it as
# text only, with no OSError to find.
RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_files_atomic(writers: dict[Path, Callable[[Path], None]]) -> None:
    """Have each writer write its file under a temporary name of this process's beside it, then
    rename them all into place: readers (other DDP ranks, a report running meanwhile) see the
    old files or the new ones, never half of one, and a writer that fails (a full disk)
    replaces none of them and leaves no temporary file."""
    temporaries = {path: path.with_name(f".{path.name}.{os.getpid()}.tmp") for path in writers}
    try:
        for path, write in writers.items():
            write(temporaries[path])
        for path, temporary in temporaries.items():
            os.replace(temporary, path)
    except BaseException:
        for temporary in temporaries.values():
            if temporary.exists():  # unlink(missing_ok=True) fails on a read-only disk
                temporary.unlink()
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` as write_files_atomic writes a file."""
    write_files_atomic({path: lambda temporary: temporary.write_text(text, encoding="utf-8")})


def disk_full_cause(error: BaseException | None) -> OSError | None:
    """The full-disk OSError that is `error` or led to it (libraries wrap it), if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return error
        rust_error = RUST_OS_ERROR.search(str(error))
        if rust_error is not None and int(rust_error.group(1)) in DISK_FULL:
            code = int(rust_error.group(1))
            return OSError(code, os.strerror(code))
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
