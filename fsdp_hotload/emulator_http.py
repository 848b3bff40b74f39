"""The hot-load emulator's HTTP front door: the threaded server and the handler that reads each request.

Kept apart from :mod:`fsdp_hotload.emulator` (routing and the protocol rules) because this part is about
hostile or broken clients, not about Fireworks: one request per connection, a body that must carry a
Content-Length and arrive in full by a deadline, JSON errors for whatever http.server itself refuses, and no
tracebacks for clients that hang up.

Example::

    server = Server(("127.0.0.1", 0), Handler)
    server.emulator = emu            # a HotLoadEmulator: its request_timeout_s and handle() are used
    server.serve_forever()
"""
from __future__ import annotations

import io
import json
import logging
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .emulator import HotLoadEmulator

log = logging.getLogger("fsdp_hotload.emulator")

__all__ = ["MAX_BODY", "Handler", "Server", "Server6"]

MAX_BODY = 1 << 20
_READ_CHUNK = 64 * 1024
#: How much of an oversized body is read and dropped before the 413, so the client sees the answer; past it the
#: connection closes with the rest unread (a reset).
_DRAIN_MAX = 64 * MAX_BODY


class _DeadlineReader(io.RawIOBase):
    """The request's socket, read under one deadline for the whole request rather than a timeout per read."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received by its deadline")
        self.sock.settimeout(left)
        return self.sock.recv_into(buf)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default listen backlog is 5: a burst of connections (many clients polling, per-file hints)
    # overflows it and the kernel drops SYNs, which clients retry only after 1 s.
    request_queue_size = 128
    emulator: HotLoadEmulator

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or stalls is its own problem: log it, never print a traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("emulator: connection from %s ended early: %r", client_address, exc)
            return
        super().handle_error(request, client_address)


class Server6(Server):
    address_family = socket.AF_INET6


class Handler(BaseHTTPRequestHandler):
    server_version = "hotload-emulator/1"
    protocol_version = "HTTP/1.0"
    server: Server

    def setup(self) -> None:
        self.timeout = self.server.emulator.request_timeout_s  # applied to the socket by StreamRequestHandler
        # One request per connection (HTTP/1.0): the request line, headers and body must be in by this time. The
        # socket timeout alone bounds each read, so a client sending a byte at a time could hold the thread as
        # long as it liked.
        self.deadline = time.monotonic() + self.timeout
        self.answered = False
        # What send_error needs when the deadline passes before the request line was read.
        self.request_version, self.command, self.requestline = self.protocol_version, None, ""
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self.deadline))

    def handle_one_request(self) -> None:
        super().handle_one_request()  # http.server closes, unanswered, on a timeout in the request line or headers
        if not self.answered and time.monotonic() >= self.deadline:
            self.send_error(408, f"request headers not received within {self.timeout:g}s")

    def _read_body(self, method: str) -> bytes | None:
        """Exactly Content-Length bytes of body, or None after answering the error (a truncated body must not be
        taken for a whole one). A POST or PUT without one is refused (411) rather than read as an empty body."""
        if self.headers.get("Transfer-Encoding"):
            self.send_error(411, "Transfer-Encoding is not supported: send the body with a Content-Length")
            return None
        values = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if not values:
            if method in ("POST", "PUT", "PATCH"):
                self.send_error(411, f"a {method} needs a Content-Length")
                return None
            values = {"0"}
        # Digits only, and one value (RFC 9110 8.6): int() also takes "1_8" and " +18", and with two different
        # values a proxy and this server could split the stream in different places.
        length = int(values.pop()) if len(values) == 1 and all(v.isascii() and v.isdigit() for v in values) else -1
        if length < 0:
            self.send_error(400, "bad Content-Length: one value, decimal digits only")
            return None
        if length > MAX_BODY:
            # Read (and drop) what the client is sending before answering: closing with its bytes unread resets
            # the connection, and a client still sending saw a broken pipe instead of this answer.
            try:
                self._receive(min(length, _DRAIN_MAX), keep=False)
            except TimeoutError:
                pass
            self.send_error(413, f"a request body of {length} bytes is over the emulator's {MAX_BODY}-byte limit")
            return None
        try:
            body = self._receive(length)
        except TimeoutError:
            self.send_error(408, f"request body not received within {self.timeout:g}s")
            return None
        if len(body) != length:
            self.send_error(400, f"request body ended after {len(body)} of the {length} bytes its Content-Length "
                                 "announced")
            return None
        return body

    def _receive(self, length: int, *, keep: bool = True) -> bytes:
        """Up to ``length`` bytes of body (fewer where the client closed first), read by the request's deadline
        (TimeoutError past it); with ``keep`` false they are dropped as they come."""
        chunks: list[bytes] = []
        got = 0
        while got < length:
            chunk = self.rfile.read1(min(_READ_CHUNK, length - got))  # TimeoutError past the deadline
            if not chunk:
                break
            if keep:
                chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _dispatch(self, method: str) -> None:
        emu = self.server.emulator
        body = self._read_body(method)
        if body is None:
            return
        try:
            status, payload = emu.handle(method, self.path, self.headers, body)
        except Exception as exc:  # a bug in the emulator: answer 500 and keep it for stop()/check()
            emu._record_error(exc)
            status, payload = 500, {"error": {"message": f"internal emulator error: {exc!r}"}}
        self._send(status, payload)

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.answered = True
        try:
            self.connection.settimeout(self.timeout)  # the answer's own time, not what the request left over
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (ConnectionError, TimeoutError) as exc:  # the client left; nobody is there to answer
            log.debug("emulator: %s left before the response was sent: %r", self.address_string(), exc)
        self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (malformed request, unsupported method) in the JSON shape of every answer."""
        text = message or self.responses.get(code, ("error",))[0]
        self._send(code, {"error": {"message": text, "code": code}})

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch("HEAD")

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._dispatch("OPTIONS")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("emulator %s - %s", self.address_string(), format % args)
