"""Test helpers for gs:// roots: a real GCS JSON API server on loopback (gcp-storage-emulator, pure Python), and an
HTTP proxy in front of it that stalls chosen requests.

``gcs_server`` is a session fixture; import it into a conftest or a test module::

    from tests.gcs_fixture import gcs_server  # noqa: F401

    def test_upload(gcs_server):
        st = Storage(gcs_server.unique_uri("upload"), gcs_server.storage_options)

gcsfs must be imported with ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (tests/conftest.py sets it): its default
filesystem asks the bucket's layout over gRPC, which the emulator does not serve, and waits up to 60 s per call.

The emulator's reading of a one-request upload (``uploadType=multipart``, gcsfs's path for every object under its
block size) is replaced here (:func:`keep_trailing_cr`): it lost an object's last byte when that byte was 0x0d.

``StallingGcsProxy`` forwards every request to the emulator, except those its ``stall`` predicate picks (by method
and path), which it reads and never answers: an endpoint that accepts a request and goes silent::

    with StallingGcsProxy(gcs_server.endpoint_url, lambda method, path: "upload_id" in path) as proxy:
        options = {**gcs_server.storage_options, "endpoint_url": proxy.url}
"""
from __future__ import annotations

import contextlib
import http.client
import json
import logging
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import pytest

_PROJECT = "hotload-test"


@dataclass
class GcsServer:
    """A running GCS emulator on 127.0.0.1 with one bucket; the connection details for gcsfs."""

    endpoint_url: str
    bucket: str
    project: str = _PROJECT
    _counter: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 30)), repr=False)

    @property
    def storage_options(self) -> dict[str, Any]:
        """gcsfs options (a fresh dict each time, so callers may change theirs). ``token="anon"`` sends no
        credentials, so gcsfs never looks for a service account or the metadata server."""
        return {"endpoint_url": self.endpoint_url, "token": "anon", "project": self.project}

    def uri(self, prefix: str = "") -> str:
        prefix = prefix.strip("/")
        return f"gs://{self.bucket}/{prefix}" if prefix else f"gs://{self.bucket}"

    def unique_uri(self, label: str = "t") -> str:
        """A prefix no other test uses (the server and bucket are shared by the whole session)."""
        return self.uri(f"{label}-{next(self._counter)}-{uuid.uuid4().hex[:8]}")


def split_related(body: bytes, content_type: str) -> tuple[bytes, bytes, str]:
    """The metadata, the content and the content's type of a ``multipart/related`` upload body, split at its
    boundary lines by hand. The line break before each boundary line is the boundary's, in the style the body's
    first boundary line ends with (gcsfs writes a bare LF): an object's own last byte, a 0x0d, stays its own."""
    boundary = content_type.split("boundary=", 1)[1].split(";", 1)[0].strip().strip('"').encode()
    dash = b"--" + boundary
    first = body.index(dash) + len(dash)
    nl = b"\r\n" if body[first:first + 2] == b"\r\n" else b"\n"
    second = body.index(nl + dash, first)  # the metadata is JSON: it holds no boundary line
    close = body.rindex(nl + dash + b"--")  # the content may: the last boundary line ends it
    meta = body[first + len(nl):second].split(nl + nl, 1)[1]
    head, content = body[second + len(nl + dash + nl):close].split(nl + nl, 1)
    kind = "application/octet-stream"
    for line in head.decode("latin-1").split(nl.decode()):
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-type":
            kind = value.strip()
    return meta, content, kind


def keep_trailing_cr(server_module: Any) -> None:
    """Make the emulator read one-request uploads with :func:`split_related`. Why: it parses them with the email
    package, which takes an object's last byte 0x0d and gcsfs's bare-LF boundary line for one CRLF and drops the
    byte (one random binary object in 256): a publish test then failed its commit check ("has 3844 bytes, the
    marker says 3845") for the test server's fault. Batch requests (``multipart/mixed``) are read as before."""
    if getattr(server_module, "_hotload_keeps_trailing_cr", False):
        return
    read_data = server_module._read_data

    def read_related(handler: Any, query: Any) -> Any:
        content_type = handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return read_data(handler, query)
        raw = server_module._decode_raw_data(server_module._read_raw_data(handler), handler)
        if not raw:
            return None
        meta, content, kind = split_related(raw, content_type)
        return {"meta": json.loads(meta), "content": content, "content-type": kind}

    server_module._read_data = read_related
    server_module._hotload_keeps_trailing_cr = True


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsServer]:
    """Start gcp-storage-emulator (in memory) on a free loopback port with one bucket for the session; stop it
    afterwards. ``STORAGE_EMULATOR_HOST`` is removed while it runs, so only the options given reach a server."""
    pytest.importorskip("gcsfs")
    emulator = pytest.importorskip("gcp_storage_emulator.server")
    keep_trailing_cr(emulator)
    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
    bucket = f"hotload-test-{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("STORAGE_EMULATOR_HOST", raising=False)
        server = emulator.create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
        server.start()  # returns once the server's socket is bound
        try:
            # Port 0 lets the OS pick; the emulator does not say which it got but through its HTTP server.
            port = server._api._httpd.server_address[1]
            yield GcsServer(endpoint_url=f"http://127.0.0.1:{port}", bucket=bucket)
        finally:
            server.stop()


def forward(handler: BaseHTTPRequestHandler, upstream: tuple[str, int], body: bytes,
            ) -> tuple[http.client.HTTPResponse, bytes]:
    """Send the request ``handler`` holds (its method, path, headers and ``body``) to ``upstream``; its answer and
    that answer's body (the test proxies in front of the emulator pass it on, or change it)."""
    conn = http.client.HTTPConnection(*upstream, timeout=60)
    try:
        headers = {k: v for k, v in handler.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding", "connection")}
        conn.request(handler.command, handler.path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp, resp.read()
    finally:
        conn.close()


class StallingGcsProxy:
    """An HTTP proxy in front of a real GCS endpoint. A request for which ``stall(method, path)`` is true is read
    whole and never answered (until the proxy closes); every other one is forwarded, and the ``Location`` of a
    resumable upload is rewritten to point back through the proxy. ``stalled`` counts the stalled requests and
    ``requests`` lists every ``(method, path)`` seen."""

    def __init__(self, upstream_url: str, stall: Callable[[str, str], bool]) -> None:
        target = urlsplit(upstream_url)
        upstream = (target.hostname or "127.0.0.1", target.port or 80)
        proxy = self
        self.stalled = 0
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    proxy.requests.append((self.command, self.path))
                if stall(self.command, self.path):
                    with proxy._lock:
                        proxy.stalled += 1
                    proxy._closed.wait()
                    self.close_connection = True
                    return
                resp, data = forward(self, upstream, body)
                self.send_response(resp.status)
                for key, value in resp.getheaders():
                    if key.lower() in ("content-length", "transfer-encoding", "connection"):
                        continue
                    if key.lower() == "location":
                        value = value.replace(f"{upstream[0]}:{upstream[1]}", f"127.0.0.1:{proxy.port}")
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _any

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def count(self, match: Callable[[str, str], bool]) -> int:
        """How many requests seen so far ``match(method, path)`` picks."""
        with self._lock:
            return sum(1 for method, path in self.requests if match(method, path))

    def __enter__(self) -> "StallingGcsProxy":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._closed.set()  # the stalled handlers return and drop their connections
        self._httpd.shutdown()
        with contextlib.suppress(OSError):
            self._httpd.server_close()
