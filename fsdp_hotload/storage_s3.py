"""S3 specifics of :class:`~fsdp_hotload.storage.Storage`: who retries, and deadlines on every request.

Kept apart so the generic storage layer stays backend-neutral. Everything here works on an s3fs filesystem
through its public ``call_s3``/``split_path`` methods and fsspec's sync ``timeout=`` argument.

Example::

    options, owned = owned_retries("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9000"})
    # options["config_kwargs"]["retries"] == {"mode": "standard", "total_max_attempts": 2}
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

import fsspec.core

from .storage_errors import ErrorClass, classify_error, is_throttle

__all__ = ["is_s3_root", "owned_retries", "DeadlineCalls", "ThrottleAnswers", "abort_open_uploads",
           "DeleteRefused", "delete_checked", "OpenUpload", "list_uploads", "abort_upload"]

logger = logging.getLogger("fsdp_hotload.storage")


def is_s3_root(root: str) -> bool:
    """An S3 root opened by s3fs directly (not through a chained filesystem such as ``simplecache::s3://``)."""
    protocol, _ = fsspec.core.split_protocol(root)
    return "::" not in root and (protocol or "").lower() in ("s3", "s3a")


def owned_retries(root: str, options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """On S3, Storage's loop owns retries unless ``config_kwargs`` sets botocore's ``retries``.

    Why: botocore (5 tries in its legacy mode), s3fs (5 more around each) and Storage's own attempts multiplied
    to 150 requests against a throttled prefix, and a refused connection took ~40 s to report. Botocore keeps a
    second try (standard mode), so one dropped part of a large upload does not restart the whole object.
    """
    if not is_s3_root(root):
        return options, False
    config = dict(options.get("config_kwargs") or {})
    if "retries" in config:
        return options, False
    config["retries"] = {"mode": "standard", "total_max_attempts": 2}
    return {**options, "config_kwargs": config}, True


class DeadlineCalls:
    """Stands in for an s3fs filesystem inside one open S3 file, so each request the file sends (create, part,
    complete, abort) gets the same per-call deadline as Storage's other calls; everything else is delegated."""

    def __init__(self, fs: Any, deadline: Callable[[int], dict[str, float]]) -> None:
        self._fs = fs
        self._deadline_for = deadline

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        body = kwargs.get("Body")
        nbytes = memoryview(body).nbytes if isinstance(body, (bytes, bytearray, memoryview)) else 0
        return self._fs.call_s3(method, *args, **self._deadline_for(nbytes), **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def abort_open_uploads(fs: Any, path: str, deadline: dict[str, float]) -> None:
    """Best effort: abort every open multipart upload of exactly this key (each file has one writer)."""
    try:
        bucket, key, _ = fs.split_path(path)
        listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key, **deadline)
        for upload in listing.get("Uploads", []):
            if upload.get("Key") == key:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"],
                           **deadline)
    except Exception as exc:  # noqa: BLE001 - the put's own error is what the caller needs to see
        logger.warning("could not abort open multipart uploads of %s: %s", path, exc)


@dataclass(frozen=True)
class OpenUpload:
    """A multipart upload neither completed nor aborted: ``relpath`` from the storage root, and when it began
    (seconds since the epoch, by the store's clock; None when the store does not say)."""

    relpath: str
    upload_id: str
    initiated: float | None


def list_uploads(fs: Any, root: str, deadline: dict[str, float]) -> list[OpenUpload]:
    """Every open multipart upload below the directory ``root`` (``bucket/prefix``), all pages."""
    bucket, key, _ = fs.split_path(root)
    prefix = f"{key}/" if key else ""
    out: list[OpenUpload] = []
    page: dict[str, str] = {}
    while True:
        listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **page, **deadline)
        for upload in listing.get("Uploads") or []:
            when = upload.get("Initiated")
            out.append(OpenUpload(upload["Key"][len(prefix):], upload["UploadId"],
                                  when.timestamp() if isinstance(when, datetime) else None))
        if not listing.get("IsTruncated"):
            return out
        page = {"KeyMarker": listing.get("NextKeyMarker", ""), "UploadIdMarker": listing.get("NextUploadIdMarker", "")}


def abort_upload(fs: Any, path: str, upload_id: str, deadline: dict[str, float]) -> None:
    """Abort one multipart upload of ``path`` (``bucket/key``); one already gone (NoSuchUpload) is done."""
    bucket, key, _ = fs.split_path(path)
    try:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, **deadline)
    except FileNotFoundError:  # s3fs's NoSuchUpload: completed or aborted meanwhile
        pass


class DeleteRefused(OSError):
    """Keys a DeleteObjects request left in place. ``response`` holds the first refusal's code the way botocore's
    errors do, so :func:`~fsdp_hotload.storage_errors.classify_error` retries InternalError or SlowDown and
    raises AccessDenied at once."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.response = {"Error": {"Code": code, "Message": message}}


_BATCH = 1000  # keys per DeleteObjects request, S3's limit
# Worst first: a refusal no retry fixes decides what the caller is told.
_RANK = {ErrorClass.FATAL: 0, ErrorClass.NOT_FOUND: 0, ErrorClass.THROTTLE: 1, ErrorClass.TRANSIENT: 2}


def delete_checked(fs: Any, path: str | list[str], deadline: dict[str, float]) -> None:
    """Delete the object ``path`` and every object below it (or, given a list, just those objects); raise
    :class:`DeleteRefused` for any key the store did not delete.

    Why not ``fs.rm``: S3 answers DeleteObjects with HTTP 200 and an error per key it refused (AccessDenied from
    a bucket policy, InternalError, SlowDown), and s3fs drops those. A refused delete then passed for a done
    one: retention, which deletes a snapshot's commit marker before its files, went on to delete the files of a
    snapshot that was still committed.
    """
    names = path if isinstance(path, list) else fs.find(path, **deadline)
    if not names:
        return
    bucket = fs.split_path(names[0])[0]
    # Names from the listing keep a folder placeholder's trailing "/", which split_path would strip.
    keys = [name[len(bucket) + 1:] for name in names]
    for start in range(0, len(keys), _BATCH):
        batch = keys[start:start + _BATCH]
        out = fs.call_s3("delete_objects", Bucket=bucket,
                         Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}, **deadline)
        refused = [e for e in out.get("Errors") or [] if e.get("Code") != "NoSuchKey"]  # gone is deleted
        if refused:
            first = min(refused, key=lambda e: _RANK[classify_error(DeleteRefused("", str(e.get("Code"))))])
            code = str(first.get("Code"))
            raise DeleteRefused(f"{len(refused)} of {len(batch)} objects not deleted; {bucket}/{first.get('Key')}: "
                                f"{code}: {first.get('Message') or '(no message)'}", code)
    for name in names if isinstance(path, list) else [path]:
        fs.invalidate_cache(name)


class ThrottleAnswers:
    """Counts every throttle answer (SlowDown, 503, 429) the store gives one s3fs filesystem, including those
    botocore's own retry absorbs before Storage sees an error.

    Why: Storage's loop sees only the answers botocore gave up on, so a prefix throttled every other request
    showed ``throttled == 0`` while each put paid botocore's backoff. The hook sits on the filesystem's botocore
    client, which s3fs may replace (a refreshed session): :meth:`ensure` hooks the current one. The filesystem
    must be this Storage's own (not fsspec's shared instance), or other Storages' answers would be counted too.

    The client holds the hook, and s3fs's finalizer (which closes the client's session once the filesystem is
    collected) holds the client; so the hook reaches this object weakly, or the Storage and its filesystem,
    client and open connections would never be collected.
    """

    def __init__(self, fs: Any, count: Callable[[], None]) -> None:
        self._fs = fs
        self._count = count
        self._client: Any = None
        self.ensure()

    def ensure(self) -> None:
        client = self._fs.s3  # connects on first use (no request is sent)
        if client is not self._client:
            method = weakref.WeakMethod(self._on_answer)

            def on_answer(**kwargs: Any) -> None:
                bound = method()
                if bound is not None:
                    bound(**kwargs)

            client.meta.events.register("needs-retry.s3", on_answer)
            self._client = client

    def _on_answer(self, response: Any = None, **_: Any) -> None:
        """botocore's ``needs-retry`` event: once per answer (or connection error), before it decides to retry."""
        if not isinstance(response, tuple) or len(response) != 2 or not isinstance(response[1], dict):
            return
        error = response[1].get("Error") or {}
        meta = response[1].get("ResponseMetadata") or {}
        code = error.get("Code") if isinstance(error, dict) else None
        status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        if code is not None or status is not None:
            if is_throttle(None if code is None else str(code), status if isinstance(status, int) else None):
                self._count()
