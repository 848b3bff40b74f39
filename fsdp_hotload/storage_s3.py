"""S3 specifics of :class:`~fsdp_hotload.storage.Storage`: who retries, deadlines on every request, and the
multipart uploads a failed write must not leave open.

Kept apart so the generic storage layer stays backend-neutral. Everything here works on an s3fs filesystem
through its public ``call_s3``/``split_path`` methods and fsspec's sync ``timeout=`` argument.

Example::

    options, owned = owned_retries("s3://bucket/run", {"endpoint_url": "http://127.0.0.1:9000"})
    # options["config_kwargs"]["retries"] == {"mode": "standard", "total_max_attempts": 2}
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import time
import weakref
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Callable, TypeVar

import fsspec.core

from .masking import mask_text
from .storage_errors import ErrorClass, backoff_delay, classify_error, is_lost_upload, is_throttle

__all__ = ["is_s3_root", "owned_retries", "DeadlineCalls", "ThrottleAnswers", "abort_open_uploads",
           "DeleteRefused", "delete_checked", "OpenUpload", "list_uploads", "abort_upload", "RetryPolicy",
           "FailedRequest", "failed_request", "abort_failed_upload", "abort_resent_uploads", "ViewBody",
           "single_send", "whole_get_options"]

logger = logging.getLogger("fsdp_hotload.storage")
T = TypeVar("T")


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


class ViewBody(io.RawIOBase):
    """A read-only, seekable file over a byte buffer: the body of one PutObject, read from the caller's buffer.

    Why: a file below the multipart threshold went up as ``bytes``, so a buffer the publisher had just assembled
    (a memoryview, up to 64 MiB) was copied whole first, and over plain HTTP the unsent rest of a ``bytes`` body
    was copied again into the socket's send buffer: with 8 uploads at once up to 1 GiB more host memory per rank,
    on the cores the trainer uses. botocore takes a file-like body as it is: it reads it in chunks for the checksum
    (and, over plain HTTP, the payload signature), rewinds it (``seek``), and the HTTP client reads it again in
    256 KiB chunks while sending, so only chunks are ever copied. botocore's own retry rewinds it to offset 0; a
    request sent again by s3fs's loop would not be rewound, so a body is given only to a filesystem that sends
    each request once (:func:`single_send`), and each attempt of Storage's gets a fresh one.

    The buffer must not change until the put returns (each chunk is read as it is sent). ``len()`` is the bytes
    left from the current position (what botocore sizes the request by, and s3fs's ``len(data)``).
    """

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        super().__init__()
        view = memoryview(data)
        # unsigned bytes where it can be cast, so that readinto can copy into any byte buffer ('b' and 'c' views
        # refuse that); a strided 1-D view cannot be cast, and read() copies each chunk of it as it is
        keep = view.ndim == 1 and (view.format == "B" or (view.format in ("b", "c") and not view.c_contiguous))
        self._view = view if keep else view.cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}.get(whence)
        if base is None:
            raise ValueError(f"whence must be 0, 1 or 2, got {whence}")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes (all that is left for None or a negative size), as a copy of that chunk only."""
        start = self._pos
        if start >= self._view.nbytes:
            return b""
        end = self._view.nbytes if size is None or size < 0 else min(start + size, self._view.nbytes)
        self._pos = end
        return self._view[start:end].tobytes()

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        start = self._pos
        n = max(0, min(out.nbytes, self._view.nbytes - start))
        out[:n] = self._view[start:start + n]
        self._pos += n
        return n

    def __len__(self) -> int:
        return max(0, self._view.nbytes - self._pos)


def single_send(fs: Any) -> bool:
    """Whether ``fs`` (s3fs) sends each request once (its own retry loop set to one try, as Storage sets it where
    it owns the retries): only then may a request's body be a :class:`ViewBody`, which s3fs would send again
    from where the failed try left it."""
    return getattr(fs, "retries", None) == 1 and hasattr(fs, "call_s3")


def whole_get_options(fs: Any, size: int) -> dict[str, int]:
    """Options for ``fs.cat_file`` of a whole object of at most ``size`` bytes. Why: s3fs (with its default
    ``max_concurrency`` of 10) first sends a HEAD to learn whether an object is big enough to read in concurrent
    ranges, one more round trip to a store that may be in another region for every commit marker, manifest and
    hint read; an object no larger than its block size is read in one GET anyway, so that GET goes alone."""
    block = getattr(fs, "default_block_size", None)
    if not hasattr(fs, "call_s3") or not isinstance(block, int) or size > block:
        return {}
    return {"max_concurrency": 1}


@dataclass(frozen=True)
class FailedRequest:
    """The request of a multipart upload that failed (``UploadPart (part 3)``, ``CompleteMultipartUpload``), how
    many times it was sent on its own (botocore's second try not counted), and whether that settles the write:
    a part that used up its retries is not worth sending the whole object again for, while one cut off by its
    deadline is (the connection may be what failed)."""

    name: str
    attempts: int = 1
    final: bool = False


_FAILED_REQUEST = "hotload_failed_request"


def failed_request(exc: BaseException) -> FailedRequest | None:
    """What :class:`DeadlineCalls` or :meth:`RetryPolicy.call` recorded on ``exc``; None for other errors."""
    info = getattr(exc, _FAILED_REQUEST, None)
    return info if isinstance(info, FailedRequest) else None


def _record(exc: BaseException, info: FailedRequest) -> None:
    with contextlib.suppress(AttributeError, TypeError):  # an exception type with __slots__ goes unannotated
        setattr(exc, _FAILED_REQUEST, info)


def _no_count(kind: ErrorClass, delay: float) -> None:
    """A retry nothing counts (cleanup requests: only the store's throttle answers are counted, by the hook)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Storage's retries for one S3 request sent again on its own (a part, an abort, a listing): the errors
    :func:`~fsdp_hotload.storage_errors.classify_error` calls retryable, except a lost upload; ``max_attempts``
    tries; full-jitter backoff from ``throttle_backoff_s`` after a throttle, ``base_backoff_s`` otherwise.
    ``on_retry(kind, delay)`` counts each retry (Storage's stats).

    Why: botocore's two tries per request are all a part had, so one part refused twice sent the whole object
    again from part 1; a 160-part object at a 30% SlowDown rate then practically never got through. Sending a
    part number again replaces that part, so a part alone can be retried."""

    max_attempts: int
    base_backoff_s: float
    throttle_backoff_s: float
    max_backoff_s: float
    draw: Callable[[], float]
    sleep: Callable[[float], None]
    on_retry: Callable[[ErrorClass, float], None] = _no_count

    def uncounted(self, max_attempts: int | None = None) -> RetryPolicy:
        """The same retries, counted nowhere (and at most ``max_attempts`` tries when given)."""
        return replace(self, on_retry=_no_count, max_attempts=max_attempts or self.max_attempts)

    def call(self, name: str, fn: Callable[[], T], *, budget_s: float = math.inf, subject: str = "") -> T:
        """``fn()``, tried again while its error is retryable, tries remain, and the time spent plus the next wait
        stays within ``budget_s`` (so a request cut off by its deadline is not waited on ``max_attempts`` times).
        The error raised carries a :class:`FailedRequest` (final when the tries ran out)."""
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified here, re-raised when not retried
                kind = classify_error(exc)
                retryable = kind.retryable and not is_lost_upload(exc)
                spent = attempt >= self.max_attempts
                delay = 0.0 if spent or not retryable else backoff_delay(
                    attempt, self.throttle_backoff_s if kind is ErrorClass.THROTTLE else self.base_backoff_s,
                    self.max_backoff_s, self.draw())
                if not retryable or spent or time.monotonic() - start + delay >= budget_s:
                    _record(exc, FailedRequest(name, attempt, final=retryable and spent))
                    raise
                self.on_retry(kind, delay)
                logger.warning("%s of %s: %s error (%s: %s); retry %d/%d in %.2fs", name, subject, kind.value,
                               type(exc).__name__, mask_text(str(exc)), attempt, self.max_attempts - 1, delay)
                self.sleep(delay)


def request_name(method: str, kwargs: dict[str, Any]) -> str:
    """``upload_part`` with ``PartNumber=3`` -> ``UploadPart (part 3)``: the S3 operation as AWS's documents name
    it, so an error says which request of a multipart upload failed."""
    name = "".join(word.capitalize() for word in method.split("_"))
    return f"{name} (part {kwargs['PartNumber']})" if "PartNumber" in kwargs else name


class DeadlineCalls:
    """Stands in for an s3fs filesystem inside one open S3 file, so each request the file sends (create, part,
    complete, abort) gets the same per-call deadline as Storage's other calls; everything else is delegated.

    With a ``policy``, a part is retried on its own, each retry starting within the part's own deadline (so a
    part that timed out is not sent again here: the object is). Every failed request is recorded on its error
    (:func:`failed_request`). ``create_sent`` and ``create_resent`` say whether an upload may exist that the file
    does not know of: CreateMultipartUpload sent without an answer, or answered after botocore sent it again (the
    first one's reply lost on the way back)."""

    def __init__(self, fs: Any, deadline: Callable[[int], dict[str, float]], policy: RetryPolicy | None = None) -> None:
        self._fs = fs
        self._deadline_for = deadline
        self._policy = policy
        self.create_sent = False
        self.create_resent = False

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        body = kwargs.get("Body")
        nbytes = memoryview(body).nbytes if isinstance(body, (bytes, bytearray, memoryview)) else 0
        deadline = self._deadline_for(nbytes)
        name = request_name(method, kwargs)

        def send() -> Any:
            return self._fs.call_s3(method, *args, **deadline, **kwargs)

        if method == "upload_part" and self._policy is not None:
            return self._policy.call(name, send, budget_s=deadline.get("timeout", math.inf),
                                     subject=f"{kwargs.get('Bucket')}/{kwargs.get('Key')}")
        self.create_sent |= method == "create_multipart_upload"
        try:
            out = send()
        except Exception as exc:
            _record(exc, FailedRequest(name))
            raise
        if method == "create_multipart_upload":
            meta = out.get("ResponseMetadata") if isinstance(out, dict) else None
            tries = meta.get("RetryAttempts") if isinstance(meta, dict) else None
            # botocore's resends only: s3fs's own loop (on where config_kwargs sets retries) is not seen here, and
            # an upload it left open holds no parts (retention aborts it); listing after every large file for it
            # would cost a request each, and a warning each where the policy lacks ListBucketMultipartUploads.
            self.create_resent = not isinstance(tries, int) or tries > 0
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def abort_uploads_of(fs: Any, path: str, deadline: dict[str, float], keep: frozenset[str] = frozenset()) -> int:
    """Abort every open multipart upload of exactly this key but those in ``keep`` (each file has one writer);
    how many were aborted. A failed listing or abort raises."""
    bucket, key, _ = fs.split_path(path)
    listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key, **deadline)
    aborted = 0
    for upload in listing.get("Uploads") or []:
        if upload.get("Key") == key and upload.get("UploadId") not in keep:
            abort_upload(fs, path, upload["UploadId"], deadline)
            aborted += 1
    return aborted


def abort_open_uploads(fs: Any, path: str, deadline: dict[str, float]) -> None:
    """Best effort: abort every open multipart upload of exactly this key (each file has one writer)."""
    try:
        abort_uploads_of(fs, path, deadline)
    except Exception as exc:  # noqa: BLE001 - the put's own error is what the caller needs to see
        logger.warning("could not abort open multipart uploads of %s: %s", path, exc)


def abort_failed_upload(fs: Any, path: str, upload_id: str | None, calls: DeadlineCalls | None,
                        deadline: dict[str, float], policy: RetryPolicy) -> None:
    """Best effort, after a failed multipart write: abort its upload by the id the file holds, retried under
    ``policy``; list the key's uploads instead when that fails, when no id came back, or when CreateMultipartUpload
    was sent twice. The whole cleanup takes at most about one call's deadline (plus the call under way).

    Why: S3 keeps and bills the parts of an upload until it is aborted, and no object listing shows it. The abort
    used to list the key's uploads first, once; under throttling that listing was refused too, the next attempt
    of the write succeeded, and the first attempt's parts stayed open for good."""
    budget = deadline.get("timeout", math.inf)
    start = time.monotonic()
    listing = calls is None or (calls.create_sent and (upload_id is None or calls.create_resent))
    if upload_id is not None:
        try:
            policy.call("AbortMultipartUpload", lambda: abort_upload(fs, path, upload_id, deadline),
                        budget_s=budget, subject=path)
        except Exception as exc:  # noqa: BLE001 - the write's own error is what the caller needs to see
            logger.warning("could not abort the multipart upload %s of %s: %s", upload_id, path, exc)
            listing = True
    if not listing:
        return
    left = budget - (time.monotonic() - start)
    if left <= 0:
        logger.warning("multipart upload %s of %s may be left open (no time left to list the key's uploads): "
                       "Storage.open_uploads() reports it, retention (keep_last) aborts it", upload_id, path)
        return
    try:
        policy.call("ListMultipartUploads", lambda: abort_uploads_of(fs, path, deadline), budget_s=left,
                    subject=path)
    except Exception as exc:  # noqa: BLE001 - as above
        logger.warning("could not abort open multipart uploads of %s: %s", path, exc)


def abort_resent_uploads(fs: Any, path: str, completed: str | None, deadline: dict[str, float],
                         policy: RetryPolicy) -> None:
    """Best effort, after a multipart write that succeeded although CreateMultipartUpload was sent more than
    once: abort the key's other uploads. Why: botocore sends a create again when its reply is lost, and the store
    had made an upload for each; the write used the last one, and the first stayed open and billed."""
    try:
        n = policy.call("ListMultipartUploads", lambda: abort_uploads_of(
            fs, path, deadline, frozenset({completed}) if completed else frozenset()),
            budget_s=deadline.get("timeout", math.inf), subject=path)
    except Exception as exc:  # noqa: BLE001 - the object is written; this is housekeeping
        logger.warning("could not abort the other multipart uploads of %s: %s", path, exc)
        return
    if n:
        logger.info("aborted %d multipart upload(s) of %s that a resent CreateMultipartUpload left open", n, path)


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
