"""Writes that are all-or-nothing: a reader sees the old file or the new one, never half of one.

The data goes to a temporary name in the destination folder, is fsynced, and is then moved into
place with ``os.replace`` (atomic on POSIX within one filesystem). Used by checkpoints, exported
weights, the run logger and weight sync through disk.
"""

from __future__ import annotations

import os
import tempfile

TMP_PREFIX = ".tmp-"  # temporary files of `atomic_write_text`; safe to delete when left over


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a fsynced temporary file in the same folder."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fsynced temporary file in the same folder."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def fsync_file(path: str) -> None:
    """Flush a file's data to disk (before a rename makes it visible)."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (renames, new files) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
