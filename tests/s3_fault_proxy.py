"""An HTTP proxy in front of a real S3 server (the moto fixture) that refuses or loses chosen requests, by S3
operation: the faults a throttled or flaky store gives a multipart upload, with everything else real.

Example::

    with S3FaultProxy(s3_server.endpoint_url) as proxy:
        proxy.rule = lambda req: "slowdown" if req.op == "UploadPart" and req.part == 3 else None
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True})

A rule returns None (forward the request), ``"slowdown"`` (answer 503 SlowDown itself; the store never sees
it), ``"internal"`` (answer 500 InternalError so), ``"nosuchupload"`` (answer 404 NoSuchUpload so: an upload
aborted under the writer), ``"lost"`` (forward it, so the store applies it, then close
the connection without an answer: a reply lost on its way back) or ``"silent"`` (read it and never answer, until
the proxy closes: a store that accepts requests and goes quiet). :class:`TlsFront` puts HTTPS in front of it.
"""
from __future__ import annotations

import contextlib
import http.client
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

_ANSWERS = {"slowdown": (503, "SlowDown", "Please reduce your request rate."),
            "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
            "nosuchupload": (404, "NoSuchUpload", "The specified upload does not exist.")}
_HOP_BY_HOP = ("connection", "expect", "transfer-encoding", "keep-alive")


@dataclass(frozen=True)
class S3Request:
    """One request as the rule sees it: its S3 operation, how many of that operation came so far (this one
    included, from 1), the part number of an UploadPart, and how many requests that part number had so far."""

    op: str
    n: int
    part: int | None
    part_n: int


def operation(method: str, query: dict[str, list[str]]) -> str:
    """The S3 operation a request is, from its method and query (path-style requests, as botocore sends them to a
    custom endpoint)."""
    if "uploadId" in query:
        return {"PUT": "UploadPart", "POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload"}.get(
            method, "ListParts")
    if "uploads" in query:
        return "CreateMultipartUpload" if method == "POST" else "ListMultipartUploads"
    if method == "POST" and "delete" in query:
        return "DeleteObjects"
    if method == "GET" and {"list-type", "prefix", "delimiter"} & set(query):
        return "ListObjects"
    return {"GET": "GetObject", "HEAD": "HeadObject", "PUT": "PutObject", "DELETE": "DeleteObject"}.get(method, method)


def send_reply(handler: BaseHTTPRequestHandler, status: int, headers: dict[str, str], data: bytes,
               length: str | None = None) -> None:
    """Answer ``handler``'s request: ``data`` with ``headers``; a HEAD gets the headers only, with the
    Content-Length ``length`` the store gave (the body it describes is not sent)."""
    handler.send_response(status)
    for k, v in headers.items():
        handler.send_header(k, v)
    head = handler.command == "HEAD"
    handler.send_header("Content-Length", length if head and length is not None else str(len(data)))
    handler.end_headers()
    if not head:
        handler.wfile.write(data)


class S3FaultProxy:
    """Forwards every request to ``upstream`` unless ``rule`` says otherwise. ``log`` holds (op, part, action) for
    each request, in order; ``count(op, action)`` counts them."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self.rule: Callable[[S3Request], str | None] = lambda req: None
        self.log: list[tuple[str, int | None, str]] = []
        self._seen: Counter[Any] = Counter()
        self._lock = threading.Lock()
        self._closed = threading.Event()  # releases the requests held by "silent"
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                body = self._body()
                url = urlsplit(self.path)
                query = parse_qs(url.query, keep_blank_values=True)
                op = operation(self.command, query)
                part = int(query["partNumber"][0]) if "partNumber" in query else None
                with proxy._lock:
                    proxy._seen[op] += 1
                    proxy._seen[(op, part)] += 1
                    request = S3Request(op, proxy._seen[op], part, proxy._seen[(op, part)])
                action = proxy.rule(request)
                with proxy._lock:
                    proxy.log.append((op, part, action or "forward"))
                if action == "silent":
                    proxy._closed.wait()
                    self._hang_up()
                    return
                if action in _ANSWERS:
                    status, code, message = _ANSWERS[action]
                    self._reply(status, {"Content-Type": "application/xml"},
                                f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
                                f"<Message>{message}</Message></Error>".encode())
                    return
                conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port or 80, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body,
                                 headers={k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP})
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if action == "lost":
                    self._hang_up()
                    return
                headers = {k: v for k, v in resp.getheaders()
                           if k.lower() not in _HOP_BY_HOP + ("content-length",)}
                self._reply(resp.status, headers, data, length=resp.getheader("Content-Length"))

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                out = b""
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    out += self.rfile.read(size)
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return out

            def _hang_up(self) -> None:
                """Close at once, with a reset: the client sees its connection dropped, no answer."""
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

            def _reply(self, status: int, headers: dict[str, str], data: bytes, length: str | None = None) -> None:
                send_reply(self, status, headers, data, length)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def count(self, op: str, action: str | None = None) -> int:
        """Requests of ``op`` so far (only those the rule answered with ``action``, when given; "forward" for the
        ones passed on)."""
        with self._lock:
            return sum(1 for o, _, a in self.log if o == op and (action is None or a == action))

    def reset(self) -> None:
        """Forget the requests seen (the counts a rule gets start again from 1) and forward everything."""
        with self._lock:
            self.rule = lambda req: None
            self.log.clear()
            self._seen.clear()

    def __enter__(self) -> S3FaultProxy:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._closed.set()
        self._httpd.shutdown()
        self._httpd.server_close()


class TlsFront:
    """HTTPS in front of a plain HTTP server on loopback (a self-signed certificate for 127.0.0.1, in ``cafile``),
    so botocore takes its HTTPS path: a streamed body sent ``aws-chunked``, its checksum in a trailer.

    Example::

        with S3FaultProxy(s3_server.endpoint_url) as proxy, TlsFront(proxy.url, tmp_path) as tls:
            options = {**s3_server.storage_options, "endpoint_url": tls.url,
                       "client_kwargs": {"region_name": "us-east-1", "verify": tls.cafile}}
    """

    def __init__(self, upstream: str, workdir: Any) -> None:
        import datetime
        import ipaddress
        import ssl
        from pathlib import Path

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(hours=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        self.cafile = str(Path(workdir) / "tls-front-cert.pem")
        keyfile = Path(workdir) / "tls-front-key.pem"
        Path(self.cafile).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(self.cafile, str(keyfile))
        target = urlsplit(upstream)
        self._upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            secure = self._context.wrap_socket(client, server_side=True)
            upstream = socket.create_connection(self._upstream)
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pump, args=(upstream, secure), daemon=True).start()
        self._pump(secure, upstream)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> TlsFront:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._listener.close()
