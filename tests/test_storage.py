"""Storage layer: round trips on real backends (local, file://, memory://, moto S3 on loopback), atomic and durable
local writes, error classification and backoff, optional backends, and the roots and options refused. S3's own
behaviour is in test_storage_s3.py; retries and deadlines under faults in test_storage_retries.py."""
from __future__ import annotations

import errno
import os
import random
import socket
import stat
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import fsspec
import numpy as np
import pytest

from fsdp_hotload.storage import (
    TMP_PREFIX,
    ErrorClass,
    MissingBackendError,
    Storage,
    StorageError,
    backend_install_hint,
    backoff_delay,
    classify_error,
)
from tests.s3_fixture import FaultyFileSystem, S3Server, access_denied_error, no_such_upload_error, slowdown_error

# The s3_server fixture comes from tests/conftest.py (tests.s3_fixture).

MiB = 2**20
BACKENDS = ["local", "file", "memory", "s3"]


@pytest.fixture
def make_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Storage]:
    """Build a Storage on a fresh root of the requested backend."""

    def make(kind: str, **kwargs: object) -> Storage:
        if kind == "local":
            return Storage(str(tmp_path / f"root-{uuid.uuid4().hex[:6]}"), **kwargs)
        if kind == "file":
            return Storage(f"file://{tmp_path}/root-{uuid.uuid4().hex[:6]}", **kwargs)
        if kind == "memory":
            return Storage(f"memory://hotload-tests/{uuid.uuid4().hex}", **kwargs)
        if kind == "s3":
            server: S3Server = request.getfixturevalue("s3_server")
            return Storage(server.unique_uri("st"), server.storage_options, **kwargs)
        raise AssertionError(kind)

    return make


# ------------------------------------------------------------------------------------------------------------
# Error classification and backoff (pure)
# ------------------------------------------------------------------------------------------------------------


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": f"{code} message"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def _aiohttp_status(status: int) -> Exception:
    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    url = URL("http://127.0.0.1:9/bucket/key")
    info = aiohttp.RequestInfo(url, "PUT", CIMultiDictProxy(CIMultiDict()), url)
    return aiohttp.ClientResponseError(info, (), status=status, message="status")


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def _botocore(name: str) -> Exception:
    import botocore.exceptions as be

    if name == "EndpointConnectionError":
        return be.EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    if name == "ReadTimeoutError":
        return be.ReadTimeoutError(endpoint_url="http://127.0.0.1:1")
    return be.NoCredentialsError()


CASES: list[tuple[str, Callable[[], BaseException], ErrorClass]] = [
    ("SlowDown translated by s3fs", lambda: slowdown_error(), ErrorClass.THROTTLE),
    ("SlowDown raw ClientError", lambda: slowdown_error(translated=False), ErrorClass.THROTTLE),
    ("Throttling", lambda: _client_error("Throttling", 400), ErrorClass.THROTTLE),
    ("ThrottlingException", lambda: _client_error("ThrottlingException", 400), ErrorClass.THROTTLE),
    ("RequestLimitExceeded", lambda: _client_error("RequestLimitExceeded", 400), ErrorClass.THROTTLE),
    ("HTTP 503 by status", lambda: _client_error("Whatever", 503), ErrorClass.THROTTLE),
    ("HTTP 429 from aiohttp", lambda: _aiohttp_status(429), ErrorClass.THROTTLE),
    ("HTTP 503 from aiohttp", lambda: _aiohttp_status(503), ErrorClass.THROTTLE),
    ("rate text only", lambda: OSError("Please reduce your request rate."), ErrorClass.THROTTLE),
    ("ConnectionResetError", lambda: ConnectionResetError("reset by peer"), ErrorClass.TRANSIENT),
    ("ConnectionError", lambda: ConnectionError("reset"), ErrorClass.TRANSIENT),
    ("TimeoutError", lambda: TimeoutError("timed out"), ErrorClass.TRANSIENT),
    ("socket.timeout", lambda: socket.timeout("timed out"), ErrorClass.TRANSIENT),
    ("OSError ECONNRESET", lambda: OSError(errno.ECONNRESET, "reset"), ErrorClass.TRANSIENT),
    ("InternalError 500", lambda: _client_error("InternalError", 500), ErrorClass.TRANSIENT),
    ("HTTP 502 from aiohttp", lambda: _aiohttp_status(502), ErrorClass.TRANSIENT),
    ("botocore EndpointConnectionError", lambda: _botocore("EndpointConnectionError"), ErrorClass.TRANSIENT),
    ("botocore ReadTimeoutError", lambda: _botocore("ReadTimeoutError"), ErrorClass.TRANSIENT),
    ("aiohttp ServerDisconnectedError", lambda: __import__("aiohttp").ServerDisconnectedError(),
     ErrorClass.TRANSIENT),
    ("wrapped transient", lambda: _chained(OSError(errno.EIO, "boom"), ConnectionResetError()),
     ErrorClass.TRANSIENT),
    ("botocore IncompleteReadError (a body cut short)", lambda: __import__("botocore.exceptions").exceptions
     .IncompleteReadError(actual_bytes=3, expected_bytes=9), ErrorClass.TRANSIENT),
    ("botocore FlexibleChecksumError", lambda: __import__("botocore.exceptions").exceptions
     .FlexibleChecksumError(error_msg="crc32 mismatch"), ErrorClass.TRANSIENT),
    ("requests ProxyError (gcsfs on a 502)", lambda: __import__("requests.exceptions").exceptions.ProxyError(
        "502 Bad Gateway"), ErrorClass.TRANSIENT),
    ("PermissionError", lambda: PermissionError("denied"), ErrorClass.FATAL),
    ("AccessDenied translated by s3fs", lambda: access_denied_error(), ErrorClass.FATAL),
    ("AccessDenied raw", lambda: access_denied_error(translated=False), ErrorClass.FATAL),
    ("HTTP 403 from aiohttp", lambda: _aiohttp_status(403), ErrorClass.FATAL),
    ("NoCredentialsError", lambda: _botocore("NoCredentialsError"), ErrorClass.FATAL),
    ("ValueError (a bug)", lambda: ValueError("bad argument"), ErrorClass.FATAL),
    ("OSError ENOSPC", lambda: OSError(errno.ENOSPC, "disk full"), ErrorClass.FATAL),
    ("FileNotFoundError", lambda: FileNotFoundError("gone"), ErrorClass.NOT_FOUND),
    ("NoSuchKey raw", lambda: _client_error("NoSuchKey", 404), ErrorClass.NOT_FOUND),
    # A lost multipart upload is a 404 too, but writing the object again from the start fixes it.
    ("NoSuchUpload translated by s3fs", lambda: no_such_upload_error(), ErrorClass.TRANSIENT),
    ("NoSuchUpload raw", lambda: no_such_upload_error(translated=False), ErrorClass.TRANSIENT),
    # A throttle phrase in a file name is not the service asking to slow down.
    ("ENOTDIR under a folder named slowdown", lambda: NotADirectoryError(errno.ENOTDIR, "Not a directory",
                                                                         "/data/slowdown-file/sub"), ErrorClass.FATAL),
    ("EACCES under a folder named slowdown", lambda: PermissionError(errno.EACCES, "Permission denied",
                                                                     "/data/slowdown/x"), ErrorClass.FATAL),
    ("ENOSPC under 'too many requests'", lambda: OSError(errno.ENOSPC, "No space left on device",
                                                         "/mnt/too many requests/x"), ErrorClass.FATAL),
]


@pytest.mark.parametrize("make_exc,expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_classify_error(make_exc: Callable[[], BaseException], expected: ErrorClass) -> None:
    assert classify_error(make_exc()) is expected


def test_retryable_flags() -> None:
    assert ErrorClass.THROTTLE.retryable and ErrorClass.TRANSIENT.retryable
    assert not ErrorClass.FATAL.retryable and not ErrorClass.NOT_FOUND.retryable


def test_backoff_delay_full_jitter_and_cap() -> None:
    assert [backoff_delay(a, 0.5, 100.0, 1.0) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_delay(10, 0.5, 3.0, 1.0) == 3.0          # capped
    assert backoff_delay(3, 0.5, 100.0, 0.0) == 0.0          # full jitter reaches zero
    draws = [backoff_delay(3, 0.5, 100.0, random.Random(i).random()) for i in range(200)]
    assert all(0.0 <= d <= 2.0 for d in draws) and max(draws) - min(draws) > 1.0
    with pytest.raises(ValueError):
        backoff_delay(0, 0.5, 1.0, 0.5)


# ------------------------------------------------------------------------------------------------------------
# Round trips on every backend
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
def test_round_trip_and_listing(kind: str, make_storage: Callable[..., Storage], tmp_path: Path) -> None:
    st = make_storage(kind)
    assert not st.root.endswith("/") and st.uri("a/b") == st.root + "/a/b"
    assert st.list() == [] and st.list_dirs() == []
    payload = os.urandom(100_003)
    st.put_bytes("snap-1/model-00000.safetensors", payload)
    st.put_bytes("snap-1/config.json", memoryview(b'{"a": 1}'))
    st.put_bytes("snap-1/sub/deep.bin", bytearray(b"deep"))
    st.put_bytes("snap-10/x", b"")
    st.put_many({f"snap-2/f{i}": bytes([i]) * (i + 1) for i in range(5)})
    src = tmp_path / "src.bin"
    src.write_bytes(b"from a file" * 1000)
    st.put_file("snap-2/from-file.bin", str(src))

    assert st.get_bytes("snap-1/model-00000.safetensors") == payload
    assert st.get_bytes("snap-1/config.json") == b'{"a": 1}'
    assert st.get_bytes("snap-10/x") == b""
    assert st.get_bytes("snap-2/f3") == b"\x03" * 4
    assert st.get_bytes("snap-2/from-file.bin") == src.read_bytes()
    assert st.size("snap-1/model-00000.safetensors") == len(payload)
    assert st.exists("snap-1/config.json") and not st.exists("snap-1/nope.json")
    assert st.list_dirs() == ["snap-1", "snap-10", "snap-2"]
    # A prefix is a directory: "snap-1" does not pick up "snap-10"; results are relpaths from the root.
    assert st.list("snap-1") == ["snap-1/config.json", "snap-1/model-00000.safetensors", "snap-1/sub/deep.bin"]
    assert st.list("snap-1/") == st.list("snap-1")
    assert len(st.list()) == 3 + 1 + 6
    assert st.list_info("snap-2")["snap-2/f4"].size == 5

    st.put_bytes("snap-1/config.json", b"{}")  # overwrite
    assert st.get_bytes("snap-1/config.json") == b"{}"

    st.delete_prefix("snap-1")
    st.delete_prefix("never-existed")
    assert st.list_dirs() == ["snap-10", "snap-2"]
    assert st.list("snap-1") == []
    with pytest.raises(FileNotFoundError):
        st.get_bytes("snap-1/config.json")
    with pytest.raises(FileNotFoundError):
        st.size("snap-1/config.json")
    assert st.stats.puts == 11 and st.stats.retries == 0
    assert st.stats.bytes_put == len(payload) + 8 + 4 + 0 + 15 + src.stat().st_size + 2


@pytest.mark.parametrize("kind", BACKENDS)
def test_any_buffer_is_written_as_its_bytes_in_c_order(kind: str, make_storage: Callable[..., Storage]) -> None:
    """A strided view (of floats or of bytes) and a Fortran-order array (a caller's, not the publisher's) are
    written as ``tobytes()`` would give them; the put raised a bare TypeError (such a view cannot be cast to bytes)
    or, for strided bytes on a local root, a BufferError from the file's write."""
    st = make_storage(kind)
    floats = np.arange(3 * 2**18, dtype=np.float32)
    cases = {"strided.bin": floats[::3], "fortran.bin": np.asfortranarray(floats.reshape(1024, -1)),
             "c.bin": floats.reshape(1024, -1), "strided-bytes.bin": floats.view(np.uint8)[::5]}
    for name, array in cases.items():
        st.put_bytes(name, memoryview(array))
        assert st.get_bytes(name) == array.tobytes(), name


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_put_file_large_streams(kind: str, make_storage: Callable[..., Storage], tmp_path: Path) -> None:
    st = make_storage(kind, multipart_threshold=6 * MiB)
    data = os.urandom(13 * MiB + 17)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    st.put_file("s/big.bin", str(src))
    assert st.size("s/big.bin") == len(data)
    assert st.get_bytes("s/big.bin") == data
    with pytest.raises(FileNotFoundError):
        st.put_file("s/other.bin", str(tmp_path / "missing.bin"))


def test_bad_relpaths_and_roots(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    for bad in ["", "/abs", "a/../b", "a//b", "./a", "a\\b"]:
        with pytest.raises(ValueError, match="relpath"):
            st.put_bytes(bad, b"x")
    with pytest.raises(ValueError, match="whole storage root"):
        st.delete_prefix("")
    with pytest.raises(ValueError):
        Storage("s3://")
    assert Storage(str(tmp_path) + "/").root == str(tmp_path)
    assert Storage("memory://a/b/").root == "memory://a/b"


# ------------------------------------------------------------------------------------------------------------
# Local atomicity
# ------------------------------------------------------------------------------------------------------------


def test_local_writes_are_atomic_for_concurrent_readers(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    versions = [bytes([v]) * MiB for v in range(4)]
    st.put_bytes("s/f.bin", versions[0])
    stop = threading.Event()
    seen: list[bytes] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.append((tmp_path / "s" / "f.bin").read_bytes())
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(24):
            st.put_bytes("s/f.bin", versions[i % 4])
    finally:
        stop.set()
        t.join()
    assert not errors
    assert seen and all(s in versions for s in seen)  # never a torn or empty file
    assert os.listdir(tmp_path / "s") == ["f.bin"]  # no temp files left behind


def test_failed_local_write_keeps_old_file_and_hides_temp_files(tmp_path: Path) -> None:
    faulty = FaultyFileSystem(fsspec.filesystem("file"), fail_puts=1,
                              exc_factory=lambda: OSError(errno.ENOSPC, "full"),
                              fail_after_bytes=0)  # dies mid-write, after the temp file exists
    st = Storage(str(tmp_path), fs=faulty, base_backoff_s=0)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "f.bin").write_bytes(b"old")
    with pytest.raises(StorageError, match="f.bin"):
        st.put_bytes("s/f.bin", b"new")
    assert (tmp_path / "s" / "f.bin").read_bytes() == b"old"
    assert os.listdir(tmp_path / "s") == ["f.bin"]
    (tmp_path / "s" / f"{TMP_PREFIX}g.bin.deadbeef").write_bytes(b"torn")  # as a crash would leave it
    assert st.list("s") == ["s/f.bin"]


# ------------------------------------------------------------------------------------------------------------
# Optional backends
# ------------------------------------------------------------------------------------------------------------


def test_backend_install_hint() -> None:
    assert backend_install_hint("s3") == "s3:// needs s3fs: pip install 'hotload[s3]'"
    assert backend_install_hint("gs") == "gs:// needs gcsfs: pip install 'hotload[gcs]'"
    assert backend_install_hint("memory") is None


@pytest.mark.parametrize("uri,module,extra", [("s3://bucket/prefix", "s3fs", "hotload[s3]"),
                                              ("gs://bucket/prefix", "gcsfs", "hotload[gcs]")])
def test_missing_optional_backend(monkeypatch: pytest.MonkeyPatch, uri: str, module: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import <module>` fail as if not installed
    with pytest.raises(MissingBackendError) as info:
        Storage(uri)
    msg = str(info.value)
    assert module in msg and extra in msg and uri in msg
    assert isinstance(info.value, ImportError)


def test_unknown_protocol_names_the_uri_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="nosuchproto://bucket/x") as info:
        Storage("nosuchproto://bucket/x")
    assert all(s in str(info.value) for s in ("file://", "s3://", "gs://", "memory://"))


@pytest.mark.parametrize("root", ["s3://bkt//dbl", "s3://bkt/./x", "gs://b/a/../c"])
def test_object_store_roots_with_empty_or_dot_segments_are_refused(root: str) -> None:
    """``s3://bkt//dbl`` wrote keys that no listing returns, so no snapshot under it could ever be committed."""
    with pytest.raises(ValueError, match=r"empty, '\.' or '\.\.' segment"):
        Storage(root)


@pytest.mark.parametrize("root", ["memory://runs/exp[12]", "s3://bkt/runs/exp*", "gs://b/run*"])
def test_object_store_roots_with_glob_characters_are_refused(root: str) -> None:
    """fsspec's rm expands * ? [ on object stores: retention under "runs/exp[12]" deleted the snapshots of
    "runs/exp1" and "runs/exp2" and none of its own ('?', a URL's query, is refused as one)."""
    with pytest.raises(ValueError, match=r"glob character"):
        Storage(root)
    with pytest.raises(ValueError, match=r"'\?', which starts a URL's query .* expands as a glob"):
        Storage("memory://runs/exp?")


@pytest.mark.parametrize("root, meant", [("s3:/my-bucket/run", "s3://my-bucket/run"), ("s3:bkt/run", "s3://bkt/run"),
                                         ("gs:b", "gs://b"), ("file:/srv/run", "file:///srv/run")])
def test_a_scheme_missing_its_slashes_is_refused_not_made_a_local_folder(tmp_path: Path, monkeypatch: Any,
                                                                          root: str, meant: str) -> None:
    """'s3:/my-bucket/run' has no '://', so it was a local path: every snapshot, manifest and commit marker went to
    ./s3:/my-bucket/run on the trainer's disk, with no error."""
    from fsdp_hotload import HotloadConfig

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"did you mean {meant}"):
        Storage(root)
    with pytest.raises(ValueError, match=f"(?s)bucket_url.*did you mean {meant}"):
        HotloadConfig(bucket_url=root)
    assert os.listdir(tmp_path) == []
    assert Storage(str(tmp_path / "a:b")).put_bytes("step-1/x", b"y") is None  # a colon elsewhere is a name
    assert (tmp_path / "a:b" / "step-1" / "x").read_bytes() == b"y"


def test_a_local_root_holding_a_chain_separator_is_refused(tmp_path: Path) -> None:
    """fsspec reads '/x/a::b' as the chain 'b' over '/x/a': the files went to /x/a, maybe another run's root."""
    from fsdp_hotload import HotloadConfig

    for make in (lambda: Storage(str(tmp_path / "a::b")), lambda: HotloadConfig(bucket_url=str(tmp_path / "a::b"))):
        with pytest.raises(ValueError, match="holds '::'"):
            make()
    assert os.listdir(tmp_path) == []


def test_a_local_root_with_brackets_deletes_only_its_own_files(tmp_path: Path) -> None:
    sibling = Storage(str(tmp_path / "exp1"))
    sibling.put_bytes("step-1/a", b"x")
    own = Storage(str(tmp_path / "exp[1]"))
    own.put_bytes("step-1/a", b"y")
    own.delete_prefix("step-1")
    assert own.list() == [] and sibling.list() == ["step-1/a"]


@pytest.mark.parametrize("options", [{"endpoint_url": "http://127.0.0.1:9000", "key": "k", "secret": "s"},
                                     {"anon": True}])
def test_object_store_options_on_a_local_root_are_refused(tmp_path: Path, options: dict[str, Any]) -> None:
    """A root without its scheme ("my-bucket/run") and a MinIO endpoint wrote the snapshots to the local disk."""
    with pytest.raises(ValueError, match=rf"storage_options \['{sorted(options)[0]}'.* is a local path"):
        Storage(str(tmp_path / "my-bucket"), options)
    assert not (tmp_path / "my-bucket").exists()
    Storage(str(tmp_path / "ok"), {"auto_mkdir": True, "skip_instance_cache": True})  # what local paths take


def test_backoff_does_not_overflow_after_a_thousand_attempts() -> None:
    assert backoff_delay(5000, 0.5, 30.0, 1.0) == 30.0


def test_a_very_long_file_name_is_written_through_a_shorter_temp_name(tmp_path: Path) -> None:
    """The temp name added 26 characters: a 240-character name, legal on Linux, failed with ENAMETOOLONG."""
    st = Storage(str(tmp_path))
    name = "m" * 240
    st.put_bytes(f"d/{name}", b"x")
    assert st.get_bytes(f"d/{name}") == b"x"


def test_a_caching_layer_over_a_store_is_refused_and_not_written_as_a_local_disk() -> None:
    """A ``simplecache::`` root kept a local copy of every byte written for the life of the process, and hid the
    object store from the storage layer: it is refused, naming the plain URL. A caching filesystem given as ``fs``
    says local_file too: writes took the temp-file-and-os.replace path, uploading the temp object in full and then
    failing every put on a local rename (FileNotFoundError, not retried)."""
    root = f"memory://chain-{uuid.uuid4().hex[:8]}/root"
    with pytest.raises(ValueError, match=f"simplecache in front of the store.*give the plain URL {root}"):
        Storage(f"simplecache::{root}")
    st = Storage(root, fs=fsspec.filesystem("simplecache", target_protocol="memory"))
    assert not st._local
    st.put_bytes("step-000001-a1b2c3d4/model-00001-of-00001.safetensors", b"x" * 1000)
    assert st.get_bytes("step-000001-a1b2c3d4/model-00001-of-00001.safetensors") == b"x" * 1000
    assert st.list("step-000001-a1b2c3d4") == ["step-000001-a1b2c3d4/model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("prefix", ["*", "step-[12]", "step-00000?-aa"])
def test_delete_prefix_refuses_glob_characters(prefix: str) -> None:
    """fsspec's rm expands them on object stores and memory://: "*" deleted the whole root past its guard."""
    st = Storage(f"memory://glob-{uuid.uuid4().hex[:8]}")
    st.put_bytes("step-1/a", b"1")
    st.put_bytes("step-2/a", b"2")
    with pytest.raises(ValueError, match="glob character"):
        st.delete_prefix(prefix)
    assert sorted(st.list_dirs()) == ["step-1", "step-2"]


def test_a_local_write_makes_the_folders_it_created_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the file's own folder was fsynced: the snapshot folder itself, new in the root, could vanish at a
    power loss after its marker was signalled. And a long name is cut to 200 bytes, not characters."""
    synced: list[str] = []
    real_open, real_fsync = os.open, os.fsync
    fds: dict[int, str] = {}

    def spy_open(path: Any, flags: int, *a: Any, **k: Any) -> int:
        fd = real_open(path, flags, *a, **k)
        fds[fd] = os.fspath(path)
        return fd

    def spy_fsync(fd: int) -> None:
        if fd in fds:
            synced.append(fds[fd])
        real_fsync(fd)

    st = Storage(str(tmp_path / "root"))
    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    st.put_bytes("step-000001-a1b2c3d4/model-00001-of-00001.safetensors", b"abc")
    root = str(tmp_path / "root")
    assert os.path.join(root, "step-000001-a1b2c3d4") in synced and root in synced, synced
    name = "模" * 82  # 246 bytes in UTF-8: a legal name, whose temp name must stay under the 255-byte limit
    st.put_bytes(f"step-000001-a1b2c3d4/{name}", b"x")
    assert st.get_bytes(f"step-000001-a1b2c3d4/{name}") == b"x"


@pytest.mark.parametrize("err,synced", [(errno.EIO, False), (errno.ENOSPC, False), (errno.EINVAL, True)])
def test_a_failed_fsync_fails_the_local_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int,
                                              synced: bool) -> None:
    """fsync's EIO and ENOSPC were swallowed with EINVAL: the temp file was renamed in and the put returned, so a
    commit marker went on to vouch for a weight file whose pages the kernel may have dropped. Only a filesystem
    that cannot sync a file (EINVAL, ENOTSUP) passes; the fault is injected at the system call."""
    st = Storage(str(tmp_path / "root"))
    st.put_bytes("s/a.bin", b"old")
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(err, os.strerror(err))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    if synced:
        st.put_bytes("s/a.bin", b"new")
    else:
        with pytest.raises(StorageError, match=os.strerror(err)) as info:
            st.put_bytes("s/a.bin", b"new")
        assert info.value.attempts == 1  # not retried: the disk said no
    assert st.get_bytes("s/a.bin") == (b"new" if synced else b"old")
    assert os.listdir(tmp_path / "root" / "s") == ["a.bin"]  # no temp file left
