"""Durable, atomic writes on a local root: what :class:`~fsdp_hotload.storage.Storage` does where the "store" is a
disk (a path, ``file://``, a mounted share).

Why apart: a commit marker vouches for every file of its snapshot, so a file must be whole under its final name
and on disk (its folder entries too) before the write returns; a reader or a power loss must never see a torn
weight file. The temp name starts with :data:`TMP_PREFIX`, which listings hide and retention recognises.

Example::

    atomic_write(fsspec.filesystem("file"), "/data/run/step-4-a1b2/config.json", lambda f: f.write(b"{}"))
"""
from __future__ import annotations

import contextlib
import errno
import os
import uuid
from typing import Any, BinaryIO, Callable

__all__ = ["TMP_PREFIX", "atomic_write"]

#: Hidden prefix of the temporary names used for atomic local writes; ``Storage.list`` never reports such files.
TMP_PREFIX = ".hotload-tmp-"


def fsync_file(f: BinaryIO) -> None:
    """Make a written file durable, or fail the write. Only a file without a descriptor, or a filesystem that
    cannot sync one (EINVAL, ENOTSUP), passes unsynced: after an EIO or ENOSPC from fsync the kernel may have
    dropped the pages, and a later fsync would not say so, so the file must not be renamed in and vouched for."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise


def atomic_write(fs: Any, path: str, write: Callable[[BinaryIO], Any]) -> None:
    """Write to a hidden temp name in the same directory, fsync, then rename over the target; on any failure the
    temp file goes and an earlier file under ``path`` stays as it was."""
    parent = os.path.dirname(path)
    made: list[str] = []  # folders this write creates: each must be made durable in its own parent too
    d = parent
    while d and not os.path.isdir(d) and os.path.dirname(d) != d:
        made.append(d)
        d = os.path.dirname(d)
    fs.makedirs(parent, exist_ok=True)
    short = os.path.basename(path).encode()[:200].decode(errors="ignore")  # a name's limit is in bytes
    tmp = os.path.join(parent, f"{TMP_PREFIX}{short}.{uuid.uuid4().hex[:12]}")
    try:
        with fs.open(tmp, "wb") as f:
            write(f)
            f.flush()
            fsync_file(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    # the rename itself durable, and every folder made for it (a snapshot folder that vanishes at a power loss
    # after its commit marker was signalled); some filesystems refuse to sync a folder, which is fine
    for folder in [parent] + [os.path.dirname(m) for m in made]:
        fsync_folder(folder)


def fsync_folder(folder: str) -> None:
    """Make the names in ``folder`` durable (a rename into it, a file made there); some filesystems refuse to
    sync a folder, which is fine."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
