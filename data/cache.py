"""Cache entries: directories of prepared data, named by a hash of what they were built from and
written once, atomically, so concurrent builders (one per node under DDP) and crashed builds are
harmless."""

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

# A complete entry holds this file; it is the last one a build writes.
MARKER = "meta.json"


def entry_path(cache_dir: str | os.PathLike, kind: str, key: object) -> Path:
    """`cache_dir/kind/<hash>`, where `key` (JSON-serialisable) lists everything that changes
    the entry's contents, and nothing that doesn't, so runs that can share an entry do."""
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
    return Path(cache_dir) / kind / digest


def build_once(entry: Path, build: Callable[[Path], None]) -> bool:
    """Make sure `entry` exists, calling `build(tmp_dir)` to fill it if needed; `build` must
    write MARKER. Returns True when the entry was already there (a cache hit)."""
    if (entry / MARKER).exists():
        return True
    entry.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private directory and rename it into place: a crash leaves only an orphan
    # temp directory, and no reader ever sees half an entry.
    tmp = entry.parent / f".tmp-{entry.name}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        build(tmp)
        try:
            os.rename(tmp, entry)
        except OSError:
            if not (entry / MARKER).exists():
                raise
            # Another process finished the same build first; its entry is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return False
