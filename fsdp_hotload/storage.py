"""Storage: a small protocol over URI strings, backed by fsspec, with retries tuned for object stores.

Why this layer exists: the publisher writes tens of large objects per snapshot from background threads, and
object stores fail in ways that need different answers: a quick retry, a longer backoff when throttled, or an
error at once (:mod:`fsdp_hotload.storage_errors` decides which). Every operation takes a path relative to one
root URI (the deployment's bucket prefix), so callers never build URIs by hand.

Backends: local paths (``/tmp/x``, ``file://``, ``local://``), ``memory://``, ``s3://`` (s3fs; MinIO/Nebius
through ``endpoint_url``) and ``gs://`` (gcsfs). s3fs and gcsfs are optional and imported only when a root needs
them. Any other scheme, and any fsspec chain (``simplecache::s3://...``, ``dir::...``), is refused when the storage
opens (:func:`~fsdp_hotload.storage_paths.normalise_root` says why).

Local writes go to a hidden temporary name in the target directory and are renamed into place, so a reader
never sees a torn file. Object stores give the same guarantee natively (an object appears when its PUT or its
multipart upload completes); there is no rename there, which is why a snapshot is marked complete by writing
its commit marker last (see :mod:`fsdp_hotload.retention`, whose names are re-exported here).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import random
import time
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, BinaryIO, Callable, Iterable, Iterator, TypeVar

import fsspec
import fsspec.core

from .daemon_pool import DaemonPool
from .masking import mask_text, mask_url
from .storage_errors import (_BACKEND_PACKAGES, ErrorClass, MissingBackendError,  # noqa: F401 (re-exported)
                             StorageError, backend_install_hint, backoff_delay, classify_error, credential_hint)
from .storage_gcs import put_from_buffer, sends_from_buffer
from .storage_info import FileInfo, StorageStats, mtime_of
from .storage_local import TMP_PREFIX, atomic_write
from .storage_paths import LOCAL_PROTOCOLS, OBJECT_STORE_PROTOCOLS, check_options, check_relpath, normalise_root
from .storage_multipart import MAX_PART_SIZE, MAX_PARTS, MIN_PART_SIZE, part_size_for, stream_write  # noqa: F401
from .storage_s3 import (DeleteRefused, OpenUpload, RetryPolicy, ThrottleAnswers, ViewBody, abort_open_uploads,
                         abort_upload, delete_checked, failed_request, is_s3_root, list_uploads, owned_retries,
                         single_send, whole_get_options)

__all__ = ["Storage", "StorageStats", "StorageError", "MissingBackendError", "FileInfo", "ErrorClass",
           "classify_error", "backoff_delay", "backend_install_hint", "credential_hint", "TMP_PREFIX", "COMMIT_MARKER",
           "CommitInfo",
           "write_commit_marker", "read_commit_marker", "list_committed", "plan_retention", "apply_retention"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_COPY_BLOCK = 8 * 2**20
_VIEW_BODY_MIN = 2**20  # bytes from which a one-request S3 put reads the caller's buffer (Storage._small_body)


# -- storage ----------------------------------------------------------------------------------------------------


def _unless_masked(exc: BaseException) -> BaseException | None:
    """``exc``, to chain under a new error; None when a message in its chain holds a URL's credentials, which the
    new error's message masks: a chained exception prints whole in a traceback and would show them."""
    e: BaseException | None = exc
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if mask_text(str(e)) != str(e):
            return None
        e = e.__cause__ or e.__context__
    return exc


def _protocols(fs: Any) -> frozenset[str]:
    proto = getattr(fs, "protocol", ())
    return frozenset([proto] if isinstance(proto, str) else proto)


class Storage:
    """Files under one root URI, with retries, bounded concurrency and atomic local writes.

    Example::

        st = Storage("s3://bucket/acct/acct-dep", {"endpoint_url": "http://127.0.0.1:9000"})
        st.put_many({"step-4-a1b2/config.json": b"{}", "step-4-a1b2/model-00000.safetensors": payload})
        st.put_file("step-4-a1b2/model-00001.safetensors", "/scratch/shard1.safetensors")  # multipart if large
        st.list("step-4-a1b2")     # ['step-4-a1b2/config.json', 'step-4-a1b2/model-00000.safetensors', ...]
        st.stats.throttled         # how often the store said SlowDown (on S3, botocore's own retry included)

    ``fs`` injects a ready filesystem (tests wrap one to inject faults); ``rng`` and ``sleep`` exist so tests can
    pin the jitter and observe the backoff without waiting for it.

    On asynchronous backends (s3fs, gcsfs) each write, listing, existence check or delete gets a deadline of
    ``call_timeout_s`` plus the time to send its bytes at ``min_upload_mb_s``; a call past it counts as a
    transient failure and is retried. Why: an endpoint that accepts the connection and never answers held an
    s3fs write for good (no library timeout covers its wait for ``100 Continue``). A whole-object read learns
    its size first (:meth:`get_bytes`); a large write's every part or chunk has its own deadline.
    """

    def __init__(self, root: str, storage_options: dict | None = None, *, max_attempts: int = 6,
                 base_backoff_s: float = 0.2, throttle_backoff_s: float = 1.0, max_backoff_s: float = 20.0,
                 max_concurrency: int = 8, multipart_threshold: int = 64 * 2**20,
                 call_timeout_s: float = 120.0, min_upload_mb_s: float = 2.0,
                 fs: fsspec.AbstractFileSystem | None = None,
                 rng: random.Random | None = None, sleep: Callable[[float], None] | None = None) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if min(base_backoff_s, throttle_backoff_s, max_backoff_s) < 0:
            raise ValueError("backoff times must be >= 0")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if multipart_threshold < 1:
            raise ValueError(f"multipart_threshold must be >= 1, got {multipart_threshold}")
        if not (0 < call_timeout_s < float("inf")) or not (0 < min_upload_mb_s < float("inf")):
            raise ValueError("call_timeout_s and min_upload_mb_s must be positive and finite")
        self.call_timeout_s = call_timeout_s
        self.min_upload_mb_s = min_upload_mb_s
        self.root = normalise_root(root)
        self._shown = mask_url(self.root)  # how messages name the root: a user:password@ part masked (sftp)
        self.storage_options = dict(storage_options or {})
        self.max_attempts = max_attempts
        self.base_backoff_s = base_backoff_s
        self.throttle_backoff_s = throttle_backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_concurrency = max_concurrency
        self.multipart_threshold = multipart_threshold
        # The part size of an object above the threshold (streamed part by part): half of it, at least S3's minimum.
        self.part_size = max(MIN_PART_SIZE, multipart_threshold // 2)
        self.stats = StorageStats()
        self._rng = rng or random.Random()
        self._sleep = sleep or time.sleep
        self._throttles: ThrottleAnswers | None = None  # counts botocore's absorbed throttles too (S3)
        if fs is None:
            fs, fs_root = self._open_fs(self.root, self.storage_options)
            if is_s3_root(self.root):
                try:
                    self._throttles = ThrottleAnswers(fs, lambda: self.stats.add(throttled=1))
                except Exception as exc:  # noqa: BLE001 - botocore refused the client's settings
                    detail = mask_text(str(exc))
                    raise StorageError(f"cannot open {self._shown}: {type(exc).__name__}: {detail}", uri=self._shown,
                                       op="open", cause=exc) from _unless_masked(exc)
        else:
            fs_root = fs._strip_protocol(self.root)
        self._fs = fs
        self._fs_root = str(fs_root).rstrip("/") or "/"
        protos = _protocols(fs)
        # A caching layer (an injected fs; a simplecache:: root is refused) says local_file too, yet its paths are
        # the store's: only a local protocol writes through a temp file and os.replace.
        self._local = bool(getattr(fs, "local_file", False)) and bool(protos & LOCAL_PROTOCOLS)
        self._object_store = bool(protos & OBJECT_STORE_PROTOCOLS)
        # s3fs's pipe_file takes the multipart part size; other backends' may not.
        self._chunked = bool(protos & {"s3", "s3a"})
        # Where a write in flight shows in no listing and open uploads cannot be listed (see hidden_uploads).
        self._hidden_uploads = not (self._local or "memory" in protos or (self._chunked and hasattr(fs, "call_s3")))

    @staticmethod
    def _open_fs(root: str, options: dict) -> tuple[fsspec.AbstractFileSystem, str]:
        shown = mask_url(root)
        protocol, _ = fsspec.core.split_protocol(root)  # one link: normalise_root refuses fsspec chains
        hint = backend_install_hint(protocol) if protocol else None
        if hint is not None:
            module = _BACKEND_PACKAGES[protocol.lower()][0]
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise MissingBackendError(f"cannot open {shown}: {hint}", uri=shown, op="open", cause=exc) from exc
        check_options(root, options)
        options, own_retries = owned_retries(root, options)
        if is_s3_root(root):  # a filesystem of its own: the throttle count hooks its client (ThrottleAnswers)
            options = {**options, "skip_instance_cache": True}
        try:
            fs, fs_root = fsspec.core.url_to_fs(root, **options)
            if own_retries and isinstance(getattr(fs, "retries", None), int):
                fs.retries = 1  # s3fs's own loop, under ours and botocore's, multiplied every attempt
            return fs, fs_root
        except ImportError as exc:
            raise MissingBackendError(f"cannot open {shown}: missing backend package ({exc})", uri=shown,
                                      op="open", cause=exc) from exc
        except (ValueError, TypeError) as exc:
            detail = mask_text(str(exc))
            raise StorageError(f"cannot open {shown}: {detail}", uri=shown, op="open",
                               cause=exc) from _unless_masked(exc)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The underlying fsspec filesystem (for readers that need ranged reads or streaming)."""
        return self._fs

    def __repr__(self) -> str:
        return f"Storage({self._shown!r})"

    def limited(self, *, max_attempts: int, call_timeout_s: float) -> "Storage":
        """This storage (the same filesystem and stats) with at most ``max_attempts`` tries and ``call_timeout_s``
        per call. Why: a check at start (the root probe) must not hold the trainer for the whole retry budget of a
        publish (6 tries of up to 2 minutes each against a store that stopped answering)."""
        other = copy.copy(self)
        other.max_attempts = min(self.max_attempts, max_attempts)
        other.call_timeout_s = min(self.call_timeout_s, call_timeout_s)
        return other

    def _deadline(self, nbytes: int = 0) -> dict[str, float]:
        """``timeout=`` for one call of an asynchronous backend (fsspec's sync wrapper takes it), else nothing."""
        if not getattr(self._fs, "async_impl", False):
            return {}
        return {"timeout": self.call_timeout_s + nbytes / (self.min_upload_mb_s * 1e6)}

    # -- paths -------------------------------------------------------------------------------------------

    def uri(self, relpath: str) -> str:
        """The full URI of ``relpath`` as messages and logs name it: a root's ``user:password@`` (sftp, ftp) is
        masked, since these go to logs, exceptions and the metrics file."""
        return f"{self._shown}/{relpath}" if relpath else self._shown

    def _path(self, relpath: str) -> str:
        return f"{self._fs_root}/{relpath}" if relpath else self._fs_root

    def folder_holding(self, local_path: str) -> str | None:
        """The folder directly under this (local) root that holds ``local_path``, or None: not a local root, or
        not under it. Why: a run may read an input from an earlier run's snapshot here (``hf_config_dir``), and
        retention must not delete it."""
        if not self._local:
            return None
        rel = os.path.relpath(os.path.realpath(local_path), os.path.realpath(self._fs_root))
        if rel in (os.curdir, os.pardir) or rel.startswith(os.pardir + os.sep):
            return None
        return rel.split(os.sep, 1)[0]

    def _rel(self, path: str) -> str | None:
        path = self._fs._strip_protocol(path).rstrip("/")
        root = self._fs_root.rstrip("/")
        if path.startswith(root + "/"):
            return path[len(root) + 1:]
        return None

    # -- retry core ----------------------------------------------------------------------------------------

    def _run(self, op: str, relpath: str, fn: Callable[[], T]) -> T:
        """Call ``fn`` until it succeeds, the error is not retryable, or attempts run out."""
        uri = self.uri(relpath)
        if self._throttles is not None:
            try:
                self._throttles.ensure()
            except Exception as exc:  # noqa: BLE001 - a counter only: the call itself says what is wrong
                logger.debug("cannot hook the throttle count: %s", exc)
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised as StorageError
                kind = classify_error(exc)
                if kind is ErrorClass.NOT_FOUND:
                    if isinstance(exc, FileNotFoundError) and uri in str(exc):
                        raise
                    detail = mask_text(str(exc))  # s3fs's "bucket does not exist" names no file: say which
                    raise FileNotFoundError(f"{uri}: {detail}") from _unless_masked(exc)
                # else counted as answered; a DeleteObjects refusal came in an HTTP 200 the hook does not count
                counted = kind is ErrorClass.THROTTLE and (self._throttles is None or isinstance(exc, DeleteRefused))
                request = failed_request(exc)  # one request of a multipart upload; a part has its own retries
                settled = request is not None and request.final
                if not kind.retryable or attempt >= self.max_attempts or settled:
                    self.stats.add(failures=1, throttled=int(counted))
                    tries = request.attempts if settled and request is not None else attempt
                    why = (f"after {tries} attempts" if kind.retryable
                           else f"({kind.value} error, not retried)")
                    raw = str(exc) or str(exc.__cause__ or "") or (  # s3fs's RequestTimeout is in the cause
                        "no reply before the call's deadline (call_timeout_s)"
                        if type(exc).__name__ == "FSTimeoutError" else "(no message)")
                    detail = mask_text(raw)
                    hint = credential_hint(exc, self.storage_options) if kind is ErrorClass.FATAL else None
                    detail += f"; {hint}" if hint else ""
                    detail += f" (in S3 request {request.name})" if request else ""
                    raise StorageError(f"{op} {uri} failed {why}: {type(exc).__name__}: {detail}", uri=uri,
                                       op=op, attempts=tries, cause=exc) from _unless_masked(exc)
                throttled = kind is ErrorClass.THROTTLE
                base = self.throttle_backoff_s if throttled else self.base_backoff_s
                delay = backoff_delay(attempt, base, self.max_backoff_s, self._rng.random())
                self.stats.add(retries=1, throttled=int(counted), backoff_seconds=delay)
                logger.warning("%s %s: %s error (%s: %s); retry %d/%d in %.2fs", op, uri, kind.value,
                               type(exc).__name__, mask_text(str(exc)), attempt, self.max_attempts - 1, delay)
                self._sleep(delay)

    # -- writes ------------------------------------------------------------------------------------------

    def put_bytes(self, relpath: str, data: bytes | bytearray | memoryview) -> None:
        """Write one object (replacing any old one), retrying transient failures. ``data`` must not change until
        this returns: on S3, gs:// and local paths it is read as it is sent, not copied first."""
        rel = check_relpath(relpath, self._shown)
        view = memoryview(data)
        if not view.c_contiguous:  # a strided or Fortran-order buffer: its bytes in C order (a local write needs so)
            view = memoryview(view.tobytes())
        elif view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        nbytes = view.nbytes
        path = self._path(rel)
        t0 = time.perf_counter()
        try:
            if self._local:
                self._run("put", rel, lambda: atomic_write(self._fs, path, lambda f: f.write(view)))
            elif self._object_store and nbytes > self.multipart_threshold:
                # Part by part from views of the buffer: pipe_file sends ~10 parts at once, each a copy (320 MiB
                # more for a 512 MiB object; a delta file is bytes), and went on sending after one had failed.
                step = self._part_size(nbytes)
                self._run("put", rel, lambda: self._stream_write(
                    path, (view[off:off + step] for off in range(0, nbytes, step)), step))
            elif nbytes >= _VIEW_BODY_MIN and sends_from_buffer(self._fs):  # not a copy
                self._run("put", rel, lambda: put_from_buffer(self._fs, path, view, self._deadline(nbytes)))
            else:
                body = self._small_body(data, view)
                self._run("put", rel, lambda: self._pipe_file(path, body()))
        finally:
            self.stats.add(seconds=time.perf_counter() - t0)
        self.stats.add(puts=1, bytes_put=nbytes)

    def _small_body(self, data: bytes | bytearray | memoryview, view: memoryview,
                    ) -> Callable[[], bytes | bytearray | ViewBody]:
        """The body of each attempt of a one-request put. On S3 (where s3fs sends each request once), from
        ``_VIEW_BODY_MIN`` bytes up: a fresh :class:`~fsdp_hotload.storage_s3.ViewBody` over the caller's buffer
        per attempt, read from its start. Otherwise ``bytes`` as they are, and one copy of any other buffer
        (on gs:// from ``_VIEW_BODY_MIN`` up :func:`~fsdp_hotload.storage_gcs.put_from_buffer` sends the buffer).

        Why: a publisher's file is a view of the buffer it was assembled in, up to ``multipart_threshold`` bytes;
        copying it to ``bytes`` cost that much host memory again for each upload in flight (8 at once by default),
        and a ``bytes`` body sent over plain HTTP was copied once more into the socket's send buffer. Below
        ``_VIEW_BODY_MIN`` the copy is cheap (markers and configs are bytes already). From 5 GiB (a size only a
        ``multipart_threshold`` set above it lets through) s3fs cuts the body into parts itself by slicing it, so
        such a body is bytes as before."""
        if self._view_body(view.nbytes):
            return lambda: ViewBody(view)
        payload = data if isinstance(data, (bytes, bytearray)) else view.tobytes()
        return lambda: payload

    def _view_body(self, nbytes: int) -> bool:
        """Whether a one-request put of ``nbytes`` is sent from a view body (:meth:`_small_body` says why)."""
        return self._chunked and _VIEW_BODY_MIN <= nbytes < MAX_PART_SIZE and single_send(self._fs)

    def put_file(self, relpath: str, local_path: str) -> None:
        """Upload a local file. Files above ``multipart_threshold`` are streamed (multipart on object stores)
        and never read into memory whole; a missing ``local_path`` raises FileNotFoundError."""
        rel = check_relpath(relpath, self._shown)
        local_path = os.fspath(local_path)
        size = os.path.getsize(local_path)
        path = self._path(rel)

        def blocks(block_size: int) -> Iterator[bytes]:
            with open(local_path, "rb") as src:
                while block := src.read(block_size):
                    yield block

        def copy_into(dst: BinaryIO) -> None:
            for block in blocks(_COPY_BLOCK):
                dst.write(block)

        def upload() -> None:
            if self._local:
                atomic_write(self._fs, path, copy_into)
            elif size > self.multipart_threshold and self._object_store:
                self._stream_write(path, blocks(self._part_size(size)), self._part_size(size))
            else:
                with open(local_path, "rb") as src:
                    payload = src.read()
                self._pipe_file(path, payload)

        t0 = time.perf_counter()
        try:
            self._run("put_file", rel, upload)
        finally:
            self.stats.add(seconds=time.perf_counter() - t0)
        self.stats.add(puts=1, bytes_put=size)

    def put_many(self, items: dict[str, bytes | bytearray | memoryview]) -> None:
        """Write many objects on at most ``max_concurrency`` threads.

        All relpaths are checked before anything is written. On the first failure no further puts start; the
        ones already running finish, and the first error is raised (naming the count if several failed). The
        threads are daemons: a process that exits while a put hangs (a stuck mount) is not held by them.
        """
        for rel in items:
            check_relpath(rel, self._shown)
        if len(items) <= 1 or self.max_concurrency == 1:
            for rel, data in items.items():
                self.put_bytes(rel, data)
            return
        pool = DaemonPool(min(self.max_concurrency, len(items)), "hotload-storage")
        futures: dict[Future[None], str] = {pool.submit(self.put_bytes, rel, data): rel
                                            for rel, data in items.items()}
        try:
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for fut in pending:
                fut.cancel()
            wait(futures)
        except BaseException:  # Ctrl-C: returning must not wait for every queued write first
            for fut in futures:
                fut.cancel()
            raise
        finally:
            pool.shutdown(wait=False)
        errors = [(futures[f], f.exception()) for f in futures if not f.cancelled() and f.exception()]
        if not errors:
            return
        rel, first = errors[0]
        if len(errors) == 1:
            raise first  # type: ignore[misc]
        raise StorageError(f"put_many: {len(errors)} of {len(items)} puts failed under {self._shown}; "
                           f"first: {first}", uri=self.uri(rel), op="put_many",
                           attempts=getattr(first, "attempts", 0), cause=first) from first

    def _pipe_file(self, path: str, payload: bytes | bytearray | ViewBody) -> None:
        """One ``pipe_file`` under its deadline; on S3, a call of 5 GiB or more cut off by it also aborts the key's
        open multipart uploads. Why: the deadline cancels s3fs's upload, whose own abort runs only on
        ``Exception``, so every timed-out attempt left a billed, unlisted upload behind.

        On S3 the chunk size is over half the payload, so s3fs sends it in one PUT (up to S3's 5 GiB): s3fs goes
        multipart from twice its chunk size, and at half the threshold a payload of exactly
        ``multipart_threshold`` bytes went in parts that had no retry of their own (:meth:`_stream_write` has).
        Below 5 GiB there is thus no upload to abort, and none is listed: against a store that went silent, that
        listing waited out a deadline of its own after every timed-out put of a small file."""
        size = len(payload)  # before the call: a ViewBody's length shrinks as it is read
        kwargs: dict[str, Any] = self._deadline(size)
        if self._chunked:
            kwargs["chunksize"] = max(self.part_size, size // 2 + 1)
        try:
            self._fs.pipe_file(path, payload, **kwargs)
        except BaseException as exc:  # an interrupt (KeyboardInterrupt) skips s3fs's abort as well
            cut_off = type(exc).__name__ == "FSTimeoutError" or not isinstance(exc, Exception)
            if self._chunked and cut_off and size >= MAX_PART_SIZE:
                abort_open_uploads(self._fs, path, self._deadline())
            raise

    def _part_size(self, nbytes: int) -> int:
        """The part size for an ``nbytes`` object (:func:`~fsdp_hotload.storage_multipart.part_size_for`)."""
        return part_size_for(nbytes, self.part_size)

    def _retry_policy(self) -> RetryPolicy:
        """This Storage's retries, for one S3 request retried on its own (a part of a multipart upload)."""
        def count(kind: ErrorClass, delay: float) -> None:
            self.stats.add(retries=1, backoff_seconds=delay,  # on S3 the hook counts each throttle answer
                           throttled=int(kind is ErrorClass.THROTTLE and self._throttles is None))

        return RetryPolicy(self.max_attempts, self.base_backoff_s, self.throttle_backoff_s, self.max_backoff_s,
                           self._rng.random, self._sleep, count)

    def _stream_write(self, path: str, blocks: Iterable[bytes | memoryview], part_size: int | None = None) -> None:
        """A large object, part by part; aborted on failure (:func:`~fsdp_hotload.storage_multipart.stream_write`)."""
        stream_write(self._fs, path, blocks, part_size or self.part_size, s3=self._chunked, deadline=self._deadline,
                     policy=self._retry_policy())

    # -- reads and listings -------------------------------------------------------------------------------

    def get_bytes(self, relpath: str, size_hint: int | None = None) -> bytes:
        """Read one object whole; FileNotFoundError passes straight through (never retried).

        On asynchronous backends the read has a deadline of ``call_timeout_s`` plus the object's size at
        ``min_upload_mb_s``: ``size_hint`` (a caller that knows the size or a bound on it), else the size the
        store reports first, in a request of its own under ``call_timeout_s``. Why: gcsfs sets no HTTP timeout,
        so one GET an endpoint never answered (a commit marker read by retention) held the pass, and ``close()``
        with it, for good."""
        rel = check_relpath(relpath, self._shown)
        path = self._path(rel)

        def get() -> bytes:
            if not getattr(self._fs, "async_impl", False):
                return self._fs.cat_file(path)
            size = size_hint
            if size is None:
                self._fs.invalidate_cache(path)  # a cached listing's size may be an older object's
                size = int(self._fs.info(path, **self._deadline()).get("size") or 0)
            return self._fs.cat_file(path, **self._deadline(max(0, size)), **whole_get_options(self._fs, size))

        data = self._run("get", rel, get)
        self.stats.add(gets=1, bytes_got=len(data))
        return bytes(data)

    def exists(self, relpath: str) -> bool:
        rel = check_relpath(relpath, self._shown)
        path = self._path(rel)
        self._fs.invalidate_cache(path)
        return bool(self._run("exists", rel, lambda: self._fs.exists(path, **self._deadline())))

    def size(self, relpath: str) -> int:
        rel = check_relpath(relpath, self._shown)
        path = self._path(rel)
        self._fs.invalidate_cache(path)
        return int(self._run("size", rel, lambda: self._fs.info(path, **self._deadline())["size"]))

    def list_info(self, prefix: str = "", *, include_temp: bool = False) -> dict[str, FileInfo]:
        """Files below ``prefix`` (a directory: ``"a"`` does not match ``"ab/x"``), recursively, with sizes and
        modification times, keyed by relpath from the root. Temp files of unfinished local writes are hidden
        unless ``include_temp`` (retention judging what a crashed writer left)."""
        rel = check_relpath(prefix, self._shown, allow_empty=True)
        path = self._path(rel)
        self._fs.invalidate_cache(path)

        def find() -> dict[str, Any]:
            try:
                return self._fs.find(path, detail=True, **self._deadline())
            except FileNotFoundError:
                return {}

        out: dict[str, FileInfo] = {}
        for name, info in self._run("list", rel, find).items():
            if info.get("type", "file") != "file" or name.endswith("/"):
                continue  # a zero-byte "folder" object (S3 console, rclone) is not a file
            child = self._rel(name)
            if child is None or (not include_temp and os.path.basename(child).startswith(TMP_PREFIX)):
                continue
            out[child] = FileInfo(size=int(info.get("size") or 0), mtime=mtime_of(info))
        return dict(sorted(out.items()))

    def list(self, prefix: str = "") -> list[str]:
        """Relpaths (from the root, like every relpath here, so they feed straight back into ``get_bytes``) of
        the files below the directory ``prefix``, recursively, sorted."""
        return list(self.list_info(prefix))

    def list_dirs(self) -> list[str]:
        """Names of the top-level directories under the root: the snapshot identities, committed or not."""
        self._fs.invalidate_cache(self._fs_root)

        def ls() -> list[dict[str, Any]]:
            try:
                return self._fs.ls(self._fs_root, detail=True, **self._deadline())
            except FileNotFoundError:
                return []

        names = set()
        for entry in self._run("list_dirs", "", ls):
            if entry.get("type") == "directory":
                names.add(entry["name"].rstrip("/").rsplit("/", 1)[-1])
        return sorted(names)

    @property
    def hidden_uploads(self) -> bool:
        """True where an upload in flight (another run's) shows in no listing until it completes and
        :meth:`open_uploads` cannot list it: GCS (a resumable upload) and other remote stores than S3. Local
        folders show one as a hidden temp file, and ``memory://`` is this process's own."""
        return self._hidden_uploads

    def open_uploads(self) -> list[OpenUpload]:
        """Multipart uploads under the root that were neither completed nor aborted (a writer killed mid-upload):
        no listing shows them, yet S3 keeps and bills their parts. Only S3 reports them; elsewhere ``[]``, which
        means none where :attr:`hidden_uploads` is False, and cannot tell where it is True."""
        if not (self._chunked and hasattr(self._fs, "call_s3")):
            return []
        return self._run("list_uploads", "", lambda: list_uploads(self._fs, self._fs_root, self._deadline()))

    def abort_upload(self, upload: OpenUpload) -> None:
        """Abort one upload :meth:`open_uploads` reported (its parts are deleted); one already gone is fine."""
        rel = check_relpath(upload.relpath, self._shown)
        self._run("abort_upload", rel, lambda: abort_upload(self._fs, self._path(rel), upload.upload_id,
                                                             self._deadline()))

    def delete_prefix(self, prefix: str, *, last: Callable[[str], bool] | None = None) -> None:
        """Delete everything below ``prefix`` (or the single object it names). Missing is not an error. An
        empty prefix is refused: wiping the whole root by accident must not be one call away.

        ``last`` (given a relpath from the root) picks the files deleted only once every other one is gone, so a
        delete that stops part way leaves some of them: retention keeps a snapshot's shards for last, and a
        folder still holding one is recognised as a publisher's and swept later (config and tokenizer alone are
        not)."""
        rel = check_relpath(prefix, self._shown, allow_empty=True)
        if not rel:
            raise ValueError(f"refusing to delete the whole storage root {self._shown}")
        if any(c in rel for c in "*?["):  # fsspec's rm expands them on object stores and memory://: "*" is the root
            raise ValueError(f"refusing to delete {rel!r} under {self._shown}: it has a glob character (* ? [)")
        path = self._path(rel)

        s3 = self._chunked and hasattr(self._fs, "call_s3")  # s3fs's rm ignores the keys S3 refused

        def delete(target: str | list[str]) -> None:
            if s3:
                delete_checked(self._fs, target, self._deadline())
            else:
                self._fs.rm(target, recursive=isinstance(target, str), **self._deadline())

        def delete_unless_gone(target: str | list[str]) -> None:
            # Each delete on its own: files already gone (another deleter, a resent batch whose answer was lost)
            # before the first must not skip the second, the shards, while the call reports success.
            with contextlib.suppress(FileNotFoundError):
                delete(target)

        def rm() -> None:
            if last is None:
                delete_unless_gone(path)
            else:
                try:
                    names = self._fs.find(path, **self._deadline())
                except FileNotFoundError:
                    names = []
                kept = [last(self._rel(n) or n) for n in names]
                if not all(kept):
                    delete_unless_gone([n for n, k in zip(names, kept) if not k])
                # On S3 the listing just taken names the rest; elsewhere a recursive delete takes the folders too.
                delete_unless_gone([n for n, k in zip(names, kept) if k] if s3 else path)
            self._fs.invalidate_cache(path)

        self._run("delete", rel, rm)


def __getattr__(name: str) -> Any:
    """Commit markers and retention live in :mod:`fsdp_hotload.retention`; they are reachable from here too."""
    from . import retention

    if name in retention.__all__:
        return getattr(retention, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
