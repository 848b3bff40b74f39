"""GCS specifics of :class:`~fsdp_hotload.storage.Storage`: deadlines on every request of a streamed write.

Kept apart so the generic storage layer stays backend-neutral. gcsfs sends a large object as a resumable upload:
one request starts it, then each chunk (the last one completes it) goes through the filesystem's ``call``, which
takes no timeout unless given one, and gcsfs sets no HTTP timeout of its own. So an endpoint that accepted a chunk
and never answered held the write for good. Here each of those requests gets fsspec's sync ``timeout=``.

Example::

    f = open_write(fs, "bucket/run/model.bin", 8 * 2**20, lambda nbytes=0: {"timeout": 120 + nbytes / 2e6})
    f.write(payload)
    f.close()      # each chunk sent under 120 s plus its bytes at 2 MB/s
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["is_gcsfs", "DeadlineGcsCalls", "open_write"]

_GCS_PROTOCOLS = frozenset({"gs", "gcs"})


def is_gcsfs(fs: Any) -> bool:
    """A gcsfs filesystem (asynchronous, with the ``call`` its files send their upload requests through)."""
    proto = getattr(fs, "protocol", ())
    protos = {proto} if isinstance(proto, str) else set(proto)
    return bool(protos & _GCS_PROTOCOLS) and bool(getattr(fs, "async_impl", False)) and hasattr(fs, "call")


def _nbytes(data: Any) -> int:
    """The size of a request body gcsfs sends (bytes, a memoryview of the file's buffer, or None)."""
    if data is None:
        return 0
    try:
        return memoryview(data).nbytes
    except TypeError:
        return len(data) if hasattr(data, "__len__") else 0


class DeadlineGcsCalls:
    """A gcsfs filesystem whose ``call`` carries a deadline: ``deadline(nbytes)`` for a request sending ``nbytes``.

    Set as a write file's ``gcsfs``: a resumable upload's chunks, its final request and its cancel (``discard``)
    all go through it. Everything else reaches the filesystem unchanged. A call past its deadline raises fsspec's
    ``FSTimeoutError`` (cancelling the request), which Storage retries as a transient failure."""

    def __init__(self, fs: Any, deadline: Callable[..., dict[str, float]]) -> None:
        self._fs = fs
        self._deadline = deadline

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self._fs.call(*args, **{**kwargs, **self._deadline(_nbytes(kwargs.get("data")))})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def open_write(fs: Any, path: str, part_size: int, deadline: Callable[..., dict[str, float]]) -> Any:
    """``path`` opened for writing on gcsfs in chunks of ``part_size``, every request under a deadline: the one
    that starts the upload (or sends a small object whole) under ``deadline()``, the file's ``timeout``, and each
    chunk under ``deadline(its bytes)``."""
    f = fs.open(path, "wb", block_size=part_size, **deadline())
    f.gcsfs = DeadlineGcsCalls(f.gcsfs, deadline)
    return f
