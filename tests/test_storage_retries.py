"""Storage retries and deadlines, with injected faults and real servers on loopback: throttles and their backoff,
transient against fatal failures, put_many's bounds and failures, endpoints that never answer or hang up, multipart
puts and aborts cut off by their deadline, and TLS failures."""
from __future__ import annotations

import os
import socket
import ssl
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import fsspec
import pytest

from fsdp_hotload.storage import Storage, StorageError
from tests.s3_fixture import FaultyFileSystem, S3Server, StallingProxy, access_denied_error, slowdown_error
from tests.http_fixture import tls_files
from tests.test_storage import MiB
from tests.test_storage_s3 import _open_uploads


class FixedRng:
    """Stands in for random.Random so a test can pin the jitter draw."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


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
