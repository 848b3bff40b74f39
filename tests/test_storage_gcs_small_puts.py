"""Files below the multipart threshold go to GCS (gs://) in one request whose body is read from the caller's buffer
(a real GCS JSON API server on loopback, gcp-storage-emulator, behind a real proxy that refuses, stalls or alters
chosen answers): no copy of the buffer is held while it is sent, the object is the buffer's bytes, a refused or
stalled request is sent again whole, and the filesystem's consistency check still compares what the store kept."""
from __future__ import annotations

import email.parser
import json
import logging
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import fsspec.asyn
import numpy as np
import pytest

from fsdp_hotload.storage import Storage, StorageError
from fsdp_hotload.storage_gcs import RelatedBody
from tests.gcs_fixture import GcsServer, StallingGcsProxy, forward
from tests.put_memory_check import view_puts_peak_mib

MiB = 2**20
REPO = Path(__file__).resolve().parents[1]


def _buffer(nbytes: int, seed: int, last: int | None = None) -> memoryview:
    """A publisher's file as it hands it over: a view of a numpy buffer. Its last byte is not 0x0d unless ``last``
    says so: the emulator drops a final carriage return from a body framed with bare line feeds (gcsfs's own)."""
    a = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    a[-1] = (a[-1] if a[-1] != 0x0D else 0) if last is None else last
    return memoryview(a)


class FaultGcsProxy:
    """An HTTP proxy in front of the emulator. The first ``refuse`` one-request uploads (``uploadType=multipart``)
    are read whole and answered 503; with ``md5`` set, an upload's answer reports that MD5 instead of the stored
    one. ``bodies`` holds the length of every one-request upload body it read and whether it ended with its
    closing boundary."""

    def __init__(self, upstream_url: str, refuse: int = 0, md5: str | None = None) -> None:
        target = urlsplit(upstream_url)
        upstream = (target.hostname or "127.0.0.1", target.port or 80)
        proxy = self
        self.bodies: list[tuple[int, bool]] = []
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                upload = self.command == "POST" and "uploadType=multipart" in self.path
                if upload:
                    boundary = (self.headers.get("Content-Type") or "").split('boundary="', 1)[-1].rstrip('"')
                    with proxy._lock:
                        proxy.bodies.append((len(body), body.endswith(f"--{boundary}--".encode())))
                        refused = len(proxy.bodies) <= refuse
                    if refused:
                        self._answer(503, [("Content-Type", "application/json")],
                                     b'{"error": {"code": 503, "message": "Service Unavailable"}}')
                        return
                resp, data = forward(self, upstream, body)
                if upload and md5 is not None and resp.status == 200:
                    data = json.dumps({**json.loads(data), "md5Hash": md5}).encode()
                self._answer(resp.status, resp.getheaders(), data)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _any

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def __enter__(self) -> FaultGcsProxy:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _storage(server: GcsServer, label: str, endpoint: str | None = None, options: dict[str, Any] | None = None,
             **kwargs: Any) -> Storage:
    """A Storage with a filesystem of its own (gcsfs caches one per set of options) and no backoff waits."""
    return Storage(server.unique_uri(label), {**server.storage_options, "endpoint_url": endpoint or server.endpoint_url,
                                               "skip_instance_cache": True, **(options or {})},
                   base_backoff_s=0.0, sleep=lambda s: None, **kwargs)


def test_a_view_put_holds_no_copy_of_the_buffer(gcs_server: GcsServer) -> None:
    """Four 16 MiB views put at once (one request each) from a process of their own: its resident memory rises by a
    fraction of the files' 64 MiB while they are sent. Each view used to be copied to bytes, gcsfs joined that copy
    and its framing into another, and the event loop copied the unsent rest again: about three times the files."""
    uri = gcs_server.unique_uri("small-rss")
    peak_mib = view_puts_peak_mib(uri, gcs_server.storage_options, env={"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"},
                                  no_final_cr=True)
    assert peak_mib < 24, f"resident memory rose by {peak_mib:.0f} MiB while 64 MiB of views were put"
    st = Storage(uri, gcs_server.storage_options)
    for i in range(4):
        assert st.get_bytes(f"f{i}.bin") == _buffer(16 * MiB, i).tobytes()


@pytest.mark.parametrize("consistency", [None, "size", "md5", "crc32c"])
def test_views_of_any_shape_and_bytes_round_trip_under_each_consistency_check(gcs_server: GcsServer,
                                                                              consistency: str | None) -> None:
    """From 1 MiB a put is sent from its buffer: a view of any item size or shape, bytes and a bytearray are stored
    as their bytes, and gcsfs's consistency check compares the store's size, MD5 or CRC32C with them. Below 1 MiB
    the body is bytes, sent by gcsfs as before."""
    if consistency == "crc32c":
        pytest.importorskip("crcmod")
    st = _storage(gcs_server, "small-sizes", options={"consistency": consistency})
    floats = np.arange(2**18, dtype=np.float32).reshape(512, 512)  # 1 MiB, 2-D, 4-byte items
    cases: dict[str, Any] = {"tiny.json": b"{}", "below.bin": _buffer(MiB - 1, 5), "floats.bin": memoryview(floats),
                             "odd.bin": _buffer(3 * MiB + 7, 6), "bytes.bin": _buffer(2 * MiB, 7).tobytes(),
                             "ba.bin": bytearray(_buffer(MiB + 3, 8)),
                             "int8.bin": memoryview(np.frombuffer(_buffer(MiB, 9), np.int8)),
                             # strided: its pieces could not be written to a socket (BufferError, retried as a
                             # connection error for ~31 s); such a view is copied, as before
                             "strided.bin": _buffer(4 * MiB, 10)[::2]}
    st.put_many(cases)
    for rel, data in cases.items():
        assert st.get_bytes(rel) == memoryview(data).tobytes(), rel
    assert st.stats.retries == 0 and st.stats.puts == len(cases)


def test_a_buffer_ending_in_a_carriage_return_keeps_it(gcs_server: GcsServer) -> None:
    """The body's parts are separated by CRLF, so a file whose last byte is 0x0d keeps it; a body framed with bare
    line feeds (gcsfs's) lost it in the emulator's parser, which reads the CR as part of the closing line break."""
    st = _storage(gcs_server, "small-cr")
    view = _buffer(2 * MiB, 10, last=0x0D)
    st.put_bytes("snap/cr.bin", view)
    assert st.get_bytes("snap/cr.bin") == view.tobytes()


def test_a_refused_upload_is_sent_again_whole_by_gcsfs(gcs_server: GcsServer) -> None:
    """The first upload request is read whole and answered 503; gcsfs's own retry sends the request again, and the
    body starts again from its first byte: both bodies are whole, and the object is the buffer."""
    view = _buffer(3 * MiB + 5, 11)
    with FaultGcsProxy(gcs_server.endpoint_url, refuse=1) as proxy:
        st = _storage(gcs_server, "small-refused", proxy.url, {"consistency": "md5"})
        st.put_bytes("snap/a.bin", view)
        assert len(proxy.bodies) == 2 and proxy.bodies[0] == proxy.bodies[1]
        assert proxy.bodies[0][1] and proxy.bodies[0][0] > view.nbytes
        assert st.stats.retries == 0  # gcsfs's retry, within one of Storage's attempts
    assert _storage(gcs_server, "x").fs.cat_file(st.uri("snap/a.bin").removeprefix("gs://")) == view.tobytes()


def test_a_stalled_upload_is_cut_off_by_its_deadline_and_sent_again_whole(gcs_server: GcsServer) -> None:
    """An endpoint that read the first upload and never answered: the put's deadline (``call_timeout_s`` plus its
    bytes at ``min_upload_mb_s``) cancels it, Storage's next attempt sends the whole body again, and it lands."""
    seen = {"n": 0}

    def first_upload(method: str, path: str) -> bool:
        if method == "POST" and "uploadType=multipart" in path:
            seen["n"] += 1
            return seen["n"] == 1
        return False

    view = _buffer(2 * MiB, 12)
    with StallingGcsProxy(gcs_server.endpoint_url, first_upload) as proxy:
        st = _storage(gcs_server, "small-stalled", proxy.url, call_timeout_s=1.0, min_upload_mb_s=100.0)
        st.put_bytes("snap/b.bin", view)
        assert proxy.stalled == 1 and seen["n"] == 2 and st.stats.retries == 1
    assert Storage(st.root, gcs_server.storage_options).get_bytes("snap/b.bin") == view.tobytes()


def test_a_silent_endpoint_fails_the_put_in_bounded_time(gcs_server: GcsServer) -> None:
    """Every upload stalled: each attempt is cut off by its deadline, and the put fails with the timeout named."""
    with StallingGcsProxy(gcs_server.endpoint_url, lambda method, path: "uploadType=multipart" in path) as proxy:
        st = _storage(gcs_server, "small-silent", proxy.url, call_timeout_s=1.0, min_upload_mb_s=100.0,
                      max_attempts=2)
        with pytest.raises(StorageError, match="FSTimeoutError") as err:
            st.put_bytes("snap/c.bin", _buffer(MiB, 13))
        assert err.value.attempts == 2 and proxy.stalled == 2


def test_a_checksum_the_store_reports_wrong_fails_the_put(gcs_server: GcsServer) -> None:
    """With ``consistency="md5"`` an answer whose MD5 is not the buffer's fails the put (gcsfs's ChecksumError), as
    gcsfs's own upload does; the check is made, not skipped."""
    with FaultGcsProxy(gcs_server.endpoint_url, md5="AAAAAAAAAAAAAAAAAAAAAA==") as proxy:
        st = _storage(gcs_server, "small-md5", proxy.url, {"consistency": "md5"}, max_attempts=1)
        with pytest.raises(StorageError, match="ChecksumError|MD5 checksum failed"):
            st.put_bytes("snap/d.bin", _buffer(MiB, 14))
        assert len(proxy.bodies) == 1


def test_the_benchmark_reads_back_every_object_of_every_run() -> None:
    """``benchmarks/gcs_small_puts.py`` at a small size: each run's objects read back byte-identical."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the benchmark resets the peak resident memory through /proc/self/clear_refs")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gcs_small_puts.py"), "--files", "2", "--mib",
                           "2", "--threads", "2"], capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for run in ("copied", "views", "bytes"):
        assert re.search(rf"^ *{run} +\d+ +[\d.]+ +[\d.]+  byte-identical$", proc.stdout, re.M), proc.stdout
    assert "copied (baseline): peak" in proc.stdout and "machine:" in proc.stdout, proc.stdout


@pytest.fixture
def loop() -> Iterator[Any]:
    yield fsspec.asyn.get_loop()


def test_a_related_body_parses_as_two_parts_and_restarts_at_each_iteration(loop: Any) -> None:
    """Each iteration yields the whole body (a retry sends it from its first byte); a MIME parser reads the
    metadata part and the file part back, the file's final 0x0d included, and the length is the body's."""
    data = bytes(range(256)) * 4096 + b"\r"
    body = RelatedBody("run/a b.bin", memoryview(np.frombuffer(data, np.uint8)))

    async def collect() -> bytes:
        return b"".join([bytes(piece) async for piece in body])

    first = fsspec.asyn.sync(loop, collect)
    assert fsspec.asyn.sync(loop, collect) == first and len(first) == len(body)
    msg = email.parser.BytesParser().parsebytes(f"Content-Type: {body.content_type}\r\n\r\n".encode() + first)
    meta, content = msg.get_payload()
    assert json.loads(meta.get_payload()) == {"name": "run/a b.bin"}
    assert content.get_content_type() == "application/octet-stream" and content.get_payload(decode=True) == data


def test_a_related_body_s_pieces_do_not_change_with_the_buffer(loop: Any) -> None:
    """A piece the event loop still holds (a socket that did not take it all) must keep the bytes the put read:
    the caller may write its next file into the buffer once the put returned, and a connection cut off by its
    deadline may still be sending. Each piece is a copy of at most one ``PIECE``."""
    from fsdp_hotload.storage_gcs import PIECE

    buf = np.zeros(2 * PIECE + 5, np.uint8)
    body = RelatedBody("run/f.bin", memoryview(buf))

    async def collect() -> list[Any]:
        return [piece async for piece in body]

    pieces = fsspec.asyn.sync(loop, collect)
    buf[:] = 7  # the caller's next file
    data = pieces[1:-1]
    assert [len(p) for p in data] == [PIECE, PIECE, 5]
    assert all(bytes(p) == bytes(len(p)) for p in data), "a piece changed with the caller's buffer"


def test_a_gcsfs_whose_request_call_changed_falls_back_to_its_own_upload(gcs_server: GcsServer,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """The one-request upload leans on gcsfs's private ``_call``: a release that changed it (here a subclass whose
    ``_call`` refuses the streamed body, as a changed signature would) made every put of 1 MiB or more fail for good
    (TypeError, not retried), so every publish. Now said once, and that put and the later ones go by gcsfs."""
    import gcsfs

    class ChangedCall(gcsfs.GCSFileSystem):
        async def _call(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            if isinstance(kwargs.get("data"), RelatedBody):
                raise TypeError("_call() got an unexpected keyword argument 'data'")
            return await super()._call(method, path, *args, **kwargs)

    fs = ChangedCall(**{**gcs_server.storage_options, "endpoint_url": gcs_server.endpoint_url,
                        "skip_instance_cache": True})
    st = Storage(gcs_server.unique_uri("changed"), fs=fs)
    caplog.set_level(logging.WARNING, logger="fsdp_hotload.storage")
    cases = {"a.bin": _buffer(2 * MiB, 11), "b.bin": _buffer(3 * MiB, 12)}
    st.put_many(cases)
    for rel, data in cases.items():
        assert st.get_bytes(rel) == data.tobytes(), rel
    said = [r.getMessage() for r in caplog.records if "did not take the one-request upload" in r.getMessage()]
    assert len(said) == 1 and "TypeError" in said[0], said
