"""Test helpers for storage: a real S3 server on loopback (moto), and a filesystem wrapper that injects faults.

``s3_server`` is a session fixture; import it into a conftest or a test module::

    from tests.s3_fixture import s3_server  # noqa: F401

    def test_upload(s3_server):
        st = Storage(s3_server.unique_uri("upload"), s3_server.storage_options)

``FaultyFileSystem`` wraps any real fsspec filesystem and makes the next N writes fail with a chosen exception,
so retry paths run against real I/O::

    faulty = FaultyFileSystem(fsspec.filesystem("memory"), fail_puts=2, exc_factory=slowdown_error)
    st = Storage("memory://x", fs=faulty, throttle_backoff_s=0.001)
    st.put_bytes("a", b"1")          # succeeds on the third try; st.stats.throttled == 2
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest

_REGION = "us-east-1"
_KEY = "hotload-test-key"
_SECRET = "hotload-test-secret"


@dataclass
class S3Server:
    """A running moto S3 server on 127.0.0.1 with one bucket; the connection details for s3fs and botocore."""

    endpoint_url: str
    bucket: str
    key: str = _KEY
    secret: str = _SECRET
    region: str = _REGION
    _counter: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 30)), repr=False)

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs options (a fresh dict each time, so callers may change theirs). Explicit credentials, endpoint and
        region mean botocore never looks for config files, instance metadata or the region of the bucket."""
        return {"key": self.key, "secret": self.secret, "endpoint_url": self.endpoint_url,
                "client_kwargs": {"region_name": self.region}}

    def uri(self, prefix: str = "") -> str:
        prefix = prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def unique_uri(self, label: str = "t") -> str:
        """A prefix no other test uses (the server and bucket are shared by the whole session)."""
        return self.uri(f"{label}-{next(self._counter)}-{uuid.uuid4().hex[:8]}")

    def client(self) -> Any:
        """A plain botocore S3 client for checks that bypass s3fs (object metadata, raw listings)."""
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region, aws_access_key_id=self.key,
            aws_secret_access_key=self.secret)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """Start moto's S3 server on a free loopback port for the session, create a bucket, stop it afterwards.

    AWS environment variables are set only while the fixture is active (and restored after), so code paths that
    build their own clients from the environment get dummy credentials and never reach AWS.
    """
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    env = {
        "AWS_ACCESS_KEY_ID": _KEY, "AWS_SECRET_ACCESS_KEY": _SECRET, "AWS_DEFAULT_REGION": _REGION,
        "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "NO_PROXY": ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"])),
    }
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            info = S3Server(endpoint_url=f"http://{host}:{port}", bucket=f"hotload-test-{uuid.uuid4().hex[:8]}")
            info.client().create_bucket(Bucket=info.bucket)
            yield info
        finally:
            server.stop()


# ------------------------------------------------------------------------------------------------------------
# Fault injection
# ------------------------------------------------------------------------------------------------------------


def slowdown_error(translated: bool = True) -> Exception:
    """The error S3 gives an over-rate prefix: a botocore ClientError (HTTP 503, code SlowDown), by default as
    s3fs surfaces it (an ``OSError(EBUSY)`` caused by that ClientError)."""
    return _client_error("SlowDown", "Please reduce your request rate.", 503, "PutObject", translated)


def access_denied_error(translated: bool = True) -> Exception:
    """A botocore ClientError AccessDenied (HTTP 403), by default as s3fs surfaces it (a PermissionError)."""
    return _client_error("AccessDenied", "Access Denied", 403, "PutObject", translated)


def no_such_upload_error(translated: bool = True) -> Exception:
    """What S3 answers when a multipart upload's id is gone (HTTP 404, code NoSuchUpload), by default as s3fs
    surfaces it (a FileNotFoundError caused by that ClientError)."""
    return _client_error("NoSuchUpload", "The specified upload does not exist.", 404, "CompleteMultipartUpload",
                         translated)


def _client_error(code: str, message: str, status: int, op: str, translated: bool) -> Exception:
    from botocore.exceptions import ClientError

    err = ClientError({"Error": {"Code": code, "Message": message},
                       "ResponseMetadata": {"HTTPStatusCode": status}}, op)
    if not translated:
        return err
    from s3fs.errors import translate_boto_error

    return translate_boto_error(err)


class FaultyFileSystem:
    """Wrap a real fsspec filesystem; the next ``fail_puts`` write calls raise ``exc_factory()``.

    Write calls are ``pipe_file``, ``pipe``, ``put_file``, ``put`` and ``open`` in a write mode; with ``match``,
    only calls whose path contains that string count. ``fail_gets`` does the same for ``cat_file``/``cat`` and
    ``open`` for reading. ``delay_s`` slows every write (to observe concurrency). With ``fail_after_bytes``, a
    failing ``open`` for writing succeeds and its file raises once that many bytes were written (a connection
    dropped mid-upload, leaving a temp file or an open multipart upload behind). Everything else goes straight
    to the wrapped filesystem. Counters: ``write_calls``, ``failures_raised``, ``failed_paths``,
    ``max_inflight`` (most writes running at once).

    Example::

        faulty = FaultyFileSystem(fsspec.filesystem("file"), fail_puts=1,
                                  exc_factory=lambda: ConnectionResetError("reset"), match="model-00003")
    """

    _WRITES = ("pipe_file", "pipe", "put_file", "put")
    _READS = ("cat_file", "cat")

    def __init__(self, inner: Any, fail_puts: int = 0,
                 exc_factory: Callable[[], BaseException] = lambda: ConnectionError("reset"),
                 match: str | None = None, *, fail_gets: int = 0,
                 get_exc_factory: Callable[[], BaseException] | None = None, delay_s: float = 0.0,
                 fail_after_bytes: int | None = None) -> None:
        self.inner = inner
        self.fail_puts = fail_puts
        self.exc_factory = exc_factory
        self.match = match
        self.fail_gets = fail_gets
        self.get_exc_factory = get_exc_factory or exc_factory
        self.delay_s = delay_s
        self.fail_after_bytes = fail_after_bytes
        self.write_calls = 0
        self.read_calls = 0
        self.failures_raised = 0
        self.failed_paths: list[str] = []
        self.inflight = 0
        self.max_inflight = 0
        self._lock = threading.Lock()

    def arm(self, fail_puts: int, exc_factory: Callable[[], BaseException] | None = None,
            match: str | None = None) -> None:
        """Queue more write failures (for tests with several phases)."""
        with self._lock:
            self.fail_puts = fail_puts
            self.match = match
            if exc_factory is not None:
                self.exc_factory = exc_factory

    def _should_fail(self, path: Any, *, write: bool) -> BaseException | None:
        with self._lock:
            if write:
                self.write_calls += 1
            else:
                self.read_calls += 1
            if self.match is not None and self.match not in str(path):
                return None
            if write and self.fail_puts > 0:
                self.fail_puts -= 1
                factory = self.exc_factory
            elif not write and self.fail_gets > 0:
                self.fail_gets -= 1
                factory = self.get_exc_factory
            else:
                return None
            self.failures_raised += 1
            self.failed_paths.append(str(path))
        return factory()

    def _call(self, name: str, path: Any, write: bool, *args: Any, **kwargs: Any) -> Any:
        exc = self._should_fail(path, write=write)
        if exc is not None and name == "open" and write and self.fail_after_bytes is not None:
            return _FailingWriteFile(self.inner.open(*args, **kwargs), self.fail_after_bytes, exc)
        if exc is not None:
            raise exc
        if not write:
            return getattr(self.inner, name)(*args, **kwargs)
        with self._lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            return getattr(self.inner, name)(*args, **kwargs)
        finally:
            with self._lock:
                self.inflight -= 1

    def pipe_file(self, path: str, value: Any, **kwargs: Any) -> Any:
        return self._call("pipe_file", path, True, path, value, **kwargs)

    def pipe(self, path: Any, value: Any = None, **kwargs: Any) -> Any:
        return self._call("pipe", path, True, path, value, **kwargs)

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> Any:
        return self._call("put_file", rpath, True, lpath, rpath, **kwargs)

    def put(self, lpath: Any, rpath: Any, **kwargs: Any) -> Any:
        return self._call("put", rpath, True, lpath, rpath, **kwargs)

    def cat_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._call("cat_file", path, False, path, *args, **kwargs)

    def cat(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call("cat", path, False, path, *args, **kwargs)

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        write = any(c in mode for c in "wax+")
        return self._call("open", path, write, path, mode, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _FailingWriteFile:
    """A file open for writing whose ``write`` raises after ``after`` bytes; everything else (``discard``,
    ``close``, setting ``closed``) reaches the real file underneath."""

    def __init__(self, inner: Any, after: int, exc: BaseException) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_left", after)
        object.__setattr__(self, "_exc", exc)

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self._left:
            raise self._exc
        object.__setattr__(self, "_left", self._left - n)
        return self._inner.write(data)

    def __enter__(self) -> _FailingWriteFile:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)


class StallingProxy:
    """A TCP proxy in front of a real server that stops forwarding a connection once a request on it contains
    ``stall_on`` (e.g. ``b"partNumber="``: S3 part uploads), so that request never gets an answer: a link that
    dies in the middle of a multipart upload, after the upload was created.

    Example::

        with StallingProxy(s3_server.endpoint_url, b"partNumber=") as proxy:
            options = {**s3_server.storage_options, "endpoint_url": proxy.url}
    """

    def __init__(self, upstream_url: str, stall_on: bytes) -> None:
        import socket
        from urllib.parse import urlsplit

        target = urlsplit(upstream_url)
        self._upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self._stall_on = stall_on
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.stalled = 0
        self._sockets: list[Any] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._upstream)
            self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: Any, dst: Any, check: bool) -> None:
        tail = b""
        try:
            while data := src.recv(65536):
                if check and self._stall_on in tail + data:
                    self.stalled += 1
                    while src.recv(65536):  # swallow the rest; never answer
                        pass
                    return
                tail = data[-len(self._stall_on):]
                dst.sendall(data)
        except OSError:
            pass

    def __enter__(self) -> "StallingProxy":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


class DeleteErrorsProxy:
    """An HTTP proxy in front of a real S3 server that answers some DeleteObjects requests itself, the way S3
    reports keys it could not delete: HTTP 200 with an ``<Error>`` (``code``) per key, and nothing deleted.
    Every other request is forwarded unchanged.

    ``fail`` decides per DeleteObjects request body (the XML naming the keys) whether to answer with errors;
    ``answered`` counts those answers. With ``deny_uploads``, listing multipart uploads is refused (HTTP 403
    AccessDenied), as under a policy without ``s3:ListBucketMultipartUploads``; with ``deny_lists``, listing
    objects is refused so (no ``s3:ListBucket``).

    Example::

        with DeleteErrorsProxy(s3_server.endpoint_url, "InternalError", lambda body: True) as proxy:
            options = {**s3_server.storage_options, "endpoint_url": proxy.url}
    """

    def __init__(self, upstream_url: str, code: str, fail: Callable[[bytes], bool], *,
                 deny_uploads: bool = False, deny_lists: bool = False) -> None:
        import http.client
        import re
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        from tests.s3_fault_proxy import send_reply

        target = urlsplit(upstream_url)
        proxy = self
        self.answered = 0

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                query = urlsplit(self.path).query.split("&")
                if self.command == "POST" and "delete" in query and fail(body):
                    proxy.answered += 1
                    keys = re.findall(rb"<Key>(.*?)</Key>", body)
                    errors = b"".join(b"<Error><Key>%s</Key><Code>%s</Code><Message>refused</Message></Error>"
                                      % (k, code.encode()) for k in keys)
                    self._reply(200, {"Content-Type": "application/xml"},
                                b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult>%s</DeleteResult>' % errors)
                    return
                if self.command == "GET" and ((deny_uploads and "uploads" in query)
                                              or (deny_lists and "list-type=2" in query)):
                    self._reply(403, {"Content-Type": "application/xml"},
                                b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>")
                    return
                conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port or 80, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body,
                                 headers={k: v for k, v in self.headers.items() if k.lower() != "connection"})
                    resp = conn.getresponse()
                    data = resp.read()
                    headers = {k: v for k, v in resp.getheaders()
                               if k.lower() not in ("transfer-encoding", "connection", "content-length")}
                    self._reply(resp.status, headers, data, length=resp.getheader("Content-Length"))
                finally:
                    conn.close()

            def _reply(self, status: int, headers: dict[str, str], data: bytes, length: str | None = None) -> None:
                send_reply(self, status, headers, data, length)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def __enter__(self) -> "DeleteErrorsProxy":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
