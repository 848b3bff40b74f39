"""HotLoadClient's time and size bounds on the wire, against real servers on loopback that misbehave."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from fsdp_hotload.fireworks import HotLoadClient, HotLoadError, HotLoadTimeout
from fsdp_hotload.fireworks_http import MAX_RESPONSE_BYTES

from tests.http_fixture import serve

KEY = "fw-secret-key-4f1d9a"


def make_client(url: str, **kw: Any) -> HotLoadClient:
    opts: dict[str, Any] = dict(account_id="acct", model_id="m", deployment_id="d", api_key=KEY,
                                backoff_initial_s=0.01, backoff_max_s=0.05, retry_budget_s=5, poll_interval_s=0.02)
    opts.update(kw)
    return HotLoadClient(url, **opts)


@contextmanager
def tcp_server(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A raw TCP server on loopback that gives each connection to ``handle`` on its own thread; every connection
    is closed on exit."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = lsn.accept()
            except OSError:
                return
            held.append(conn)
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{lsn.getsockname()[1]}"
    finally:
        lsn.close()
        for conn in held:
            conn.close()


def silent_server() -> Any:
    """Accepts connections and reads nothing, answers nothing: a request sent there waits for its timeout."""
    return tcp_server(lambda conn: None)


def test_an_attempt_never_outlasts_the_retry_budget() -> None:
    """Without a deadline (signal, reset_ledger) the last attempt used to take the full timeout_s, so a server
    that takes the request and never answers held the call far past retry_budget_s (and longest_signal_s)."""
    with silent_server() as url:
        client = make_client(url, retry_budget_s=1.0, timeout_s=10.0)
        for call in (lambda: client.signal("s1"), client.reset_ledger):
            started = time.monotonic()
            with pytest.raises(HotLoadError, match="no answer after"):
                call()
            assert time.monotonic() - started < 3.0


def test_retrying_without_backoff_past_a_thousand_attempts_ends_with_a_hot_load_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With backoff_initial_s=0 a refused connection is retried at once; the delay came from 0 * 2**(attempt-1),
    a float times an int that overflows past attempt 1025, so the call ended in OverflowError, which neither
    callers nor wait_ready's polling expect. The attempts are counted, not timed: a loaded 2-core CI made fewer
    than 1100 in a 3 s budget (745 once), and the test then said nothing."""
    import fsdp_hotload.fireworks as fw

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # nothing listens there now: every attempt is refused at once
    real, calls = fw.send_once, [0]

    def refused_then_400(*args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] <= 1100:
            return real(*args, **kw)  # refused: retried at once, past the overflow at attempt 1025
        return 400, {}, b'{"error": {"message": "enough"}}', False  # not retried: ends the call

    monkeypatch.setattr(fw, "send_once", refused_then_400)
    client = make_client(url, retry_budget_s=300.0, backoff_initial_s=0.0, backoff_max_s=0.0)
    with pytest.raises(HotLoadError, match="HTTP 400 after 1101 attempts: enough"):
        client.signal("s1")


def answering(status: int, body: bytes, *, trickle_s: float = 0.0, length: bool = True,
              headers: dict[str, str] | None = None) -> Any:
    """A handler class that answers every request with ``status``, ``headers`` and ``body``: a byte every
    ``trickle_s`` seconds if set, and without a Content-Length (the body ends when the connection closes) if
    ``length`` is False."""
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(n)
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if length:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                if trickle_s:
                    for b in body:
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(trickle_s)
                else:
                    self.wfile.write(body)
            except OSError:  # the client gave up; that is what is tested
                pass

        do_GET = do_POST = do_DELETE = _any

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def test_a_trickled_status_body_cannot_hold_the_wait_past_its_timeout() -> None:
    """The socket timeout bounds one read, so a server sending a byte every 50 ms kept wait_ready reading one
    answer for seconds after its timeout_s; now each exchange has an absolute deadline."""
    body = b'{"replicas": [{"current_snapshot_identity": "old", "readiness": true}]}' + b" " * 40
    with serve(answering(200, body, trickle_s=0.05)) as url:
        started = time.monotonic()
        with pytest.raises(HotLoadTimeout, match="not served by every replica within 1s"):
            make_client(url, timeout_s=30).wait_ready("new", timeout_s=1.0)
        assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("length", [True, False])
def test_a_response_body_is_capped(length: bool) -> None:
    """A status body over MAX_RESPONSE_BYTES is no answer from the hot-load API: it is not read whole (with or
    without a Content-Length) and the wait says why it got nothing. An error body that size still gives its
    start as the server's message."""
    big = b'{"replicas": [{"current_snapshot_identity": "s1", "readiness": true}], "pad": "'
    big += b"x" * MAX_RESPONSE_BYTES + b'"}'
    with serve(answering(200, big, length=length)) as url:
        with pytest.raises(HotLoadTimeout, match=f"over {MAX_RESPONSE_BYTES} bytes"):
            make_client(url).wait_ready("s1", timeout_s=0.3)
    with serve(answering(400, b"no such route " + b"y" * (2 * MAX_RESPONSE_BYTES), length=length)) as url:
        with pytest.raises(HotLoadError, match="HTTP 400: no such route yyy"):
            make_client(url).signal("s1")


def trickling_headers_server() -> Any:
    """Answers a status line, then one header byte every 50 ms for as long as the client reads: each read
    succeeds well within any socket timeout, and http.client takes up to 100 header lines of 64 KiB."""

    def trickle(conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Pad: ")
            for _ in range(2000):
                conn.sendall(b"a")
                time.sleep(0.05)
        except OSError:  # the client gave up: that is what is tested
            pass

    return tcp_server(trickle)


def test_trickled_headers_cannot_hold_the_wait_past_its_timeout() -> None:
    """The status line and headers were read under the per-read socket timeout only: a header arriving a byte
    every 50 ms held wait_ready(1 s) for as long as the server went on (100 s here)."""
    with trickling_headers_server() as url:
        started = time.monotonic()
        with pytest.raises(HotLoadTimeout, match="within 1s.*did not arrive in full"):
            make_client(url, timeout_s=30).wait_ready("new", timeout_s=1.0)
        assert time.monotonic() - started < 3.0


def _cancel_after(client: HotLoadClient, seconds: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), client.cancel()), daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("where", ["on the wire", "between polls", "between retries"])
def test_cancel_ends_a_wait_or_request_at_once(where: str) -> None:
    """A publisher that gave up on its snapshots (close(timeout=)) left its thread polling the deployment for up
    to ready_timeout_s; cancel() ends the request on the wire, the sleep between polls and the retry backoff."""
    from fsdp_hotload.fireworks import HotLoadCancelled

    not_ready = b'{"replicas": [{"current_snapshot_identity": "old", "readiness": true}]}'
    if where == "on the wire":
        server, call = silent_server(), lambda c: c.signal("s1")
        kw: dict[str, Any] = dict(timeout_s=60, retry_budget_s=60)
    elif where == "between polls":
        server, call = serve(answering(200, not_ready)), lambda c: c.wait_ready("new", timeout_s=60)
        kw = dict(poll_interval_s=30)
    else:
        server, call = serve(answering(503, b"busy")), lambda c: c.signal("s1")
        kw = dict(retry_budget_s=60, backoff_initial_s=30, backoff_max_s=30)
    with server as url:
        client = make_client(url, **kw)
        started = time.monotonic()
        _cancel_after(client, 0.3)
        with pytest.raises(HotLoadCancelled, match="cancelled"):
            call(client)
        assert time.monotonic() - started < 2.0
        started = time.monotonic()
        with pytest.raises(HotLoadCancelled):  # and every later call, without sending anything
            client.status()
        assert time.monotonic() - started < 0.5
    for _ in range(100):  # each exchange's watchdog ends with it
        if not [t for t in threading.enumerate() if t.name == "hotload-http-watchdog"]:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("a watchdog thread outlived its exchange")
