"""Large objects written to an object store part by part: how big the parts are, and how a failed upload is
cleaned up rather than committed or left open.

Kept apart from :mod:`fsdp_hotload.storage` so its generic retry loop and the request-level details of a
multipart upload (per-part retries, aborting by upload id) read separately.

Example::

    policy = RetryPolicy(6, 0.2, 1.0, 20.0, random.random, time.sleep)
    stream_write(fs, "bucket/run/model.bin", blocks, part_size_for(size, 32 * 2**20), s3=True,
                 deadline=lambda nbytes=0: {"timeout": 120 + nbytes / 2e6}, policy=policy)
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable

from .storage_gcs import is_gcsfs, open_write
from .storage_s3 import DeadlineCalls, RetryPolicy, abort_failed_upload, abort_resent_uploads

__all__ = ["MIN_PART_SIZE", "MAX_PART_SIZE", "MAX_PARTS", "part_size_for", "stream_write"]

#: S3 rejects multipart parts under 5 MiB (except the last one).
MIN_PART_SIZE = 5 * 2**20
MAX_PART_SIZE = 5 * 2**30  # S3's largest part, and its most parts per upload below
MAX_PARTS = 10_000


def part_size_for(nbytes: int, part_size: int) -> int:
    """The part size for an ``nbytes`` object: ``part_size``, or more where S3's 10,000 parts would not hold it
    (a 50 GB file in 5 MiB parts failed at part 10,001, after sending the rest). Whole MiB."""
    need = -(-nbytes // MAX_PARTS)
    part = max(part_size, -(-need // 2**20) * 2**20)
    if part > MAX_PART_SIZE:
        raise ValueError(f"an object of {nbytes} bytes needs parts above S3's 5 GiB limit: lower max_file_bytes")
    return part


def _upload_id(f: Any) -> str | None:
    upload = getattr(f, "mpu", None)
    return upload.get("UploadId") if isinstance(upload, dict) else None


def stream_write(fs: Any, path: str, blocks: Iterable[bytes | memoryview], part_size: int, *, s3: bool,
                 deadline: Callable[..., dict[str, float]], policy: RetryPolicy) -> None:
    """Write ``blocks`` to ``path`` through a file opened on ``fs``; on failure abort, never commit a partial
    object.

    On S3 (``s3``) every request of the upload has a deadline, and a refused part is sent again on its own under
    ``policy`` (see :class:`~fsdp_hotload.storage_s3.DeadlineCalls`). A failed upload is aborted by the id the file
    holds, with retries (:func:`~fsdp_hotload.storage_s3.abort_failed_upload`); s3fs's own ``discard`` aborts
    through a call no deadline covers (~30 s per silent try). After a success, uploads a resent
    CreateMultipartUpload left open are aborted. Elsewhere the file's ``discard`` aborts; on GCS every request of
    the resumable upload, that cancel included, has its deadline too (:func:`~fsdp_hotload.storage_gcs.open_write`).
    """
    f = open_write(fs, path, part_size, deadline) if is_gcsfs(fs) else fs.open(path, "wb", block_size=part_size)
    calls = None
    if s3 and getattr(fs, "async_impl", False) and hasattr(fs, "call_s3"):
        f.fs = calls = DeadlineCalls(f.fs, deadline, policy)
    try:
        for block in blocks:
            f.write(block)
        f.close()
    except BaseException as exc:
        if s3:  # an interrupt (Ctrl-C) gets one try, with no waits
            abort_failed_upload(fs, path, _upload_id(f), calls, deadline(),
                                policy.uncounted(None if isinstance(exc, Exception) else 1))
        else:
            with contextlib.suppress(Exception):
                f.discard()  # aborts the multipart upload
        with contextlib.suppress(Exception):
            f.closed = True  # so garbage collection does not close (and thereby commit) it
        raise
    if calls is not None and calls.create_resent:
        abort_resent_uploads(fs, path, _upload_id(f), deadline(), policy.uncounted())
