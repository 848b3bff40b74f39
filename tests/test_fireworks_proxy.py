"""How HotLoadClient reaches the API: through the proxy the environment names (a CONNECT tunnel for https, the
absolute URL for http), directly for NO_PROXY and loopback hosts, and which attempts count as sent.

Real servers on loopback: a forward proxy, a TLS server with a certificate from a CA made for the test (trusted
through ``SSL_CERT_FILE``), the emulator behind the proxy under a host name that does not resolve.
"""
from __future__ import annotations

import base64
import contextlib
import json
import select
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

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.fireworks import HotLoadClient, HotLoadError, HotLoadRequestError
from fsdp_hotload.fireworks_http import NotSent, hint_for, send_once, tls_context
from fsdp_hotload.fireworks_models import never_taken
from fsdp_hotload.fireworks_proxy import ProxyUnsupported, proxy_for
from tests.emulator_fixture import EMULATOR_API_KEY, tiny_model, write_full_snapshot
from tests.http_fixture import serve, tls_files

API_HOST = "hotload-api.test"  # never resolved here: only the proxy knows where it is
_PROXY_VARS = ("http_proxy", "https_proxy", "no_proxy", "all_proxy")


def _use_proxy(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name in _PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


@contextmanager
def forward_proxy(routes: dict[str, tuple[str, int]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An HTTP proxy on loopback: CONNECT tunnels and absolute-URL requests to the hosts in ``routes``
    (``"host:port"`` -> where it really listens). Yields its URL and what it saw, one dict per request."""
    seen: list[dict[str, Any]] = []

    class Proxy(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_CONNECT(self) -> None:  # noqa: N802 - http.server's naming
            seen.append({"method": "CONNECT", "target": self.path, "auth": self.headers.get("Proxy-Authorization")})
            upstream = socket.create_connection(routes[self.path], timeout=10)
            self.send_response(200, "Connection established")
            self.end_headers()
            self.wfile.flush()
            pair = [self.connection, upstream]
            while True:
                ready, _, _ = select.select(pair, [], [], 10)
                if not ready:
                    break
                done = False
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        done = True
                        break
                    (upstream if sock is self.connection else self.connection).sendall(data)
                if done:
                    break
            upstream.close()
            self.close_connection = True

        def _forward(self) -> None:
            seen.append({"method": self.command, "target": self.path, "auth": self.headers.get("Proxy-Authorization"),
                         "authorization": self.headers.get("Authorization")})
            netloc = self.path.split("://", 1)[1].split("/", 1)[0]
            host, port = routes[netloc if ":" in netloc else f"{netloc}:80"]
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() != "proxy-authorization"}
            path = "/" + self.path.split("://", 1)[1].split("/", 1)[1]
            with socket.create_connection((host, port), timeout=10) as up:
                head = f"{self.command} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                up.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)
                reply = b""
                while chunk := up.recv(65536):
                    reply += chunk
            self.connection.sendall(reply)
            self.close_connection = True

        do_GET = do_POST = _forward  # noqa: N815

    with serve(Proxy) as url:
        yield url, seen


@contextmanager
def tls_api(cert: Path, key: Path) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """A TLS server answering every signal with {"status": "ok"}; yields its port and the requests it got."""
    got: list[dict[str, Any]] = []

    class Api(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append({"path": self.path, "host": self.headers["Host"], "body": body,
                        "authorization": self.headers.get("Authorization")})
            out = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], got
    finally:
        httpd.shutdown()
        httpd.server_close()


def _client(url: str, **kw: Any) -> HotLoadClient:
    opts: dict[str, Any] = dict(account_id="acct", model_id="m", deployment_id="dep", api_key=EMULATOR_API_KEY,
                                backoff_initial_s=0.01, backoff_max_s=0.05, retry_budget_s=5, poll_interval_s=0.02)
    opts.update(kw)
    return HotLoadClient(url, **opts)


def test_an_https_api_is_reached_through_the_proxys_tunnel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a cluster whose outbound traffic must pass a proxy, the uploads (boto) used HTTPS_PROXY and every signal
    failed to resolve the API's host. Now the client tunnels through it, TLS checked against the API's name, and
    sends the proxy's credentials to the proxy only."""
    ca, cert, key = tls_files(tmp_path, API_HOST)
    with tls_api(cert, key) as (port, got), forward_proxy({f"{API_HOST}:443": ("127.0.0.1", port)}) as (proxy, seen):
        _use_proxy(monkeypatch, https_proxy=proxy.replace("http://", "http://us%40er:p%3Ass@"),
                   SSL_CERT_FILE=str(ca))
        client = _client(f"https://{API_HOST}")
        assert client.signal("step-1") == {"status": "ok"}
    assert [(s["method"], s["target"]) for s in seen] == [("CONNECT", f"{API_HOST}:443")]
    assert seen[0]["auth"] == "Basic " + base64.b64encode(b"us@er:p:ss").decode()
    assert got == [{"path": "/hot_load/v1/models/hot_load", "host": API_HOST, "body": {"identity": "step-1"},
                    "authorization": f"Bearer {EMULATOR_API_KEY}"}]


def test_an_http_api_behind_the_proxy_is_signalled_and_polled(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulator under a name only the proxy can reach: a full snapshot signalled, waited for and served."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    with HotLoadEmulator(str(bucket), replicas=2, api_key=EMULATOR_API_KEY) as emu:
        port = int(emu.url.rsplit(":", 1)[1])
        with forward_proxy({f"{API_HOST}:80": ("127.0.0.1", port)}) as (proxy, seen):
            _use_proxy(monkeypatch, http_proxy=proxy)
            client = _client(f"http://{API_HOST}", allow_insecure=True)
            write_full_snapshot(emu.bucket, "step-1", tiny_model(0))
            client.signal("step-1")
            client.wait_ready("step-1", timeout_s=30)
        assert seen[0]["method"] == "POST" and seen[0]["target"] == f"http://{API_HOST}/hot_load/v1/models/hot_load"
        assert all(s["target"].startswith(f"http://{API_HOST}/") and s["auth"] is None for s in seen)
        assert any(s["method"] == "GET" for s in seen)
        assert [r["identity"] for r in emu.state()["deployments"]["accounts/acct/deployments/dep"]["replicas"]] == \
            ["step-1", "step-1"]


def test_no_proxy_and_loopback_hosts_connect_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy cannot reach the trainer's loopback (a local emulator or gateway), and NO_PROXY names hosts that
    must not go through it; an https:// proxy is refused by name, not by a failed handshake."""
    with forward_proxy({}) as (proxy, seen):
        for env in ({"http_proxy": proxy}, {"http_proxy": proxy, "no_proxy": "localhost"}):
            _use_proxy(monkeypatch, **env)
            for host in ("127.0.0.1", "localhost", "[::1]"):
                client = _client(f"http://{host}:9", retry_budget_s=0.2)  # nothing listens on port 9
                with pytest.raises(HotLoadError, match="ConnectionRefusedError|NotSent"):
                    client.signal("step-1")
        _use_proxy(monkeypatch, http_proxy=proxy, no_proxy=API_HOST)
        with pytest.raises(HotLoadError, match="gaierror|NotSent"):  # resolved here, so not found
            _client(f"http://{API_HOST}", allow_insecure=True, retry_budget_s=0.2).signal("step-1")
        assert seen == []
        _use_proxy(monkeypatch, https_proxy="https://user:hunter22@proxy.example:3128")
        with pytest.raises(HotLoadRequestError, match="http:// proxy only") as err:
            _client(f"https://{API_HOST}").signal("step-1")
        assert "hunter22" not in str(err.value) and "NO_PROXY" in str(err.value)


def test_an_ipv6_literal_without_a_port_gets_the_schemes_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given no port, http.client re-parsed the host: ``http://[::1]/`` went to host ':' on port 1."""
    from fsdp_hotload.fireworks_http import send_once

    _use_proxy(monkeypatch)
    with pytest.raises(OSError) as err:  # nothing listens on [::1]:80 here (or no IPv6): refused, not a DNS error
        send_once(__import__("urllib.parse").parse.urlsplit("http://[::1]"), "GET", "/x", None, {}, 2.0,
                  ssl.create_default_context())
    assert not isinstance(err.value.__cause__ or err.value, socket.gaierror), repr(err.value)


def test_a_409_is_an_earlier_attempt_accepted_only_if_one_was_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that came up late answered the second try with 409: the signal was taken as accepted (by an
    attempt that never left this host), and the readiness wait ran out ready_timeout_s later. Refused
    connections are no longer counted as sent, so the 409 is raised."""
    _use_proxy(monkeypatch)
    posts: list[str] = []

    class Conflict(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            posts.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            out = b'{"error": {"message": "identity step-2 was already used"}}'
            self.send_response(409)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Conflict, bind_and_activate=False)
    httpd.server_bind()  # bound, not listening: connections are refused until server_activate()
    port = httpd.server_address[1]
    threading.Timer(0.3, lambda: (httpd.server_activate(), threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start())).start()
    try:
        client = _client(f"http://127.0.0.1:{port}", backoff_initial_s=0.1, backoff_max_s=0.2)
        with pytest.raises(HotLoadError, match="HTTP 409") as err:
            client.signal("step-2")
        assert err.value.attempts == 1 and posts == ["/hot_load/v1/models/hot_load"]
        assert not never_taken(err.value)  # a conflict: the server may hold that identity
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_400_to_a_status_poll_points_at_the_model_and_deployment(tmp_path: Path) -> None:
    """Every 400 got the signal's advice (the identity, the delta's parent), also a status poll's, which carries
    neither: a wrong model_id is named by the headers it travels in."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    with HotLoadEmulator(str(bucket), replicas=1, api_key=EMULATOR_API_KEY) as emu:
        _client(emu.url, model_id="m").status()  # the deployment now serves model m
        with pytest.raises(HotLoadError, match="fireworks-model") as err:
            _client(emu.url, model_id="other").status()
    assert "check model_id" in str(err.value) and "incremental_snapshot_metadata" not in str(err.value)


def test_a_certificate_that_fails_verification_is_not_retried(tmp_path: Path) -> None:
    """ssl's verification error is an OSError, so the connect wrapped it as a connection that could not be made
    and the client retried it for its whole budget, ending in "no answer" rather than the certificate's fault."""
    _, cert, key = tls_files(tmp_path, API_HOST)  # signed by a CA this client does not trust
    with tls_api(cert, key) as (port, got):
        client = _client(f"https://127.0.0.1:{port}", retry_budget_s=30)
        started = time.monotonic()
        with pytest.raises(HotLoadError, match="TLS certificate verification failed") as info:
            client.signal("step-1")
        assert time.monotonic() - started < 5.0
    assert "system CA certificates" in str(info.value) and got == []
    assert never_taken(info.value)


@pytest.mark.parametrize("answers, taken", [([400], False), ([404], False), ([503, 400], True), ([503, 503], True),
                                            ([None], False)],
                         ids=["400", "404", "503-then-400", "503s", "refused"])
def test_a_signal_is_never_taken_only_where_no_attempt_can_have_reached_the_server(
        monkeypatch: pytest.MonkeyPatch, answers: list[int | None], taken: bool) -> None:
    """never_taken (a committed snapshot no deployment took is deleted at once): a 4xx to the only attempt that
    reached the server, or no attempt that did; not once a 5xx answered an earlier one (the server may have acted
    on it), nor when every attempt got a 5xx."""
    _use_proxy(monkeypatch)
    left = list(answers)

    class Scripted(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            status = left.pop(0) if len(left) > 1 else left[0]
            out = b'{"error": {"message": "scripted"}}'
            self.send_response(status or 500)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    if answers == [None]:  # bound, never listening: every connection is refused
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        try:
            with pytest.raises(HotLoadError, match="no answer") as err:
                _client(f"http://127.0.0.1:{sock.getsockname()[1]}", retry_budget_s=0.3).signal("step-1")
        finally:
            sock.close()
    else:
        with serve(Scripted) as url, pytest.raises(HotLoadError, match="HTTP") as err:
            _client(url, retry_budget_s=1.0).signal("step-1")
    assert never_taken(err.value) is not taken, (err.value, err.value.attempts)


@contextmanager
def refusing_proxy(status: int) -> Iterator[tuple[str, list[str]]]:
    """A proxy that answers every request, CONNECT included, with ``status``; yields its URL and request lines."""
    lines: list[str] = []

    class Refuse(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def refuse(self) -> None:
            lines.append(self.requestline)
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            out = b"<html>ERR_ACCESS_DENIED</html>"
            self.send_response(status)
            self.send_header("Proxy-Authenticate", 'Basic realm="corp"')
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_CONNECT = refuse  # noqa: N815

    with serve(Refuse) as url:
        yield url, lines


@pytest.mark.parametrize("status, words", [(407, "credentials"), (403, "does not allow this host")])
def test_a_proxy_refusing_the_tunnel_is_raised_at_once_naming_the_proxy(
        monkeypatch: pytest.MonkeyPatch, status: int, words: str) -> None:
    """A 407 or 403 to CONNECT was retried for the whole budget as a connection that failed, with a hint about
    DNS and firewalls. It is now raised after one try, naming the proxy (without its password) and what to fix."""
    with refusing_proxy(status) as (proxy, lines):
        _use_proxy(monkeypatch, https_proxy=proxy.replace("http://", "http://user:hunter22@"))
        started = time.monotonic()
        with pytest.raises(HotLoadRequestError, match=f"refused the tunnel: HTTP {status}") as err:
            _client(f"https://{API_HOST}", retry_budget_s=30).signal("step-1")
        assert time.monotonic() - started < 5.0
    assert lines == [f"CONNECT {API_HOST}:443 HTTP/1.1"]
    text = str(err.value)
    assert proxy.removeprefix("http://") in text and "hunter22" not in text and words in (err.value.hint or "")
    assert "NO_PROXY" in (err.value.hint or "") and never_taken(err.value)


def test_a_proxy_failing_to_reach_the_api_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 502 to CONNECT (the proxy's upstream is down) may pass: it is retried, and said to be the proxy's."""
    with refusing_proxy(502) as (proxy, lines):
        _use_proxy(monkeypatch, https_proxy=proxy)
        with pytest.raises(HotLoadError, match="no answer") as err:
            _client(f"https://{API_HOST}", retry_budget_s=2.0).signal("step-1")
    assert len(lines) > 1 and "could not open a tunnel" in str(err.value)
    assert f"the proxy {proxy}" in (err.value.hint or "")


@pytest.mark.parametrize("status", [403, 407])
def test_a_403_or_407_through_a_proxy_to_an_http_api_may_be_the_proxys(
        monkeypatch: pytest.MonkeyPatch, status: int) -> None:
    """A plain-HTTP request goes to the proxy whole, so its refusal came back as the API's answer: a 403 was
    explained as the API key lacking permission, and a 407 got no hint at all."""
    with refusing_proxy(status) as (proxy, lines):
        _use_proxy(monkeypatch, http_proxy=proxy)
        with pytest.raises(HotLoadError, match=f"HTTP {status} \\(through the proxy {proxy}") as err:
            _client(f"http://{API_HOST}", allow_insecure=True).signal("step-1")
    hint = err.value.hint or ""
    assert len(lines) == 1 and "proxy" in hint and "NO_PROXY" in hint and "lacks permission" not in hint
    _use_proxy(monkeypatch)
    assert "credentials" in (hint_for(407) or "")  # a 407 with no proxy configured: one further on the path


def test_a_proxy_whose_name_does_not_resolve_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure read word for word as an API host that does not resolve, blamed on base_url."""
    _use_proxy(monkeypatch, https_proxy="http://corp-proxy.nonexistent.invalid:3128")
    with pytest.raises(HotLoadError, match="via proxy http://corp-proxy.nonexistent.invalid:3128") as err:
        _client(f"https://{API_HOST}", retry_budget_s=0).signal("step-1")
    assert "resolving the host name 'corp-proxy.nonexistent.invalid'" in str(err.value)
    assert "check that the proxy http://corp-proxy.nonexistent.invalid:3128" in (err.value.hint or "")


def test_no_proxy_matches_addresses_blocks_and_ports_as_curl_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib's proxy_bypass matched text suffixes only: a CIDR block or a bare IPv6 address in NO_PROXY sent a
    private gateway's traffic to the proxy. ALL_PROXY is the fallback for either scheme."""
    def route(url: str) -> str | None:
        proxy = proxy_for(urllib.parse.urlsplit(url))
        return None if proxy is None else proxy.netloc

    no_proxy = "localhost, .corp.example,10.0.0.0/8 ,fd00::/8,2001:db8::7,[2001:db8::8]:8083,gw.example:8083"
    _use_proxy(monkeypatch, HTTP_PROXY="http://p:1", HTTPS_PROXY="http://s:2", NO_PROXY=no_proxy)
    for direct in ("http://10.1.2.3:8083", "https://[fd00::5]", "http://[2001:db8::7]:80", "http://[2001:db8::8]:8083",
                   "https://api.corp.example", "http://corp.example", "http://gw.example:8083"):
        assert route(direct) is None, direct
    for proxied, via in (("http://11.1.2.3", "p:1"), ("https://[2001:db8::9]", "s:2"), ("http://[2001:db8::8]", "p:1"),
                         ("https://notcorp.example", "s:2"), ("http://gw.example:80", "p:1")):
        assert route(proxied) == via, proxied
    _use_proxy(monkeypatch, ALL_PROXY="http://a:3", https_proxy="http://s:2")
    assert (route("http://api.example"), route("https://api.example")) == ("a:3", "s:2")
    _use_proxy(monkeypatch, ALL_PROXY="a:3")  # no scheme: http
    assert route("https://api.example") == "a:3"


def test_a_socks_all_proxy_is_passed_by_and_a_schemes_own_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """ALL_PROXY=socks5h://... alone (dev images, VPN tools) made every signal fail at once as an unsupported proxy,
    while the uploads (boto reads the scheme's variable only) went direct. It is passed by, said once."""
    caplog.set_level("INFO", logger="fsdp_hotload")
    _use_proxy(monkeypatch, ALL_PROXY="socks5h://127.0.0.1:1080")
    assert proxy_for(urllib.parse.urlsplit("https://api.example")) is None
    assert proxy_for(urllib.parse.urlsplit("http://api.example")) is None
    told = [r.getMessage() for r in caplog.records if "ALL_PROXY" in r.getMessage()]
    assert len(told) == 1 and "connects directly" in told[0], told
    _use_proxy(monkeypatch, HTTPS_PROXY="socks5://127.0.0.1:1080")
    with pytest.raises(ProxyUnsupported, match="HTTPS_PROXY"):
        proxy_for(urllib.parse.urlsplit("https://api.example"))


@pytest.mark.parametrize("value", ["http://proxy.corp:abc", "http://proxy.corp:70000"])
def test_a_proxy_port_that_is_no_port_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                                     value: str) -> None:
    """It passed the proxy check, then failed in the request as 'the request could not be sent', with a hint about
    headers and the API key, naming no variable."""
    _use_proxy(monkeypatch, HTTPS_PROXY=value)
    with pytest.raises(ProxyUnsupported, match="HTTPS_PROXY.*no valid port"):
        proxy_for(urllib.parse.urlsplit("https://api.example"))


@pytest.mark.parametrize("cut_by", ["until", "timeout"])
def test_a_tunnel_the_callers_wait_cuts_says_so(monkeypatch: pytest.MonkeyPatch, cut_by: str) -> None:
    """A proxy that accepts the connection and never answers CONNECT, cut by the caller's until() (a released
    straggler wait): the reader saw an end of file, and the error read 'Remote end closed connection without
    response', sending the user after a proxy that closes connections. Cut by the attempt's timeout, it read
    'the response did not arrive in full', as if a request had been sent."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(srv.accept()[0])  # reads nothing, answers nothing

    threading.Thread(target=accept, daemon=True).start()
    port = srv.getsockname()[1]
    _use_proxy(monkeypatch, HTTPS_PROXY=f"http://127.0.0.1:{port}")
    release = [float("inf")]
    timer = threading.Timer(0.3, lambda: release.__setitem__(0, time.monotonic() + 0.2))
    timer.start()
    try:
        with pytest.raises(NotSent) as err:
            send_once(urllib.parse.urlsplit("https://api.example.invalid"), "GET", "/x", None, {},
                      30.0 if cut_by == "until" else 0.5, tls_context(), until=lambda: release[0])
    finally:
        timer.cancel()
        srv.close()
        for conn in held:
            conn.close()
    assert "RemoteDisconnected" not in str(err.value) and "did not arrive" not in str(err.value), err.value
    if cut_by == "until":
        assert "wait ended" in str(err.value), err.value
        assert f"while waiting for the proxy http://127.0.0.1:{port} to answer CONNECT" in str(err.value), err.value
    else:
        assert f"the proxy http://127.0.0.1:{port} did not answer CONNECT within 0.5s" in str(err.value), err.value


def _local_address() -> str | None:
    """This host's address on its default route (none on a host without one): a non-loopback API to reach."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: only the route is chosen
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_an_api_in_a_no_proxy_block_is_reached_directly_and_all_proxy_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end with real servers: the emulator on this host's own (non-loopback) address, named by a CIDR block
    in NO_PROXY, is reached directly; with only ALL_PROXY set, a host only the proxy knows is reached through it."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    with HotLoadEmulator(str(bucket), replicas=1, api_key=EMULATOR_API_KEY) as emu:
        port = int(emu.url.rsplit(":", 1)[1])
        with forward_proxy({f"{API_HOST}:80": ("127.0.0.1", port)}) as (proxy, seen):
            _use_proxy(monkeypatch, ALL_PROXY=proxy)
            _client(f"http://{API_HOST}", allow_insecure=True).status()
            assert [s["target"] for s in seen] == [f"http://{API_HOST}/hot_load/v1/models/hot_load"]
            address = _local_address()
            if address is None:
                pytest.skip("no non-loopback IPv4 address on this host")
            with ThreadingHTTPServer((address, 0), _Emulated) as api:
                threading.Thread(target=api.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
                block = ".".join(address.split(".")[:3]) + ".0/24"
                _use_proxy(monkeypatch, HTTP_PROXY=proxy, NO_PROXY=f"localhost,{block}")
                status = _client(f"http://{address}:{api.server_address[1]}", allow_insecure=True).status()
                api.shutdown()
            assert len(seen) == 1 and [r.current_snapshot_identity for r in status.replicas] == ["s1"]


class _Emulated(BaseHTTPRequestHandler):
    """A status endpoint with one replica serving ``s1``."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        out = json.dumps({"replicas": [{"current_snapshot_identity": "s1", "readiness": True}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
