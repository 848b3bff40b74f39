"""Storage layer: round trips on real backends (local, file://, memory://, moto S3 on loopback), multipart
uploads, atomic local writes, error classification, and retries with injected faults."""
from __future__ import annotations

import errno
import os
import random
import socket
import ssl
import stat
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import fsspec
import pytest

from fsdp_hotload.storage import (
    TMP_PREFIX,
    ErrorClass,
    MissingBackendError,
    Storage,
    StorageError,
    backend_install_hint,
    backoff_delay,
    classify_error,
    credential_hint,
)
from tests.s3_fixture import (DeleteErrorsProxy, FaultyFileSystem, S3Server, StallingProxy, access_denied_error,
                               no_such_upload_error, slowdown_error)
from tests.http_fixture import tls_files

# The s3_server fixture comes from tests/conftest.py (tests.s3_fixture).

MiB = 2**20
BACKENDS = ["local", "file", "memory", "s3"]


@pytest.fixture
def make_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Storage]:
    """Build a Storage on a fresh root of the requested backend."""

    def make(kind: str, **kwargs: object) -> Storage:
        if kind == "local":
            return Storage(str(tmp_path / f"root-{uuid.uuid4().hex[:6]}"), **kwargs)
        if kind == "file":
            return Storage(f"file://{tmp_path}/root-{uuid.uuid4().hex[:6]}", **kwargs)
        if kind == "memory":
            return Storage(f"memory://hotload-tests/{uuid.uuid4().hex}", **kwargs)
        if kind == "s3":
            server: S3Server = request.getfixturevalue("s3_server")
            return Storage(server.unique_uri("st"), server.storage_options, **kwargs)
        raise AssertionError(kind)

    return make


class FixedRng:
    """Stands in for random.Random so a test can pin the jitter draw."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


# ------------------------------------------------------------------------------------------------------------
# Error classification and backoff (pure)
# ------------------------------------------------------------------------------------------------------------


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": f"{code} message"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def _aiohttp_status(status: int) -> Exception:
    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    url = URL("http://127.0.0.1:9/bucket/key")
    info = aiohttp.RequestInfo(url, "PUT", CIMultiDictProxy(CIMultiDict()), url)
    return aiohttp.ClientResponseError(info, (), status=status, message="status")


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def _botocore(name: str) -> Exception:
    import botocore.exceptions as be

    if name == "EndpointConnectionError":
        return be.EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    if name == "ReadTimeoutError":
        return be.ReadTimeoutError(endpoint_url="http://127.0.0.1:1")
    return be.NoCredentialsError()


CASES: list[tuple[str, Callable[[], BaseException], ErrorClass]] = [
    ("SlowDown translated by s3fs", lambda: slowdown_error(), ErrorClass.THROTTLE),
    ("SlowDown raw ClientError", lambda: slowdown_error(translated=False), ErrorClass.THROTTLE),
    ("Throttling", lambda: _client_error("Throttling", 400), ErrorClass.THROTTLE),
    ("ThrottlingException", lambda: _client_error("ThrottlingException", 400), ErrorClass.THROTTLE),
    ("RequestLimitExceeded", lambda: _client_error("RequestLimitExceeded", 400), ErrorClass.THROTTLE),
    ("HTTP 503 by status", lambda: _client_error("Whatever", 503), ErrorClass.THROTTLE),
    ("HTTP 429 from aiohttp", lambda: _aiohttp_status(429), ErrorClass.THROTTLE),
    ("HTTP 503 from aiohttp", lambda: _aiohttp_status(503), ErrorClass.THROTTLE),
    ("rate text only", lambda: OSError("Please reduce your request rate."), ErrorClass.THROTTLE),
    ("ConnectionResetError", lambda: ConnectionResetError("reset by peer"), ErrorClass.TRANSIENT),
    ("ConnectionError", lambda: ConnectionError("reset"), ErrorClass.TRANSIENT),
    ("TimeoutError", lambda: TimeoutError("timed out"), ErrorClass.TRANSIENT),
    ("socket.timeout", lambda: socket.timeout("timed out"), ErrorClass.TRANSIENT),
    ("OSError ECONNRESET", lambda: OSError(errno.ECONNRESET, "reset"), ErrorClass.TRANSIENT),
    ("InternalError 500", lambda: _client_error("InternalError", 500), ErrorClass.TRANSIENT),
    ("HTTP 502 from aiohttp", lambda: _aiohttp_status(502), ErrorClass.TRANSIENT),
    ("botocore EndpointConnectionError", lambda: _botocore("EndpointConnectionError"), ErrorClass.TRANSIENT),
    ("botocore ReadTimeoutError", lambda: _botocore("ReadTimeoutError"), ErrorClass.TRANSIENT),
    ("aiohttp ServerDisconnectedError", lambda: __import__("aiohttp").ServerDisconnectedError(),
     ErrorClass.TRANSIENT),
    ("wrapped transient", lambda: _chained(OSError(errno.EIO, "boom"), ConnectionResetError()),
     ErrorClass.TRANSIENT),
    ("botocore IncompleteReadError (a body cut short)", lambda: __import__("botocore.exceptions").exceptions
     .IncompleteReadError(actual_bytes=3, expected_bytes=9), ErrorClass.TRANSIENT),
    ("botocore FlexibleChecksumError", lambda: __import__("botocore.exceptions").exceptions
     .FlexibleChecksumError(error_msg="crc32 mismatch"), ErrorClass.TRANSIENT),
    ("requests ProxyError (gcsfs on a 502)", lambda: __import__("requests.exceptions").exceptions.ProxyError(
        "502 Bad Gateway"), ErrorClass.TRANSIENT),
    ("PermissionError", lambda: PermissionError("denied"), ErrorClass.FATAL),
    ("AccessDenied translated by s3fs", lambda: access_denied_error(), ErrorClass.FATAL),
    ("AccessDenied raw", lambda: access_denied_error(translated=False), ErrorClass.FATAL),
    ("HTTP 403 from aiohttp", lambda: _aiohttp_status(403), ErrorClass.FATAL),
    ("NoCredentialsError", lambda: _botocore("NoCredentialsError"), ErrorClass.FATAL),
    ("ValueError (a bug)", lambda: ValueError("bad argument"), ErrorClass.FATAL),
    ("OSError ENOSPC", lambda: OSError(errno.ENOSPC, "disk full"), ErrorClass.FATAL),
    ("FileNotFoundError", lambda: FileNotFoundError("gone"), ErrorClass.NOT_FOUND),
    ("NoSuchKey raw", lambda: _client_error("NoSuchKey", 404), ErrorClass.NOT_FOUND),
    # A lost multipart upload is a 404 too, but writing the object again from the start fixes it.
    ("NoSuchUpload translated by s3fs", lambda: no_such_upload_error(), ErrorClass.TRANSIENT),
    ("NoSuchUpload raw", lambda: no_such_upload_error(translated=False), ErrorClass.TRANSIENT),
    # A throttle phrase in a file name is not the service asking to slow down.
    ("ENOTDIR under a folder named slowdown", lambda: NotADirectoryError(errno.ENOTDIR, "Not a directory",
                                                                         "/data/slowdown-file/sub"), ErrorClass.FATAL),
    ("EACCES under a folder named slowdown", lambda: PermissionError(errno.EACCES, "Permission denied",
                                                                     "/data/slowdown/x"), ErrorClass.FATAL),
    ("ENOSPC under 'too many requests'", lambda: OSError(errno.ENOSPC, "No space left on device",
                                                         "/mnt/too many requests/x"), ErrorClass.FATAL),
]


@pytest.mark.parametrize("make_exc,expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_classify_error(make_exc: Callable[[], BaseException], expected: ErrorClass) -> None:
    assert classify_error(make_exc()) is expected


def test_retryable_flags() -> None:
    assert ErrorClass.THROTTLE.retryable and ErrorClass.TRANSIENT.retryable
    assert not ErrorClass.FATAL.retryable and not ErrorClass.NOT_FOUND.retryable


def test_backoff_delay_full_jitter_and_cap() -> None:
    assert [backoff_delay(a, 0.5, 100.0, 1.0) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_delay(10, 0.5, 3.0, 1.0) == 3.0          # capped
    assert backoff_delay(3, 0.5, 100.0, 0.0) == 0.0          # full jitter reaches zero
    draws = [backoff_delay(3, 0.5, 100.0, random.Random(i).random()) for i in range(200)]
    assert all(0.0 <= d <= 2.0 for d in draws) and max(draws) - min(draws) > 1.0
    with pytest.raises(ValueError):
        backoff_delay(0, 0.5, 1.0, 0.5)


# ------------------------------------------------------------------------------------------------------------
# Round trips on every backend
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
def test_round_trip_and_listing(kind: str, make_storage: Callable[..., Storage], tmp_path: Path) -> None:
    st = make_storage(kind)
    assert not st.root.endswith("/") and st.uri("a/b") == st.root + "/a/b"
    assert st.list() == [] and st.list_dirs() == []
    payload = os.urandom(100_003)
    st.put_bytes("snap-1/model-00000.safetensors", payload)
    st.put_bytes("snap-1/config.json", memoryview(b'{"a": 1}'))
    st.put_bytes("snap-1/sub/deep.bin", bytearray(b"deep"))
    st.put_bytes("snap-10/x", b"")
    st.put_many({f"snap-2/f{i}": bytes([i]) * (i + 1) for i in range(5)})
    src = tmp_path / "src.bin"
    src.write_bytes(b"from a file" * 1000)
    st.put_file("snap-2/from-file.bin", str(src))

    assert st.get_bytes("snap-1/model-00000.safetensors") == payload
    assert st.get_bytes("snap-1/config.json") == b'{"a": 1}'
    assert st.get_bytes("snap-10/x") == b""
    assert st.get_bytes("snap-2/f3") == b"\x03" * 4
    assert st.get_bytes("snap-2/from-file.bin") == src.read_bytes()
    assert st.size("snap-1/model-00000.safetensors") == len(payload)
    assert st.exists("snap-1/config.json") and not st.exists("snap-1/nope.json")
    assert st.list_dirs() == ["snap-1", "snap-10", "snap-2"]
    # A prefix is a directory: "snap-1" does not pick up "snap-10"; results are relpaths from the root.
    assert st.list("snap-1") == ["snap-1/config.json", "snap-1/model-00000.safetensors", "snap-1/sub/deep.bin"]
    assert st.list("snap-1/") == st.list("snap-1")
    assert len(st.list()) == 3 + 1 + 6
    assert st.list_info("snap-2")["snap-2/f4"].size == 5

    st.put_bytes("snap-1/config.json", b"{}")  # overwrite
    assert st.get_bytes("snap-1/config.json") == b"{}"

    st.delete_prefix("snap-1")
    st.delete_prefix("never-existed")
    assert st.list_dirs() == ["snap-10", "snap-2"]
    assert st.list("snap-1") == []
    with pytest.raises(FileNotFoundError):
        st.get_bytes("snap-1/config.json")
    with pytest.raises(FileNotFoundError):
        st.size("snap-1/config.json")
    assert st.stats.puts == 11 and st.stats.retries == 0
    assert st.stats.bytes_put == len(payload) + 8 + 4 + 0 + 15 + src.stat().st_size + 2


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_put_file_large_streams(kind: str, make_storage: Callable[..., Storage], tmp_path: Path) -> None:
    st = make_storage(kind, multipart_threshold=6 * MiB)
    data = os.urandom(13 * MiB + 17)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    st.put_file("s/big.bin", str(src))
    assert st.size("s/big.bin") == len(data)
    assert st.get_bytes("s/big.bin") == data
    with pytest.raises(FileNotFoundError):
        st.put_file("s/other.bin", str(tmp_path / "missing.bin"))


def test_bad_relpaths_and_roots(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    for bad in ["", "/abs", "a/../b", "a//b", "./a", "a\\b"]:
        with pytest.raises(ValueError, match="relpath"):
            st.put_bytes(bad, b"x")
    with pytest.raises(ValueError, match="whole storage root"):
        st.delete_prefix("")
    with pytest.raises(ValueError):
        Storage("s3://")
    assert Storage(str(tmp_path) + "/").root == str(tmp_path)
    assert Storage("memory://a/b/").root == "memory://a/b"


# ------------------------------------------------------------------------------------------------------------
# Local atomicity
# ------------------------------------------------------------------------------------------------------------


def test_local_writes_are_atomic_for_concurrent_readers(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    versions = [bytes([v]) * MiB for v in range(4)]
    st.put_bytes("s/f.bin", versions[0])
    stop = threading.Event()
    seen: list[bytes] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append((tmp_path / "s" / "f.bin").read_bytes())
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(24):
            st.put_bytes("s/f.bin", versions[i % 4])
    finally:
        stop.set()
        t.join()
    assert not errors
    assert seen and all(s in versions for s in seen)  # never a torn or empty file
    assert os.listdir(tmp_path / "s") == ["f.bin"]  # no temp files left behind


def test_failed_local_write_keeps_old_file_and_hides_temp_files(tmp_path: Path) -> None:
    faulty = FaultyFileSystem(fsspec.filesystem("file"), fail_puts=1,
                              exc_factory=lambda: OSError(errno.ENOSPC, "full"),
                              fail_after_bytes=0)  # dies mid-write, after the temp file exists
    st = Storage(str(tmp_path), fs=faulty, base_backoff_s=0)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f.bin").write_bytes(b"old")
    with pytest.raises(StorageError, match="f.bin"):
        st.put_bytes("s/f.bin", b"new")
    assert (tmp_path / "s" / "f.bin").read_bytes() == b"old"
    assert os.listdir(tmp_path / "s") == ["f.bin"]
    (tmp_path / "s" / f"{TMP_PREFIX}g.bin.deadbeef").write_bytes(b"torn")  # as a crash would leave it
    assert st.list("s") == ["s/f.bin"]


# ------------------------------------------------------------------------------------------------------------
# S3: multipart
# ------------------------------------------------------------------------------------------------------------


def _parts_in_etag(server: S3Server, st: Storage, rel: str) -> int:
    key = st.uri(rel).split(f"s3://{server.bucket}/", 1)[1]
    etag = server.client().head_object(Bucket=server.bucket, Key=key)["ETag"].strip('"')
    return int(etag.rsplit("-", 1)[1]) if "-" in etag else 1


def test_s3_put_file_70mb_is_multipart(s3_server: S3Server, tmp_path: Path) -> None:
    st = Storage(s3_server.unique_uri("multipart"), s3_server.storage_options, multipart_threshold=16 * MiB)
    data = os.urandom(70 * MiB)
    src = tmp_path / "shard.safetensors"
    src.write_bytes(data)
    st.put_file("snap/model-00000.safetensors", str(src))
    assert _parts_in_etag(s3_server, st, "snap/model-00000.safetensors") == 9  # 70 MiB in 8 MiB parts
    assert st.get_bytes("snap/model-00000.safetensors") == data
    assert st.stats.bytes_put == 70 * MiB

    small = tmp_path / "small.bin"
    small.write_bytes(data[: 3 * MiB])
    st.put_file("snap/small.bin", str(small))
    assert _parts_in_etag(s3_server, st, "snap/small.bin") == 1  # below the threshold: one PUT


def test_s3_large_put_bytes_goes_multipart(s3_server: S3Server) -> None:
    st = Storage(s3_server.unique_uri("mv"), s3_server.storage_options, multipart_threshold=10 * MiB)
    data = os.urandom(12 * MiB + 5)
    st.put_bytes("snap/big.bin", memoryview(data))
    assert _parts_in_etag(s3_server, st, "snap/big.bin") == 3  # 5 MiB parts
    assert st.get_bytes("snap/big.bin") == data
    st.put_bytes("snap/big-bytes.bin", data)  # plain bytes go through s3fs's own multipart upload
    assert _parts_in_etag(s3_server, st, "snap/big-bytes.bin") == 3
    assert st.get_bytes("snap/big-bytes.bin") == data
    st.put_bytes("snap/small.bin", memoryview(data)[: 4 * MiB])
    assert _parts_in_etag(s3_server, st, "snap/small.bin") == 1


def _open_uploads(server: S3Server, st: Storage) -> list[str]:
    prefix = st.root.split(f"s3://{server.bucket}/", 1)[1]
    listing = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=prefix)
    return [u["Key"] for u in listing.get("Uploads", [])]


def test_s3_upload_dropped_mid_stream_is_aborted_and_retried(s3_server: S3Server) -> None:
    uri = s3_server.unique_uri("abort")
    inner, _ = fsspec.core.url_to_fs(uri, **s3_server.storage_options)
    faulty = FaultyFileSystem(inner, fail_puts=1, exc_factory=lambda: ConnectionResetError("dropped"),
                              fail_after_bytes=6 * MiB)  # after the first part is uploaded
    st = Storage(uri, fs=faulty, multipart_threshold=10 * MiB, base_backoff_s=0.0001)
    data = os.urandom(12 * MiB)
    st.put_bytes("snap/big.bin", memoryview(data))
    assert st.get_bytes("snap/big.bin") == data and st.stats.retries == 1
    assert _open_uploads(s3_server, st) == []

    faulty.arm(10)  # every try dies mid-stream: nothing may be committed or left open
    with pytest.raises(StorageError, match="snap/other.bin"):
        st.put_bytes("snap/other.bin", memoryview(data))
    assert not st.exists("snap/other.bin")
    assert _open_uploads(s3_server, st) == []


# ------------------------------------------------------------------------------------------------------------
# Retries
# ------------------------------------------------------------------------------------------------------------


def test_throttled_twice_then_succeeds_on_s3(s3_server: S3Server) -> None:
    uri = s3_server.unique_uri("throttle")
    inner, _ = fsspec.core.url_to_fs(uri, **s3_server.storage_options)
    faulty = FaultyFileSystem(inner, fail_puts=2, exc_factory=slowdown_error)
    delays: list[float] = []
    st = Storage(uri, fs=faulty, base_backoff_s=0.0001, throttle_backoff_s=0.01, max_backoff_s=1.0,
                 rng=FixedRng(0.5), sleep=delays.append)
    st.put_bytes("snap/a.bin", b"payload")
    assert st.get_bytes("snap/a.bin") == b"payload"
    assert faulty.failures_raised == 2 and faulty.write_calls == 3
    assert st.stats.throttled == 2 and st.stats.retries == 2 and st.stats.puts == 1
    # Full jitter drawn at 0.5 of the throttle base, doubling: the throttle base was used, not the short one.
    assert delays == pytest.approx([0.005, 0.01])
    assert st.stats.backoff_seconds == pytest.approx(0.015)


def _throttling_s3(slow_down: Callable[[int], bool], seen: list[str]) -> Any:
    """An S3 endpoint (a real HTTP server) whose n-th request (from 1) gets 503 SlowDown when ``slow_down(n)``,
    else an empty 200 with an ETag, which is how PutObject succeeds."""
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _any(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            seen.append(self.command)
            body = b""
            if slow_down(len(seen)):
                body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                self.send_response(503)
            else:
                self.send_response(200)
                self.send_header("ETag", '"0123456789abcdef0123456789abcdef"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_PUT = do_GET = do_HEAD = do_POST = do_DELETE = _any

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def test_throttles_botocore_absorbs_are_counted() -> None:
    """botocore retries each S3 request once itself, so Storage saw (and counted) only the throttles that
    outlasted that retry: a prefix throttled on every other request showed throttled == 0. Now every SlowDown
    answer is counted, each Storage its own."""
    from tests.http_fixture import serve

    seen: list[str] = []
    with serve(_throttling_s3(lambda n: n % 2 == 1, seen)) as url:
        opts = {"endpoint_url": url, "key": "k", "secret": "s"}
        st = Storage("s3://bkt/run", opts, max_attempts=1)
        other = Storage("s3://bkt/run", opts)
        for i in range(3):
            st.put_bytes(f"snap/{i}.bin", b"payload")
        assert seen == ["PUT"] * 6
        assert st.stats.throttled == 3 and st.stats.retries == 0 and st.stats.puts == 3
        assert other.stats.throttled == 0
    seen.clear()
    with serve(_throttling_s3(lambda n: True, seen)) as url:  # every answer, the final one included
        st = Storage("s3://bkt/run", {"endpoint_url": url, "key": "k", "secret": "s"}, max_attempts=2,
                     throttle_backoff_s=0.001, max_backoff_s=0.001)
        with pytest.raises(StorageError, match="after 2 attempts"):
            st.put_bytes("snap/a.bin", b"payload")
        assert len(seen) == 4 and st.stats.throttled == 4 and st.stats.retries == 1


def test_transient_errors_use_short_backoff_and_real_sleep(tmp_path: Path) -> None:
    faulty = FaultyFileSystem(fsspec.filesystem("file"), fail_puts=2, exc_factory=lambda: ConnectionResetError())
    st = Storage(str(tmp_path), fs=faulty, base_backoff_s=0.001, throttle_backoff_s=10.0)
    st.put_bytes("a/b", b"ok")
    assert (tmp_path / "a" / "b").read_bytes() == b"ok"
    assert st.stats.retries == 2 and st.stats.throttled == 0
    assert st.stats.backoff_seconds <= 0.001 + 0.002


def test_always_failing_put_raises_storage_error_naming_uri() -> None:
    faulty = FaultyFileSystem(fsspec.filesystem("memory"), fail_puts=10**6,
                              exc_factory=lambda: ConnectionError("reset"))
    st = Storage(f"memory://hotload-tests/{uuid.uuid4().hex}", fs=faulty, max_attempts=4, base_backoff_s=0.0001)
    with pytest.raises(StorageError) as info:
        st.put_bytes("snap/model-00001.safetensors", b"x")
    err = info.value
    assert st.uri("snap/model-00001.safetensors") in str(err) and "after 4 attempts" in str(err)
    assert err.attempts == 4 and isinstance(err.__cause__, ConnectionError)
    assert faulty.failures_raised == 4
    assert st.stats.retries == 3 and st.stats.failures == 1
    assert not st.exists("snap/model-00001.safetensors")


@pytest.mark.parametrize("factory", [lambda: PermissionError("denied"), access_denied_error],
                         ids=["PermissionError", "AccessDenied"])
def test_permission_errors_are_not_retried(factory: Callable[[], BaseException]) -> None:
    faulty = FaultyFileSystem(fsspec.filesystem("memory"), fail_puts=5, exc_factory=factory)
    st = Storage(f"memory://hotload-tests/{uuid.uuid4().hex}", fs=faulty, base_backoff_s=0.0001)
    with pytest.raises(StorageError, match="not retried") as info:
        st.put_bytes("snap/x", b"x")
    assert st.uri("snap/x") in str(info.value) and info.value.attempts == 1
    assert faulty.failures_raised == 1 and st.stats.retries == 0


def test_get_missing_passes_through_unretried() -> None:
    faulty = FaultyFileSystem(fsspec.filesystem("memory"))
    st = Storage(f"memory://hotload-tests/{uuid.uuid4().hex}", fs=faulty)
    with pytest.raises(FileNotFoundError):
        st.get_bytes("nope")
    assert faulty.read_calls == 1 and st.stats.retries == 0


def test_get_retries_transient_read_errors() -> None:
    faulty = FaultyFileSystem(fsspec.filesystem("memory"), fail_gets=2, get_exc_factory=lambda: TimeoutError())
    st = Storage(f"memory://hotload-tests/{uuid.uuid4().hex}", fs=faulty, base_backoff_s=0.0001)
    st.put_bytes("a", b"data")
    assert st.get_bytes("a") == b"data" and st.stats.retries == 2


def test_put_many_bounds_concurrency(tmp_path: Path) -> None:
    faulty = FaultyFileSystem(fsspec.filesystem("memory"), delay_s=0.03)
    st = Storage(f"memory://hotload-tests/{uuid.uuid4().hex}", fs=faulty, max_concurrency=3)
    items = {f"snap/f{i:02d}": os.urandom(100) for i in range(12)}
    st.put_many(items)
    assert 2 <= faulty.max_inflight <= 3
    assert {rel: st.get_bytes(rel) for rel in st.list("snap")} == items


def test_put_many_raises_the_failure(tmp_path: Path) -> None:
    # "-f07": the write goes to a temp name ending in 12 random hex digits, where "f07" alone turned up in about
    # one run in fifty and failed another file's write
    faulty = FaultyFileSystem(fsspec.filesystem("file"), fail_puts=1, exc_factory=lambda: PermissionError("no"),
                              match="-f07")
    st = Storage(str(tmp_path), fs=faulty, max_concurrency=4)
    with pytest.raises(StorageError) as info:
        st.put_many({f"snap/f{i:02d}": b"x" for i in range(10)})
    assert st.uri("snap/f07") in str(info.value)
    assert "snap/f07" not in st.list("snap")
    with pytest.raises(ValueError, match="relpath"):  # all names are checked before anything is written
        st.put_many({"ok": b"1", "../escape": b"2"})
    assert not st.exists("ok")


# ------------------------------------------------------------------------------------------------------------
# Optional backends
# ------------------------------------------------------------------------------------------------------------


def test_backend_install_hint() -> None:
    assert backend_install_hint("s3") == "s3:// needs s3fs: pip install 'hotload[s3]'"
    assert backend_install_hint("gs") == "gs:// needs gcsfs: pip install 'hotload[gcs]'"
    assert backend_install_hint("memory") is None


@pytest.mark.parametrize("uri,module,extra", [("s3://bucket/prefix", "s3fs", "hotload[s3]"),
                                              ("gs://bucket/prefix", "gcsfs", "hotload[gcs]")])
def test_missing_optional_backend(monkeypatch: pytest.MonkeyPatch, uri: str, module: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` fail as if not installed
    with pytest.raises(MissingBackendError) as info:
        Storage(uri)
    msg = str(info.value)
    assert module in msg and extra in msg and uri in msg
    assert isinstance(info.value, ImportError)


def test_unknown_protocol_names_the_uri() -> None:
    with pytest.raises(StorageError, match="nosuchproto://bucket/x"):
        Storage("nosuchproto://bucket/x")


@pytest.mark.parametrize("root", ["s3://bkt//dbl", "s3://bkt/./x", "gs://b/a/../c"])
def test_object_store_roots_with_empty_or_dot_segments_are_refused(root: str) -> None:
    """``s3://bkt//dbl`` wrote keys that no listing returns, so no snapshot under it could ever be committed."""
    with pytest.raises(ValueError, match=r"empty, '\.' or '\.\.' segment"):
        Storage(root)


def test_a_missing_bucket_is_named_in_the_error(s3_server: S3Server) -> None:
    st = Storage("s3://no-such-bucket-4711/run", s3_server.storage_options, max_attempts=1)
    for op in (lambda: st.get_bytes("a"), lambda: st.put_bytes("a", b"x")):
        with pytest.raises(FileNotFoundError, match="s3://no-such-bucket-4711/run/a: .*bucket does not exist"):
            op()


def test_a_misspelt_storage_option_is_refused_with_a_suggestion(s3_server: S3Server) -> None:
    """s3fs takes any keyword, so a typo for endpoint_url would silently publish to AWS S3 instead of MinIO."""
    options = dict(s3_server.storage_options)
    options["endpoint"] = options.pop("endpoint_url")
    with pytest.raises(StorageError, match="'endpoint' \\(did you mean 'endpoint_url'\\?\\) not accepted by s3fs"):
        Storage(s3_server.unique_uri("typo"), options)
    st = Storage(s3_server.unique_uri("ok"), {**s3_server.storage_options, "skip_instance_cache": True})
    st.put_bytes("a", b"x")
    assert st.get_bytes("a") == b"x"


def test_an_endpoint_that_never_answers_times_out_and_is_retried(tmp_path: Path) -> None:
    """A server that accepts connections and never replies held an s3fs write forever; each call now has a
    deadline, counts as a transient failure past it, and the retries run out in bounded time."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[Any] = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(64)], daemon=True).start()
    try:
        st = Storage("s3://bkt/p", {"endpoint_url": f"http://127.0.0.1:{server.getsockname()[1]}", "key": "k",
                                    "secret": "s"}, max_attempts=2, base_backoff_s=0.01, call_timeout_s=0.3,
                     multipart_threshold=5 * MiB)
        big = tmp_path / "big.bin"
        big.write_bytes(b"y" * (6 * MiB))
        ops = (lambda: st.put_bytes("a", b"x" * 100), lambda: st.exists("a"), lambda: st.list(),
               lambda: st.put_bytes("big", memoryview(bytearray(6 * MiB))),  # multipart, streamed
               lambda: st.put_file("big", str(big)))  # multipart, from a file
        for op in ops:
            t0 = time.monotonic()
            with pytest.raises(StorageError, match="after 2 attempts: FSTimeoutError: no reply before the call"):
                op()
            assert time.monotonic() - t0 < 30
        assert st.stats.retries == len(ops)
    finally:
        server.close()


def test_zero_byte_folder_objects_are_not_files(s3_server: S3Server) -> None:
    """The S3 console, rclone and Hadoop write "folder/" marker objects; they are not files of a snapshot."""
    uri = s3_server.unique_uri("markers")
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    client = s3_server.client()
    for key in ("", "step-1/", "step-1/a.bin", "empty-dir/"):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"abc" if key.endswith(".bin") else b"")
    st = Storage(uri, s3_server.storage_options)
    assert st.list() == ["step-1/a.bin"]
    assert st.list("step-1") == ["step-1/a.bin"]


def test_a_lost_multipart_upload_is_written_again(s3_server: S3Server) -> None:
    """NoSuchUpload (the upload id was aborted under us) is a 404 that a fresh upload of the object fixes."""
    uri = s3_server.unique_uri("nosuchupload")
    inner, _ = fsspec.core.url_to_fs(uri, **s3_server.storage_options)
    faulty = FaultyFileSystem(inner, fail_puts=1, exc_factory=no_such_upload_error)
    st = Storage(uri, fs=faulty, base_backoff_s=0.0001)
    st.put_bytes("snap/a.bin", b"payload")
    assert st.get_bytes("snap/a.bin") == b"payload" and st.stats.retries == 1 and faulty.failures_raised == 1


def _count_requests(storage_options: dict[str, Any], max_attempts: int) -> int:
    """Connections a failing put makes to a server that hangs up on every request."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            accepted.append(1)
            conn.recv(65536)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        options = {"endpoint_url": f"http://127.0.0.1:{server.getsockname()[1]}", "key": "k", "secret": "s",
                   "skip_instance_cache": True, **storage_options}
        st = Storage("s3://bkt/p", options, max_attempts=max_attempts, base_backoff_s=0.001)
        with pytest.raises(StorageError, match=f"after {max_attempts} attempts"):
            st.put_bytes("a", b"x")
        return len(accepted)
    finally:
        server.close()


def test_s3_retries_are_owned_by_storage_not_stacked_under_it() -> None:
    """botocore (5 tries in legacy mode) and s3fs (5 around each) used to multiply under every Storage attempt.
    Now botocore keeps two tries and s3fs's loop is off, unless the user configures botocore's retries."""
    one = _count_requests({}, max_attempts=1)
    assert 2 <= one <= 4  # two botocore tries; aiohttp may resend an idempotent PUT once on a hang-up
    assert _count_requests({}, max_attempts=3) == 3 * one  # Storage's loop is the only multiplier
    same_botocore = {"config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 2}}}
    assert _count_requests(same_botocore, max_attempts=1) == 5 * one  # user-configured: s3fs's loop stays on


def test_a_multipart_put_cut_off_by_its_deadline_leaves_no_open_upload(s3_server: S3Server) -> None:
    """The deadline cancels s3fs's multipart upload, whose own abort then never runs: each timed-out attempt left
    a billed upload that no listing shows. Both large-put paths (bytes, streamed views) now abort theirs."""
    with StallingProxy(s3_server.endpoint_url, b"partNumber=") as proxy:
        uri = s3_server.unique_uri("cutoff")
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True},
                     multipart_threshold=10 * MiB, call_timeout_s=1, min_upload_mb_s=1e6, max_attempts=2,
                     base_backoff_s=0.001)
        data = os.urandom(12 * MiB)
        for name, payload in (("bytes.bin", data), ("view.bin", memoryview(bytearray(data)))):
            with pytest.raises(StorageError, match="after 2 attempts: FSTimeoutError"):
                st.put_bytes(name, payload)
        assert proxy.stalled >= 4  # the uploads were created, then their parts never answered
        assert _open_uploads(s3_server, st) == []
        assert st.list() == []


@pytest.mark.parametrize("root", ["memory://runs/exp[12]", "s3://bkt/runs/exp*", "gs://b/run?"])
def test_object_store_roots_with_glob_characters_are_refused(root: str) -> None:
    """fsspec's rm expands * ? [ on object stores: retention under "runs/exp[12]" deleted the snapshots of
    "runs/exp1" and "runs/exp2" and none of its own."""
    with pytest.raises(ValueError, match=r"glob character"):
        Storage(root)


@pytest.mark.parametrize("root, meant", [("s3:/my-bucket/run", "s3://my-bucket/run"), ("s3:bkt/run", "s3://bkt/run"),
                                         ("gs:b", "gs://b"), ("file:/srv/run", "file:///srv/run")])
def test_a_scheme_missing_its_slashes_is_refused_not_made_a_local_folder(tmp_path: Path, monkeypatch: Any,
                                                                          root: str, meant: str) -> None:
    """'s3:/my-bucket/run' has no '://', so it was a local path: every snapshot, manifest and commit marker went to
    ./s3:/my-bucket/run on the trainer's disk, with no error."""
    from fsdp_hotload import HotloadConfig

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"did you mean {meant}"):
        Storage(root)
    with pytest.raises(ValueError, match=f"(?s)bucket_url.*did you mean {meant}"):
        HotloadConfig(bucket_url=root)
    assert os.listdir(tmp_path) == []
    assert Storage(str(tmp_path / "a:b")).put_bytes("step-1/x", b"y") is None  # a colon elsewhere is a name
    assert (tmp_path / "a:b" / "step-1" / "x").read_bytes() == b"y"


def test_a_local_root_holding_a_chain_separator_is_refused(tmp_path: Path) -> None:
    """fsspec reads '/x/a::b' as the chain 'b' over '/x/a': the files went to /x/a, maybe another run's root."""
    from fsdp_hotload import HotloadConfig

    for make in (lambda: Storage(str(tmp_path / "a::b")), lambda: HotloadConfig(bucket_url=str(tmp_path / "a::b"))):
        with pytest.raises(ValueError, match="holds '::'"):
            make()
    assert os.listdir(tmp_path) == []


def test_a_local_root_with_brackets_deletes_only_its_own_files(tmp_path: Path) -> None:
    sibling = Storage(str(tmp_path / "exp1"))
    sibling.put_bytes("step-1/a", b"x")
    own = Storage(str(tmp_path / "exp[1]"))
    own.put_bytes("step-1/a", b"y")
    own.delete_prefix("step-1")
    assert own.list() == [] and sibling.list() == ["step-1/a"]


@pytest.mark.parametrize("options", [{"endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s"},
                                     {"anon": True}])
def test_object_store_options_on_a_local_root_are_refused(tmp_path: Path, options: dict[str, Any]) -> None:
    """A root without its scheme ("my-bucket/run") and a MinIO endpoint wrote the snapshots to the local disk."""
    with pytest.raises(ValueError, match=rf"storage_options \['{sorted(options)[0]}'.* is a local path"):
        Storage(str(tmp_path / "my-bucket"), options)
    assert not (tmp_path / "my-bucket").exists()
    Storage(str(tmp_path / "ok"), {"auto_mkdir": True, "skip_instance_cache": True})  # what local paths take


def test_backoff_does_not_overflow_after_a_thousand_attempts() -> None:
    assert backoff_delay(5000, 0.5, 30.0, 1.0) == 30.0


def test_a_very_long_file_name_is_written_through_a_shorter_temp_name(tmp_path: Path) -> None:
    """The temp name added 26 characters: a 240-character name, legal on Linux, failed with ENAMETOOLONG."""
    st = Storage(str(tmp_path))
    name = "m" * 240
    st.put_bytes(f"d/{name}", b"x")
    assert st.get_bytes(f"d/{name}") == b"x"


def test_an_interrupt_during_put_many_does_not_wait_for_the_queued_writes(tmp_path: Path) -> None:
    """Ctrl-C in put_many used to wait for all 40 queued writes (0.2 s each, 2 at a time: 4 s) before it reached
    the caller; now the writes not yet started are cancelled."""
    import signal

    slow = FaultyFileSystem(fsspec.filesystem("file"), delay_s=0.2)
    st = Storage(str(tmp_path), fs=slow, max_concurrency=2)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))  # a real Ctrl-C, which wakes a blocked wait
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        st.put_many({f"f{i:02d}": b"x" for i in range(40)})
    timer.join()
    time.sleep(0.5)  # the two writes running when it came finish; nothing else starts
    assert slow.write_calls <= 8, slow.write_calls


def test_the_streamed_upload_s_abort_has_a_deadline_too(s3_server: S3Server) -> None:
    """When the link dies after a part was sent, the abort of the multipart upload went through a call no
    deadline covered: ~30 s per attempt (s3fs's read timeout, twice). It now gets call_timeout_s, as the put did."""
    with StallingProxy(s3_server.endpoint_url, b"uploadId=") as proxy:  # parts, completion and the abort
        st = Storage(s3_server.unique_uri("abortdl"), {**s3_server.storage_options, "endpoint_url": proxy.url,
                                                       "skip_instance_cache": True},
                     multipart_threshold=6 * MiB, call_timeout_s=1, min_upload_mb_s=1e6, max_attempts=2,
                     base_backoff_s=0.001)
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="after 2 attempts"):
            st.put_bytes("view.bin", memoryview(bytearray(os.urandom(12 * MiB))))
        took = time.monotonic() - t0
    assert took < 20, took  # two attempts of (a part, an abort) at 1 s each, plus listing; was over 60 s


def test_an_object_of_exactly_the_threshold_goes_in_one_put(s3_server: S3Server, tmp_path: Path) -> None:
    """An object of exactly multipart_threshold bytes went through pipe_file at a chunk size of half the
    threshold, which s3fs split into two parts with no retry of their own (a refused part failed the attempt,
    so the whole object went again). It now goes in one PUT, which the part requests a proxy stalls never see."""
    data = os.urandom(12 * MiB)
    src = tmp_path / "f"
    src.write_bytes(data)
    with StallingProxy(s3_server.endpoint_url, b"partNumber=") as proxy:
        st = Storage(s3_server.unique_uri("exact"), {**s3_server.storage_options, "endpoint_url": proxy.url,
                                                     "skip_instance_cache": True},
                     multipart_threshold=12 * MiB, call_timeout_s=5, min_upload_mb_s=1e6, max_attempts=2,
                     base_backoff_s=0.001)
        st.put_file("model.bin", str(src))
        st.put_bytes("view.bin", memoryview(data))
        st.put_bytes("delta.bin", data[:12 * MiB - 1])
        assert proxy.stalled == 0
        assert st.get_bytes("model.bin") == data and st.get_bytes("delta.bin") == data[:12 * MiB - 1]
    for rel in ("model.bin", "view.bin", "delta.bin"):
        assert _parts_in_etag(s3_server, st, rel) == 1, rel
    assert st.stats.retries == 0


def test_a_request_timeout_answer_is_not_reported_as_a_missed_deadline() -> None:
    """S3's "400 RequestTimeout" (the store tired of waiting for the body) reached the caller as an empty
    timeout, which the message blamed on call_timeout_s, 20 s away."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_PUT(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>RequestTimeout</Code>'
                    b"<Message>Your socket connection to the server was not read from or written to</Message>"
                    b"<RequestId>1</RequestId></Error>")
            self.send_response(400)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        options = {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{server.server_port}",
                   "client_kwargs": {"region_name": "us-east-1"}}
        st = Storage("s3://bkt/run", options, max_attempts=2, sleep=lambda s: None, call_timeout_s=20)
        with pytest.raises(StorageError) as info:
            st.put_bytes("a/b", b"x")
    finally:
        server.shutdown()
    assert "call_timeout_s" not in str(info.value) and "not read from or written to" in str(info.value), info.value


def test_keys_s3_refuses_to_delete_are_not_reported_deleted(s3_server: S3Server) -> None:
    """S3 answers DeleteObjects with HTTP 200 and an error for each key it did not delete; s3fs's rm dropped
    those, so a refused delete passed for a done one. A transient refusal is now retried, a permanent one
    raised at once, and the objects are still there."""
    uri = s3_server.unique_uri("refused")
    refusals = iter([True])  # only the first DeleteObjects is refused
    with DeleteErrorsProxy(s3_server.endpoint_url, "InternalError", lambda body: next(refusals, False)) as proxy:
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url}, base_backoff_s=0.0001)
        st.put_many({"snap/a.bin": b"a", "snap/b.bin": b"b", "other/c.bin": b"c"})
        st.delete_prefix("snap")
        assert proxy.answered == 1 and st.stats.retries == 1
        assert st.list() == ["other/c.bin"]
    with DeleteErrorsProxy(s3_server.endpoint_url, "AccessDenied", lambda body: True) as proxy:
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url}, base_backoff_s=0.0001)
        with pytest.raises(StorageError, match="AccessDenied") as info:
            st.delete_prefix("other/c.bin")
        assert info.value.attempts == 1 and proxy.answered == 1  # a refusal retrying cannot fix
        assert st.list() == ["other/c.bin"]


def test_a_dropped_s3_storage_is_freed_with_its_client(s3_server: S3Server) -> None:
    """The throttle counter's hook on the botocore client held the Storage, and s3fs's finalizer (which closes
    the client's session when the filesystem is collected) holds that client: every S3 Storage, its client and
    its pool of open connections lived until the process exited. A publisher made per run leaked one each."""
    import gc
    import weakref

    st = Storage(s3_server.unique_uri("freed"), s3_server.storage_options)
    st.put_bytes("snap/a.bin", b"payload")
    assert st.list() == ["snap/a.bin"]
    refs = [weakref.ref(st), weakref.ref(st.fs)]
    del st
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_caching_layer_over_a_store_is_not_written_as_a_local_disk() -> None:
    """``simplecache::`` says local_file too: writes took the temp-file-and-os.replace path, uploading the temp
    object in full and then failing every put on a local rename (FileNotFoundError, not retried)."""
    st = Storage(f"simplecache::memory://chain-{uuid.uuid4().hex[:8]}/root")
    assert not st._local
    st.put_bytes("step-000001-a1b2c3d4/model-00001-of-00001.safetensors", b"x" * 1000)
    assert st.get_bytes("step-000001-a1b2c3d4/model-00001-of-00001.safetensors") == b"x" * 1000
    assert st.list("step-000001-a1b2c3d4") == ["step-000001-a1b2c3d4/model-00001-of-00001.safetensors"]


def test_part_sizes_keep_an_object_within_s3s_ten_thousand_parts(tmp_path: Path) -> None:
    """5 MiB parts hold 48.8 GiB at most: a 50 GB file failed at part 10,001 after sending the rest."""
    from fsdp_hotload.storage import MAX_PARTS, MAX_PART_SIZE

    st = Storage(str(tmp_path), multipart_threshold=10 * 2**20)
    assert st._part_size(100 * 2**20) == 5 * 2**20
    for size in (50 * 10**9, 300 * 2**30, 4 * 10**12):
        part = st._part_size(size)
        assert part % 2**20 == 0 and -(-size // part) <= MAX_PARTS and part <= MAX_PART_SIZE, (size, part)
    with pytest.raises(ValueError, match="5 GiB"):
        st._part_size(MAX_PARTS * MAX_PART_SIZE + 1)


def test_big_bytes_go_to_an_object_store_part_by_part(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta file is bytes: above the threshold it went through pipe_file, ~10 parts at once, each a copy of
    its slice. It is now streamed from views like any large buffer, and lands whole."""
    st = Storage(s3_server.unique_uri("bigbytes"), s3_server.storage_options, multipart_threshold=6 * 2**20)
    piped: list[int] = []
    monkeypatch.setattr(st, "_pipe_file", lambda path, payload, kwargs: piped.append(len(payload)))
    data = os.urandom(13 * 2**20)
    st.put_bytes("step-000001-a1b2c3d4/model.safetensors", data)
    assert piped == [] and st.get_bytes("step-000001-a1b2c3d4/model.safetensors") == data


@pytest.mark.parametrize("prefix", ["*", "step-[12]", "step-00000?-aa"])
def test_delete_prefix_refuses_glob_characters(prefix: str) -> None:
    """fsspec's rm expands them on object stores and memory://: "*" deleted the whole root past its guard."""
    st = Storage(f"memory://glob-{uuid.uuid4().hex[:8]}")
    st.put_bytes("step-1/a", b"1")
    st.put_bytes("step-2/a", b"2")
    with pytest.raises(ValueError, match="glob character"):
        st.delete_prefix(prefix)
    assert sorted(st.list_dirs()) == ["step-1", "step-2"]


def test_a_local_write_makes_the_folders_it_created_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the file's own folder was fsynced: the snapshot folder itself, new in the root, could vanish at a
    power loss after its marker was signalled. And a long name is cut to 200 bytes, not characters."""
    synced: list[str] = []
    real_open, real_fsync = os.open, os.fsync
    fds: dict[int, str] = {}

    def spy_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        fd = real_open(path, flags, *a, **k)
        fds[fd] = os.fspath(path)
        return fd

    def spy_fsync(fd: int) -> None:
        if fd in fds:
            synced.append(fds[fd])
        real_fsync(fd)

    st = Storage(str(tmp_path / "root"))
    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    st.put_bytes("step-000001-a1b2c3d4/model-00001-of-00001.safetensors", b"abc")
    root = str(tmp_path / "root")
    assert os.path.join(root, "step-000001-a1b2c3d4") in synced and root in synced, synced
    name = "模" * 82  # 246 bytes in UTF-8: a legal name, whose temp name must stay under the 255-byte limit
    st.put_bytes(f"step-000001-a1b2c3d4/{name}", b"x")
    assert st.get_bytes(f"step-000001-a1b2c3d4/{name}") == b"x"


@pytest.mark.parametrize("err,synced", [(errno.EIO, False), (errno.ENOSPC, False), (errno.EINVAL, True)])
def test_a_failed_fsync_fails_the_local_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int,
                                              synced: bool) -> None:
    """fsync's EIO and ENOSPC were swallowed with EINVAL: the temp file was renamed in and the put returned, so a
    commit marker went on to vouch for a weight file whose pages the kernel may have dropped. Only a filesystem
    that cannot sync a file (EINVAL, ENOTSUP) passes; the fault is injected at the system call."""
    st = Storage(str(tmp_path / "root"))
    st.put_bytes("s/a.bin", b"old")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(err, os.strerror(err))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if synced:
        st.put_bytes("s/a.bin", b"new")
    else:
        with pytest.raises(StorageError, match=os.strerror(err)) as info:
            st.put_bytes("s/a.bin", b"new")
        assert info.value.attempts == 1  # not retried: the disk said no
    assert st.get_bytes("s/a.bin") == (b"new" if synced else b"old")
    assert os.listdir(tmp_path / "root" / "s") == ["a.bin"]  # no temp file left


@contextmanager
def _tls_front(files: tuple[Path, Path] | None) -> Iterator[list[int]]:
    """A TLS endpoint on loopback (yields its port in a list, then each connection's number): with ``files``
    (certificate, key) it serves the handshake and closes; without, it answers every ClientHello with a fatal TLS
    alert (internal_error), as an overloaded TLS terminator does."""
    ctx = None
    if files is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(*files)
    listener = socket.create_server(("127.0.0.1", 0))
    seen = [listener.getsockname()[1]]

    listener.settimeout(0.1)  # close() does not wake a blocked accept(): poll, so the join below is quick
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            conn.settimeout(None)
            seen.append(len(seen))
            with conn:
                try:
                    if ctx is None:
                        conn.recv(65536)
                        conn.sendall(bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x50]))
                    else:
                        ctx.wrap_socket(conn, server_side=True).recv(1)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(timeout=10)
        listener.close()


@pytest.mark.parametrize("certificate", [False, True], ids=["handshake-alert", "unverified-certificate"])
def test_tls_errors_are_retried_unless_a_certificate_fails_verification(tmp_path: Path, certificate: bool) -> None:
    """A TLS handshake refused with an alert arrives as botocore's SSLError, which is no builtin ConnectionError:
    Storage took it for fatal and gave up after one attempt, botocore's own retries being cut to two since Storage
    owns the rest. A certificate that fails verification (also an SSLError) stays fatal: retrying cannot fix it."""
    files = tls_files(tmp_path, "127.0.0.1")[1:] if certificate else None
    with _tls_front(files) as seen:
        st = Storage("s3://bkt/run", {"endpoint_url": f"https://127.0.0.1:{seen[0]}", "key": "k", "secret": "s",
                                      "client_kwargs": {"region_name": "us-east-1"}},
                     max_attempts=3, base_backoff_s=0.01)
        with pytest.raises(StorageError) as info:
            st.put_bytes("a.bin", b"x")
    assert info.value.attempts == (1 if certificate else 3), str(info.value)
    assert ("CERTIFICATE_VERIFY_FAILED" in str(info.value)) == certificate
    assert len(seen) - 1 >= info.value.attempts


@pytest.mark.parametrize("where", ["env", "options"])
def test_a_credential_ending_in_a_newline_fails_at_once_naming_it(s3_server: S3Server, where: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An access key read from a secret file keeps its newline, and botocore refuses to send the header
    ("Forbidden control character detected in headers") inside an HTTPClientError: that was retried as a dropped
    connection, for every attempt, and no message named the credential. It now fails at once, naming where the
    credential came from and never its value."""
    options = {**s3_server.storage_options, "skip_instance_cache": True}
    if where == "env":
        del options["key"], options["secret"]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key + "\n")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
        culprit = "$AWS_ACCESS_KEY_ID"
    else:
        options["key"] = s3_server.key + "\n"
        culprit = "storage_options['key']"
    st = Storage(s3_server.unique_uri("newline"), options, max_attempts=4, base_backoff_s=0.0001)
    with pytest.raises(StorageError, match="fatal error, not retried") as info:
        st.put_bytes("snap/x", b"x")
    assert info.value.attempts == 1 and st.stats.retries == 0
    assert f"{culprit} starts or ends in whitespace" in str(info.value), str(info.value)
    assert s3_server.key not in str(info.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret + "\n")  # S3 refuses the signature: named too
    assert "$AWS_SECRET_ACCESS_KEY starts or ends" in str(credential_hint(access_denied_error(), {}))
    # keys in the options are the ones botocore signs with: a stray variable in the environment is not blamed
    assert credential_hint(access_denied_error(), {"key": "k", "secret": "s"}) is None
    assert credential_hint(ConnectionError("reset"), {}) is None  # only for errors a credential causes
