"""GCS specifics of :class:`~fsdp_hotload.storage.Storage`: deadlines on every request of a streamed write, and
one-request uploads sent from the caller's buffer.

Kept apart so the generic storage layer stays backend-neutral. gcsfs sends a large object as a resumable upload:
one request starts it, then each chunk (the last one completes it) goes through the filesystem's ``call``, which
takes no timeout unless given one, and gcsfs sets no HTTP timeout of its own. So an endpoint that accepted a chunk
and never answered held the write for good. Here each of those requests gets fsspec's sync ``timeout=``.

Example::

    f = open_write(fs, "bucket/run/model.bin", 8 * 2**20, lambda nbytes=0: {"timeout": 120 + nbytes / 2e6})
    f.write(payload)
    f.close()      # each chunk sent under 120 s plus its bytes at 2 MB/s

    put_from_buffer(fs, "bucket/run/model-00001.bin", memoryview(array), {"timeout": 150})  # one request
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import uuid
from typing import Any, AsyncIterator, Callable
from urllib.parse import quote

import fsspec.asyn

__all__ = ["is_gcsfs", "DeadlineGcsCalls", "open_write", "RelatedBody", "sends_from_buffer", "put_from_buffer"]

log = logging.getLogger("fsdp_hotload.storage")
PIECE = 2**20  # bytes of the buffer handed to the connection at a time (RelatedBody)

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
        data = kwargs.get("data")
        if isinstance(data, memoryview):
            # A chunk is a view of the file's BytesIO. A request cut off by its deadline stays in garbage cycles
            # (the cancelled coroutines' frames), and the cycle collector then freed that BytesIO with the view
            # still exported: Python 3.12.0/3.12.1 crash there (CPython gh-111049), 3.13 prints a BufferError.
            # A copy of one chunk per upload in flight keeps the file's buffer out of those cycles.
            kwargs = {**kwargs, "data": data.tobytes()}
        return self._fs.call(*args, **{**kwargs, **self._deadline(_nbytes(data))})

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def open_write(fs: Any, path: str, part_size: int, deadline: Callable[..., dict[str, float]]) -> Any:
    """``path`` opened for writing on gcsfs in chunks of ``part_size``, every request under a deadline: the one
    that starts the upload (or sends a small object whole) under ``deadline()``, the file's ``timeout``, and each
    chunk under ``deadline(its bytes)``."""
    f = fs.open(path, "wb", block_size=part_size, **deadline())
    f.gcsfs = DeadlineGcsCalls(f.gcsfs, deadline)
    return f


class RelatedBody:
    """The body of a one-request (``multipart/related``) upload: the object's metadata, then its bytes read from the
    caller's buffer ``PIECE`` bytes at a time, then the closing boundary. aiohttp sends an async-iterable body piece
    by piece, waiting for the socket to drain between pieces, so only about one piece is ever copied. Each piece
    is a copy, never a view of the buffer: from Python 3.12 a plain-TCP transport queues a view of what the socket
    did not take, and a connection cut off by its deadline goes on sending that queue after the put returned
    (from a retry), while the caller may be writing its next file into the same buffer.

    Why: gcsfs builds this body by joining its framing and the file into one new ``bytes``, after ``put_bytes`` had
    turned a view into ``bytes``, and the event loop copied whatever the socket did not take at once into its send
    buffer: nearly three times a file's size on top of its buffer while it was sent (8 files of 48 MiB at once:
    1.1 GiB). Each iteration starts at the first byte: gcsfs's own retry of the request sends the whole body again.

    The parts are separated by CRLF, as RFC 2046 and Google's own client library frame them; the boundary is random
    (a fixed one may occur in a file's bytes). The buffer must not change until the upload returns."""

    def __init__(self, name: str, data: bytes | bytearray | memoryview,
                 content_type: str = "application/octet-stream") -> None:
        view = memoryview(data)
        self.view = view if view.ndim == 1 and view.format in ("B", "b", "c") else view.cast("B")
        self.boundary = f"hotload-{uuid.uuid4().hex}"
        sep = f"--{self.boundary}\r\n".encode()
        meta = json.dumps({"name": name}).encode()
        self.head = (sep + b"Content-Type: application/json; charset=UTF-8\r\n\r\n" + meta + b"\r\n" + sep
                     + f"Content-Type: {content_type}\r\n\r\n".encode())
        self.tail = f"\r\n--{self.boundary}--".encode()

    @property
    def content_type(self) -> str:
        """The request's ``Content-Type`` header."""
        return f'multipart/related; boundary="{self.boundary}"'

    def __len__(self) -> int:
        """The request's ``Content-Length``."""
        return len(self.head) + self.view.nbytes + len(self.tail)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[bytes]:
        yield self.head
        for start in range(0, self.view.nbytes, PIECE):
            yield self.view[start:start + PIECE].tobytes()
        yield self.tail


#: Set on a filesystem whose gcsfs internals did not take :func:`put_from_buffer`'s call: its puts go by gcsfs again.
_OFF = "_hotload_buffer_puts_off"
_OFF_LOCK = threading.Lock()


def sends_from_buffer(fs: Any) -> bool:
    """Whether :func:`put_from_buffer` can drive ``fs``: gcsfs, with the request call and upload endpoint it uses
    (``_call``, ``_location``) and the event loop it runs on, and no earlier call found them changed."""
    return (is_gcsfs(fs) and not getattr(fs, _OFF, False)
            and all(hasattr(fs, name) for name in ("_call", "_location", "loop", "split_path")))


async def _put(fs: Any, path: str, data: memoryview) -> None:
    bucket, key, _ = fs.split_path(path)
    zonal = getattr(fs, "_is_zonal_bucket", None)  # gcsfs's experimental filesystem writes those over gRPC
    if zonal is not None and await zonal(bucket):
        await fs._pipe_file(path, data.tobytes())
        return
    from gcsfs.checkers import get_consistency_checker

    checker = get_consistency_checker(getattr(fs, "consistency", None))  # before sending: crc32c needs crcmod
    body = RelatedBody(key, data)
    out = await fs._call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o", uploadType="multipart",
                         headers={"Content-Type": body.content_type, "Content-Length": str(len(body))},
                         data=body, json_out=True)
    for start in range(0, body.view.nbytes, PIECE):
        checker.update(body.view[start:start + PIECE])
    checker.validate_json_response(out)
    update = getattr(fs, "_write_file_cache_update", None)
    if update is not None:
        await update(path)
    else:
        fs.invalidate_cache(path)


def put_from_buffer(fs: Any, path: str, data: bytes | bytearray | memoryview, deadline: dict[str, float]) -> None:
    """Write ``data`` to ``path`` (``bucket/key``) on gcsfs in one request whose body is read from ``data`` as it is
    sent (:class:`RelatedBody`), the whole call, gcsfs's own retries included, under ``deadline`` (fsspec's
    ``timeout=``). The filesystem's ``consistency`` check (``md5``, ``crc32c``, ``size``) is made against the
    object the store reports, as gcsfs's ``pipe_file`` makes it; a mismatch raises gcsfs's ``ChecksumError``.

    The call leans on gcsfs internals (``_call``, ``gcsfs.checkers``). Where a gcsfs release changed them (a
    TypeError, AttributeError or ImportError from the call), this put and every later one on ``fs`` go through
    gcsfs's own ``pipe_file`` (a copy of the buffer), said once, rather than failing every publish."""
    try:
        fsspec.asyn.sync(fs.loop, _put, fs, path, memoryview(data), **deadline)
    except (TypeError, AttributeError, ImportError) as exc:
        with _OFF_LOCK:  # said once per filesystem, however many puts found it at once
            first = not getattr(fs, _OFF, False)
            setattr(fs, _OFF, True)
        if first:
            log.warning("hotload: gcsfs %s did not take the one-request upload sent from the file's buffer (%s: %s); "
                        "gs:// puts go through gcsfs's own upload from now on, with a copy of each file",
                        getattr(sys.modules.get("gcsfs"), "__version__", "?"), type(exc).__name__, exc)
        fs.pipe_file(path, memoryview(data).tobytes(), **deadline)
