"""Storage on gs:// roots (gcsfs) against a real GCS JSON API server on loopback (gcp-storage-emulator): the plain
operations, and what a silent endpoint or a live upload does to writes, reads and retention."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from fsdp_hotload.storage import Storage, StorageError
from tests.gcs_fixture import GcsServer, StallingGcsProxy

MiB = 2**20


def _storage(server: GcsServer, label: str, endpoint: str | None = None, **kwargs: Any) -> Storage:
    options = server.storage_options
    if endpoint is not None:  # a filesystem of its own: gcsfs caches one per set of options
        options = {**options, "endpoint_url": endpoint, "skip_instance_cache": True}
    return Storage(server.unique_uri(label), options, **kwargs)


def _outcome(fn: Callable[[], Any], limit_s: float = 90.0) -> tuple[BaseException | None, float]:
    """Run ``fn`` on a daemon thread; its error (None on success) and how long it took. A call still held after
    ``limit_s`` fails the test rather than hanging the suite."""
    box: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        pytest.fail(f"still held after {limit_s:.0f} s: a request that is never answered has no deadline")
    return box.get("error"), box["seconds"]


def test_round_trip(gcs_server: GcsServer, tmp_path: Path) -> None:
    """Small objects go in one request, a file above ``multipart_threshold`` as a resumable upload in chunks; both
    read back whole, list under their folder, and go with the folder."""
    st = _storage(gcs_server, "roundtrip", multipart_threshold=6 * MiB)
    big = os.urandom(13 * MiB)
    src = tmp_path / "shard.bin"
    src.write_bytes(big)
    st.put_bytes("snap/config.json", b'{"a": 1}')
    st.put_file("snap/model-00001-of-00001.safetensors", str(src))
    st.put_bytes("other/config.json", b"{}")
    assert st.get_bytes("snap/config.json") == b'{"a": 1}'
    assert st.get_bytes("snap/model-00001-of-00001.safetensors") == big
    assert st.list("snap") == ["snap/config.json", "snap/model-00001-of-00001.safetensors"]
    assert st.list_dirs() == ["other", "snap"]
    assert st.size("snap/model-00001-of-00001.safetensors") == len(big)
    assert st.stats.puts == 3 and st.stats.bytes_put == len(big) + 10
    st.delete_prefix("snap")
    assert st.list() == ["other/config.json"]
    assert not st.exists("snap/config.json")
    with pytest.raises(FileNotFoundError):
        st.get_bytes("snap/config.json")


@pytest.mark.parametrize("tail", [b"\r", b"\r\n", b"\n--==0==--\r"])
def test_an_object_ending_in_a_carriage_return_is_read_back_whole(gcs_server: GcsServer, tail: bytes) -> None:
    """gcsfs sends a small object in one multipart request whose boundary lines end in a bare LF; the test server
    read a last byte 0x0d and that LF as one CRLF and dropped the byte (one random binary file in 256), so a
    publish test failed its commit check now and then. Content that holds gcsfs's boundary text is kept too."""
    st = _storage(gcs_server, "cr")
    data = bytes(range(256)) * 4 + tail
    st.put_bytes("snap/model.bin", data)
    assert st.size("snap/model.bin") == len(data)
    assert st.get_bytes("snap/model.bin") == data


def _starts_upload(method: str, path: str) -> bool:
    return method == "POST" and "uploadType=resumable" in path


def _sends_chunk(method: str, path: str) -> bool:
    return method in ("POST", "PUT") and "upload_id=" in path


@pytest.mark.parametrize("stalled", [_starts_upload, _sends_chunk], ids=["start", "chunk"])
def test_a_large_write_to_a_silent_endpoint_fails_in_bounded_time(gcs_server: GcsServer,
                                                                   stalled: Callable[[str, str], bool]) -> None:
    """A write above ``multipart_threshold`` is a resumable upload: a request that starts it, then its chunks. An
    endpoint that took a chunk and never answered held the write for good (no timeout covered the chunks); now
    each request has ``call_timeout_s`` plus its bytes at ``min_upload_mb_s``, and a write cut off by it is
    cancelled and tried again, then fails."""
    with StallingGcsProxy(gcs_server.endpoint_url, stalled) as proxy:
        st = _storage(gcs_server, "stall-write", proxy.url, multipart_threshold=6 * MiB, call_timeout_s=1.0,
                      min_upload_mb_s=100.0, max_attempts=2, base_backoff_s=0.0)
        error, seconds = _outcome(lambda: st.put_bytes("snap/model-00001-of-00001.safetensors",
                                                       b"\x01" * (12 * MiB)))
        assert isinstance(error, StorageError), error
        assert error.attempts == 2 and "FSTimeoutError" in str(error)
        assert proxy.stalled == 2  # one stalled request per attempt
        assert seconds < 60
        if stalled is _sends_chunk:  # each attempt's upload was cancelled
            assert proxy.count(lambda method, path: method == "DELETE" and "upload_id=" in path) == 2
    assert not Storage(st.root, gcs_server.storage_options).exists("snap/model-00001-of-00001.safetensors")


def _reads_media(method: str, path: str) -> bool:
    return method == "GET" and "alt=media" in path


def _reads_metadata(method: str, path: str) -> bool:
    return method == "GET" and "/o/" in path and "alt=media" not in path


@pytest.mark.parametrize("stalled", [_reads_media, _reads_metadata], ids=["media", "metadata"])
def test_a_read_from_a_silent_endpoint_fails_in_bounded_time(gcs_server: GcsServer,
                                                             stalled: Callable[[str, str], bool]) -> None:
    """gcsfs sets no HTTP timeout, and a whole-object read had no deadline: one GET an endpoint never answered held
    it for good. Now the read asks the object's size first (under ``call_timeout_s``) and reads it under
    ``call_timeout_s`` plus that size at ``min_upload_mb_s``; a read cut off is tried again, then fails."""
    writer = _storage(gcs_server, "stall-read")
    writer.put_bytes("snap/hotload.commit.json", b"{}")
    with StallingGcsProxy(gcs_server.endpoint_url, stalled) as proxy:
        st = Storage(writer.root, {**gcs_server.storage_options, "endpoint_url": proxy.url,
                                   "skip_instance_cache": True}, call_timeout_s=1.0, max_attempts=2,
                     base_backoff_s=0.0)
        error, seconds = _outcome(lambda: st.get_bytes("snap/hotload.commit.json"))
        assert isinstance(error, StorageError), error
        assert error.attempts == 2 and "FSTimeoutError" in str(error)
        assert proxy.stalled >= 2 and seconds < 60  # gcsfs may ask the object and its folder at once
        if stalled is _reads_metadata:  # a caller that knows the size asks no metadata
            assert st.get_bytes("snap/hotload.commit.json", size_hint=2) == b"{}"
    assert writer.get_bytes("snap/hotload.commit.json") == b"{}"


def test_a_retention_pass_is_not_held_by_a_marker_read_never_answered(gcs_server: GcsServer) -> None:
    """Retention reads every commit marker it has not read before; one GET the endpoint never answered held the
    pass, and ``close()`` waiting for it, for good. Now the pass ends in bounded time, deleting nothing."""
    from fsdp_hotload.markers import commit_snapshot
    from fsdp_hotload.retention import apply_retention

    writer = _storage(gcs_server, "stall-retention")
    ident = "step-000001-aaaaaaaa"
    writer.put_bytes(f"{ident}/model-00001-of-00001.safetensors", b"\x00" * 1024)
    commit_snapshot(writer, ident, "full", None, {"model-00001-of-00001.safetensors": 1024}, {"config.json": b"{}"})
    with StallingGcsProxy(gcs_server.endpoint_url, _reads_media) as proxy:
        st = Storage(writer.root, {**gcs_server.storage_options, "endpoint_url": proxy.url,
                                   "skip_instance_cache": True}, call_timeout_s=1.0, max_attempts=2,
                     base_backoff_s=0.0, min_upload_mb_s=100.0)  # a marker read's deadline: ~1.2 s, not 9.4
        result: dict[str, Any] = {}
        error, seconds = _outcome(lambda: result.setdefault(
            "deleted", apply_retention(st, 1, {ident}, session="aaaaaaaa", since=time.time())))
        assert proxy.stalled >= 1 and seconds < 60
        assert isinstance(error, StorageError) and "hotload.commit.json" in str(error), error
        assert result.get("deleted", []) == []
    assert writer.list(ident) == [f"{ident}/config.json", f"{ident}/hotload.commit.json",
                                  f"{ident}/model-00001-of-00001.safetensors"]


def test_an_unmarked_folder_with_an_upload_in_flight_is_kept(gcs_server: GcsServer) -> None:
    """Another run is sending a shard to its folder: a GCS resumable upload, which shows in no listing until it
    completes and cannot be listed (as S3's open uploads can). Its finished shard alone said the folder was
    abandoned once 10 minutes old, and retention deleted it under the live upload; the run's commit then failed.
    Now such a folder goes only once all its files are ``ABANDONED_UPLOAD_AGE_S`` old. Time is moved ahead by
    passing ``since``/``now``: this run started 20 minutes after the other run's first shard landed."""
    from fsdp_hotload.markers import commit_snapshot
    from fsdp_hotload.retention import apply_retention

    other = _storage(gcs_server, "live-upload")
    mine = Storage(other.root, {**gcs_server.storage_options, "skip_instance_cache": True})
    assert mine.hidden_uploads
    ident = "step-000004-bbbbbbbb"
    shard2 = f"{ident}/model-00002-of-00002.safetensors"
    other.put_bytes(f"{ident}/model-00001-of-00002.safetensors", b"\x01" * 4096)
    f = other.fs.open(other.root.removeprefix("gs://") + "/" + shard2, "wb", block_size=2**18)
    f.write(b"\x02" * MiB)
    f.flush()  # the first chunks are sent; the upload stays open
    later = time.time() + 1200
    assert apply_retention(mine, keep_last=1, session="aaaaaaaa", since=later, now=later) == []
    f.write(b"\x02" * MiB)
    f.close()
    commit_snapshot(other, ident, "full", None, {"model-00001-of-00002.safetensors": 4096,
                                                 "model-00002-of-00002.safetensors": 2 * MiB}, {"config.json": b"{}"})
    assert mine.list(ident)[-1] == shard2


def test_an_unmarked_folder_goes_once_every_file_is_older_than_an_abandoned_upload(gcs_server: GcsServer) -> None:
    """The longer wait still clears what a crashed run left: past ``ABANDONED_UPLOAD_AGE_S`` the folder goes."""
    from fsdp_hotload.retention import ABANDONED_UPLOAD_AGE_S, apply_retention

    st = _storage(gcs_server, "abandoned")
    ident = "step-000004-bbbbbbbb"
    st.put_bytes(f"{ident}/model-00001-of-00002.safetensors", b"\x01" * 4096)
    almost = time.time() + ABANDONED_UPLOAD_AGE_S - 600
    assert apply_retention(st, keep_last=1, session="aaaaaaaa", since=almost, now=almost) == []
    later = time.time() + ABANDONED_UPLOAD_AGE_S + 60
    assert apply_retention(st, keep_last=1, session="aaaaaaaa", since=later, now=later) == [ident]
    assert st.list() == []


def test_which_roots_hide_uploads_in_flight(gcs_server: GcsServer, s3_server: Any, tmp_path: Path) -> None:
    """S3 lists its open uploads, a local folder shows a write in flight as a hidden temp file, and ``memory://`` is
    this process's own; GCS shows neither."""
    assert _storage(gcs_server, "hidden").hidden_uploads
    assert not Storage(s3_server.unique_uri("hidden"), s3_server.storage_options).hidden_uploads
    assert not Storage(str(tmp_path)).hidden_uploads
    assert not Storage("memory://hidden-uploads").hidden_uploads


def test_delete_incomplete_keeps_a_folder_that_may_have_an_upload_in_flight(gcs_server: GcsServer) -> None:
    """``delete_incomplete`` removes unmarked folders older than the newest commit; on GCS one younger than
    ``ABANDONED_UPLOAD_AGE_S`` may still get a shard no listing shows, so it stays until then."""
    from fsdp_hotload.markers import commit_snapshot
    from fsdp_hotload.retention import ABANDONED_UPLOAD_AGE_S, apply_retention

    st = _storage(gcs_server, "incomplete")
    unmarked = "step-000004-bbbbbbbb"
    st.put_bytes(f"{unmarked}/model-00001-of-00002.safetensors", b"\x01" * 4096)
    time.sleep(1.1)  # the commit below is newer than every file of the unmarked folder
    st.put_bytes("step-000005-aaaaaaaa/model-00001-of-00001.safetensors", b"\x02" * 16)
    commit_snapshot(st, "step-000005-aaaaaaaa", "full", None, {"model-00001-of-00001.safetensors": 16},
                    {"config.json": b"{}"})
    assert apply_retention(st, keep_last=5, delete_incomplete=True) == []
    later = time.time() + ABANDONED_UPLOAD_AGE_S + 60
    assert apply_retention(st, keep_last=5, delete_incomplete=True, now=later) == [unmarked]


def test_a_chunk_cut_off_by_its_deadline_leaves_no_view_of_the_file_s_buffer_to_the_garbage_collector(
        gcs_server: GcsServer) -> None:
    """A resumable upload's chunk request cut off by its deadline stays referenced from garbage cycles (the
    cancelled coroutines' frames, aiohttp's request). Its body was a view of the write file's BytesIO, so the
    cycle collector freed that BytesIO with a buffer still exported: on Python 3.12.0/3.12.1 the process crashes
    there (CPython gh-111049), on 3.13 it prints an ignored BufferError. Each chunk now goes as a copy, so no view
    of a BytesIO is left for the collector (seen here with ``gc.DEBUG_SAVEALL``, which keeps what it would free)."""
    import gc

    chunks = lambda method, path: method in ("POST", "PUT") and "upload_id=" in path  # noqa: E731
    with StallingGcsProxy(gcs_server.endpoint_url, chunks) as proxy:
        st = _storage(gcs_server, "chunk-gc", proxy.url, multipart_threshold=6 * MiB, call_timeout_s=1.0,
                      min_upload_mb_s=100.0, max_attempts=1)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            with pytest.raises(StorageError):
                st.put_bytes("snap/model-00001-of-00001.safetensors", b"\x01" * (12 * MiB))
            gc.collect()
            views = [o for o in gc.garbage if isinstance(o, memoryview) and type(o.obj).__name__ == "_BytesIOBuffer"]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert proxy.stalled >= 1
    assert views == [], f"{len(views)} view(s) of a write file's buffer left to the garbage collector"
