"""What the hot-load client makes of a response cut short, a port that does not speak TLS, a private CA named the
way ``requests`` reads it, a redirect, and an exchange that stops part way.

Real servers on loopback: raw sockets scripting the bytes of an answer, ``http.server`` handlers, and a TLS server
with a certificate from a CA made for the test.
"""
from __future__ import annotations

import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fsdp_hotload.fireworks import HotLoadClient, HotLoadError, HotLoadRequestError
from fsdp_hotload.fireworks_models import never_taken
from tests.http_fixture import serve, tls_files

_ENV = ("http_proxy", "https_proxy", "no_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


@pytest.fixture(autouse=True)
def _plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


def _client(url: str, **kw: Any) -> HotLoadClient:
    opts: dict[str, Any] = dict(account_id="a", model_id="m", deployment_id="d", api_key="k" * 20,
                                backoff_initial_s=0.05, backoff_max_s=0.1, retry_budget_s=3, timeout_s=2)
    opts.update(kw)
    return HotLoadClient(url, **opts)


@contextmanager
def scripted(replies: list[bytes]) -> Iterator[tuple[str, list[int]]]:
    """A raw server that answers the n-th request with ``replies[n]`` (the last one from then on), then closes the
    connection; an empty reply sends nothing, and one that ends in ``HOLD`` is sent whole (those four bytes too),
and either holds the connection open. Yields its URL and a request counter."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    count = [0]
    held: list[socket.socket] = []

    def loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += conn.recv(65536)
            reply = replies[min(count[0], len(replies) - 1)]
            count[0] += 1
            if not reply:
                held.append(conn)
                continue
            conn.sendall(reply)
            if not reply.endswith(b"HOLD"):
                conn.close()
            else:
                held.append(conn)

    threading.Thread(target=loop, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", count
    finally:
        listener.close()
        for conn in held:
            conn.close()


def test_a_body_cut_before_its_content_length_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """The body was read with read1, which ends quietly at an early end of file: a 200 to a signal whose body the
    connection cut failed at once as "a body that is not JSON", and the deployment counted as failed."""
    whole = b'{"status": "ok"}'
    replies = [b'HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n{"status": ',
               b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(whole), whole)]
    with scripted(replies) as (url, count):
        assert _client(url).signal("s1") == {"status": "ok"}
    assert count[0] == 2
    with scripted(replies[:1]) as (url, count), pytest.raises(HotLoadError, match="IncompleteRead") as err:
        _client(url, retry_budget_s=1.0).signal("s1")
    assert "not JSON" not in str(err.value) and "no complete answer" in str(err.value)


def test_an_https_url_at_a_plain_http_port_is_refused_at_once() -> None:
    """The handshake failed the same way on every attempt and was retried for the whole budget (300 s by default)
    with a hint about DNS and firewalls; the fix is in the URL."""
    hits: list[str] = []

    class Plain(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - never reached: the client speaks TLS
            hits.append(self.path)

    with serve(Plain) as url:
        started = time.monotonic()
        with pytest.raises(HotLoadRequestError, match="does not speak TLS") as err:
            _client(url.replace("http://127.0.0.1", "https://localhost"), retry_budget_s=30).signal("s1")
    assert time.monotonic() - started < 5.0 and hits == []
    assert "use http://" in (err.value.hint or "") and "hotload_api_allow_http" in (err.value.hint or "")
    assert never_taken(err.value)


@contextmanager
def tls_api(tmp_path: Path, key_ids: bool = True) -> Iterator[tuple[str, Path]]:
    """A TLS server for ``localhost`` answering ``{}`` to every signal; yields its URL and its CA's file
    (``key_ids``: see :func:`~tests.http_fixture.tls_files`)."""
    ca, cert, key = tls_files(tmp_path, "localhost", key_ids)

    class Api(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    class Quiet(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:  # a client refusing the CA: expected
            pass

    httpd = Quiet(("127.0.0.1", 0), Api)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"https://localhost:{httpd.server_address[1]}", ca
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"])
def test_a_private_ca_named_as_requests_reads_it_is_trusted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """Only SSL_CERT_FILE/SSL_CERT_DIR worked: the variables users set for requests, pip and huggingface_hub were
    ignored, and the verification error named none of them."""
    with tls_api(tmp_path) as (url, ca):
        with pytest.raises(HotLoadRequestError, match="verification failed") as err:
            _client(url).signal("s1")
        assert "SSL_CERT_FILE" in (err.value.hint or "") and "REQUESTS_CA_BUNDLE" in (err.value.hint or "")
        monkeypatch.setenv(variable, str(ca))
        assert _client(url).signal("s1") == {}
        monkeypatch.setenv(variable, str(tmp_path / "missing.pem"))
        with pytest.raises(ValueError, match=variable):
            _client(url)
        # a client of an http:// API never uses TLS: a stale bundle variable must not fail it
        assert _client("http://127.0.0.1:9")._ssl is None


def test_a_chain_refused_by_strict_checks_is_said_to_be_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.13's default context verifies strictly (``VERIFY_X509_STRICT``): a private CA's certificates
    without key identifiers are refused although the CA is trusted, and the hint told the user to trust the CA,
    which they had done. The check is set here by hand, as 3.13 sets it."""
    from fsdp_hotload.fireworks_http import send_once, tls_context, unsendable

    with tls_api(tmp_path, key_ids=False) as (url, ca):
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(ca))
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        base = urllib.parse.urlsplit(url)
        strict = tls_context()
        if not strict.verify_flags & ssl.VERIFY_X509_STRICT:  # before Python 3.13: the CA alone is checked
            assert _client(url).signal("s1") == {}
        strict.verify_flags |= ssl.VERIFY_X509_STRICT
        with pytest.raises(ssl.SSLCertVerificationError) as err:
            send_once(base, "GET", "/", None, {}, 10.0, strict)
        said = unsendable(err.value, base)
        assert said is not None and "Key Identifier" in said[1] and "Python 3.13" in said[1], said
        assert "point SSL_CERT_FILE" not in said[1], said


def test_a_redirect_hint_offers_the_base_url_without_the_request_path() -> None:
    """The hint offered Location whole: set as hotload_api_url, it had the request's path added a second time."""
    class Moved(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(307)
            self.send_header("Location", "https://new.example/v2" + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()

    with serve(Moved) as url, pytest.raises(HotLoadError, match="HTTP 307") as err:
        _client(url).signal("s1")
    assert "Location: https://new.example/v2/hot_load/v1/models/hot_load" in str(err.value)
    assert "final URL (https://new.example/v2)" in (err.value.hint or "")


def test_a_timeout_says_how_far_the_exchange_got() -> None:
    """A server that never answered and one whose body stopped ended with the same words, and both as "no
    answer"; the first points at a hung server or proxy, the second at a slow or cut stream."""
    stalled = b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"repl' + b"HOLD"  # 10 of the body's 100 bytes
    with scripted([b""]) as (silent, _), scripted([stalled]) as (stalling, _):
        with pytest.raises(HotLoadError) as quiet:
            _client(silent, retry_budget_s=1, timeout_s=0.6).status()
        with pytest.raises(HotLoadError) as stopped:
            _client(stalling, retry_budget_s=1, timeout_s=0.6).status()
    assert "no answer" in str(quiet.value) and "waiting for the status line" in str(quiet.value)
    assert "no complete answer" in str(stopped.value) and "reading the body, after 10 of 100 bytes" in \
        str(stopped.value), str(stopped.value)
