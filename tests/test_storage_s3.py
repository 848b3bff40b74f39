"""Storage on S3 (a real moto server on loopback): multipart uploads and their part sizes, folder marker objects,
a missing bucket, a misspelt option, deletes S3 refuses, a dropped Storage freed with its client, and a credential
that ends in a newline."""
from __future__ import annotations

import os
from pathlib import Path

import fsspec
import pytest

from fsdp_hotload.storage import Storage, StorageError, credential_hint
from tests.s3_fixture import (DeleteErrorsProxy, FaultyFileSystem, S3Server, StallingProxy, access_denied_error,
                               no_such_upload_error)
from tests.test_storage import MiB


def _parts_in_etag(server: S3Server, st: Storage, rel: str) -> int:
    key = st.uri(rel).split(f"s3://{server.bucket}/", 1)[1]
    etag = server.client().head_object(Bucket=server.bucket, Key=key)["ETag"].strip('"')
    return int(etag.rsplit("-", 1)[1]) if "-" in etag else 1


def test_s3_put_file_70mb_is_multipart(s3_server: S3Server, tmp_path: Path) -> None:
    st = Storage(s3_server.unique_uri("multipart"), s3_server.storage_options, multipart_threshold=16 * MiB)
    data = os.urandom(70 * MiB)
    src = tmp_path / "shard.safetensors"
    src.write_bytes(data)
    st.put_file("snap/model-00000.safetensors", str(src))
    assert _parts_in_etag(s3_server, st, "snap/model-00000.safetensors") == 9  # 70 MiB in 8 MiB parts
    assert st.get_bytes("snap/model-00000.safetensors") == data
    assert st.stats.bytes_put == 70 * MiB

    small = tmp_path / "small.bin"
    small.write_bytes(data[: 3 * MiB])
    st.put_file("snap/small.bin", str(small))
    assert _parts_in_etag(s3_server, st, "snap/small.bin") == 1  # below the threshold: one PUT


def test_s3_large_put_bytes_goes_multipart(s3_server: S3Server) -> None:
    st = Storage(s3_server.unique_uri("mv"), s3_server.storage_options, multipart_threshold=10 * MiB)
    data = os.urandom(12 * MiB + 5)
    st.put_bytes("snap/big.bin", memoryview(data))
    assert _parts_in_etag(s3_server, st, "snap/big.bin") == 3  # 5 MiB parts
    assert st.get_bytes("snap/big.bin") == data
    st.put_bytes("snap/big-bytes.bin", data)  # plain bytes go through s3fs's own multipart upload
    assert _parts_in_etag(s3_server, st, "snap/big-bytes.bin") == 3
    assert st.get_bytes("snap/big-bytes.bin") == data
    st.put_bytes("snap/small.bin", memoryview(data)[: 4 * MiB])
    assert _parts_in_etag(s3_server, st, "snap/small.bin") == 1


def _open_uploads(server: S3Server, st: Storage) -> list[str]:
    prefix = st.root.split(f"s3://{server.bucket}/", 1)[1]
    listing = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=prefix)
    return [u["Key"] for u in listing.get("Uploads", [])]


def test_s3_upload_dropped_mid_stream_is_aborted_and_retried(s3_server: S3Server) -> None:
    uri = s3_server.unique_uri("abort")
    inner, _ = fsspec.core.url_to_fs(uri, **s3_server.storage_options)
    faulty = FaultyFileSystem(inner, fail_puts=1, exc_factory=lambda: ConnectionResetError("dropped"),
                              fail_after_bytes=6 * MiB)  # after the first part is uploaded
    st = Storage(uri, fs=faulty, multipart_threshold=10 * MiB, base_backoff_s=0.0001)
    data = os.urandom(12 * MiB)
    st.put_bytes("snap/big.bin", memoryview(data))
    assert st.get_bytes("snap/big.bin") == data and st.stats.retries == 1
    assert _open_uploads(s3_server, st) == []

    faulty.arm(10)  # every try dies mid-stream: nothing may be committed or left open
    with pytest.raises(StorageError, match="snap/other.bin"):
        st.put_bytes("snap/other.bin", memoryview(data))
    assert not st.exists("snap/other.bin")
    assert _open_uploads(s3_server, st) == []


def test_a_missing_bucket_is_named_in_the_error(s3_server: S3Server) -> None:
    st = Storage("s3://no-such-bucket-4711/run", s3_server.storage_options, max_attempts=1)
    for op in (lambda: st.get_bytes("a"), lambda: st.put_bytes("a", b"x")):
        with pytest.raises(FileNotFoundError, match="s3://no-such-bucket-4711/run/a: .*bucket does not exist"):
            op()


def test_a_misspelt_storage_option_is_refused_with_a_suggestion(s3_server: S3Server) -> None:
    """s3fs takes any keyword, so a typo for endpoint_url would silently publish to AWS S3 instead of MinIO."""
    options = dict(s3_server.storage_options)
    options["endpoint"] = options.pop("endpoint_url")
    with pytest.raises(StorageError, match="'endpoint' \\(did you mean 'endpoint_url'\\?\\) not accepted by s3fs"):
        Storage(s3_server.unique_uri("typo"), options)
    st = Storage(s3_server.unique_uri("ok"), {**s3_server.storage_options, "skip_instance_cache": True})
    st.put_bytes("a", b"x")
    assert st.get_bytes("a") == b"x"


def test_zero_byte_folder_objects_are_not_files(s3_server: S3Server) -> None:
    """The S3 console, rclone and Hadoop write "folder/" marker objects; they are not files of a snapshot."""
    uri = s3_server.unique_uri("markers")
    bucket, prefix = uri[len("s3://"):].split("/", 1)
    client = s3_server.client()
    for key in ("", "step-1/", "step-1/a.bin", "empty-dir/"):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"abc" if key.endswith(".bin") else b"")
    st = Storage(uri, s3_server.storage_options)
    assert st.list() == ["step-1/a.bin"]
    assert st.list("step-1") == ["step-1/a.bin"]


def test_a_lost_multipart_upload_is_written_again(s3_server: S3Server) -> None:
    """NoSuchUpload (the upload id was aborted under us) is a 404 that a fresh upload of the object fixes."""
    uri = s3_server.unique_uri("nosuchupload")
    inner, _ = fsspec.core.url_to_fs(uri, **s3_server.storage_options)
    faulty = FaultyFileSystem(inner, fail_puts=1, exc_factory=no_such_upload_error)
    st = Storage(uri, fs=faulty, base_backoff_s=0.0001)
    st.put_bytes("snap/a.bin", b"payload")
    assert st.get_bytes("snap/a.bin") == b"payload" and st.stats.retries == 1 and faulty.failures_raised == 1


def test_an_object_of_exactly_the_threshold_goes_in_one_put(s3_server: S3Server, tmp_path: Path) -> None:
    """An object of exactly multipart_threshold bytes went through pipe_file at a chunk size of half the
    threshold, which s3fs split into two parts with no retry of their own (a refused part failed the attempt,
    so the whole object went again). It now goes in one PUT, which the part requests a proxy stalls never see."""
    data = os.urandom(12 * MiB)
    src = tmp_path / "f"
    src.write_bytes(data)
    with StallingProxy(s3_server.endpoint_url, b"partNumber=") as proxy:
        st = Storage(s3_server.unique_uri("exact"), {**s3_server.storage_options, "endpoint_url": proxy.url,
                                                     "skip_instance_cache": True},
                     multipart_threshold=12 * MiB, call_timeout_s=5, min_upload_mb_s=1e6, max_attempts=2,
                     base_backoff_s=0.001)
        st.put_file("model.bin", str(src))
        st.put_bytes("view.bin", memoryview(data))
        st.put_bytes("delta.bin", data[:12 * MiB - 1])
        assert proxy.stalled == 0
        assert st.get_bytes("model.bin") == data and st.get_bytes("delta.bin") == data[:12 * MiB - 1]
    for rel in ("model.bin", "view.bin", "delta.bin"):
        assert _parts_in_etag(s3_server, st, rel) == 1, rel
    assert st.stats.retries == 0


def test_keys_s3_refuses_to_delete_are_not_reported_deleted(s3_server: S3Server) -> None:
    """S3 answers DeleteObjects with HTTP 200 and an error for each key it did not delete; s3fs's rm dropped
    those, so a refused delete passed for a done one. A transient refusal is now retried, a permanent one
    raised at once, and the objects are still there."""
    uri = s3_server.unique_uri("refused")
    refusals = iter([True])  # only the first DeleteObjects is refused
    with DeleteErrorsProxy(s3_server.endpoint_url, "InternalError", lambda body: next(refusals, False)) as proxy:
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url}, base_backoff_s=0.0001)
        st.put_many({"snap/a.bin": b"a", "snap/b.bin": b"b", "other/c.bin": b"c"})
        st.delete_prefix("snap")
        assert proxy.answered == 1 and st.stats.retries == 1
        assert st.list() == ["other/c.bin"]
    with DeleteErrorsProxy(s3_server.endpoint_url, "AccessDenied", lambda body: True) as proxy:
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url}, base_backoff_s=0.0001)
        with pytest.raises(StorageError, match="AccessDenied") as info:
            st.delete_prefix("other/c.bin")
        assert info.value.attempts == 1 and proxy.answered == 1  # a refusal retrying cannot fix
        assert st.list() == ["other/c.bin"]


def test_a_dropped_s3_storage_is_freed_with_its_client(s3_server: S3Server) -> None:
    """The throttle counter's hook on the botocore client held the Storage, and s3fs's finalizer (which closes
    the client's session when the filesystem is collected) holds that client: every S3 Storage, its client and
    its pool of open connections lived until the process exited. A publisher made per run leaked one each."""
    import gc
    import weakref

    st = Storage(s3_server.unique_uri("freed"), s3_server.storage_options)
    st.put_bytes("snap/a.bin", b"payload")
    assert st.list() == ["snap/a.bin"]
    refs = [weakref.ref(st), weakref.ref(st.fs)]
    del st
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_part_sizes_keep_an_object_within_s3s_ten_thousand_parts(tmp_path: Path) -> None:
    """5 MiB parts hold 48.8 GiB at most: a 50 GB file failed at part 10,001 after sending the rest."""
    from fsdp_hotload.storage import MAX_PARTS, MAX_PART_SIZE

    st = Storage(str(tmp_path), multipart_threshold=10 * 2**20)
    assert st._part_size(100 * 2**20) == 5 * 2**20
    for size in (50 * 10**9, 300 * 2**30, 4 * 10**12):
        part = st._part_size(size)
        assert part % 2**20 == 0 and -(-size // part) <= MAX_PARTS and part <= MAX_PART_SIZE, (size, part)
    with pytest.raises(ValueError, match="5 GiB"):
        st._part_size(MAX_PARTS * MAX_PART_SIZE + 1)


def test_big_bytes_go_to_an_object_store_part_by_part(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delta file is bytes: above the threshold it went through pipe_file, ~10 parts at once, each a copy of
    its slice. It is now streamed from views like any large buffer, and lands whole."""
    st = Storage(s3_server.unique_uri("bigbytes"), s3_server.storage_options, multipart_threshold=6 * 2**20)
    piped: list[int] = []
    monkeypatch.setattr(st, "_pipe_file", lambda path, payload, kwargs: piped.append(len(payload)))
    data = os.urandom(13 * 2**20)
    st.put_bytes("step-000001-a1b2c3d4/model.safetensors", data)
    assert piped == [] and st.get_bytes("step-000001-a1b2c3d4/model.safetensors") == data


@pytest.mark.parametrize("where", ["env", "options"])
def test_a_credential_ending_in_a_newline_fails_at_once_naming_it(s3_server: S3Server, where: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An access key read from a secret file keeps its newline, and botocore refuses to send the header
    ("Forbidden control character detected in headers") inside an HTTPClientError: that was retried as a dropped
    connection, for every attempt, and no message named the credential. It now fails at once, naming where the
    credential came from and never its value."""
    options = {**s3_server.storage_options, "skip_instance_cache": True}
    if where == "env":
        del options["key"], options["secret"]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.key + "\n")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret)
        culprit = "$AWS_ACCESS_KEY_ID"
    else:
        options["key"] = s3_server.key + "\n"
        culprit = "storage_options['key']"
    st = Storage(s3_server.unique_uri("newline"), options, max_attempts=4, base_backoff_s=0.0001)
    with pytest.raises(StorageError, match="fatal error, not retried") as info:
        st.put_bytes("snap/x", b"x")
    assert info.value.attempts == 1 and st.stats.retries == 0
    assert f"{culprit} starts or ends in whitespace" in str(info.value), str(info.value)
    assert s3_server.key not in str(info.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret + "\n")  # S3 refuses the signature: named too
    assert "$AWS_SECRET_ACCESS_KEY starts or ends" in str(credential_hint(access_denied_error(), {}))
    # keys in the options are the ones botocore signs with: a stray variable in the environment is not blamed
    assert credential_hint(access_denied_error(), {"key": "k", "secret": "s"}) is None
    assert credential_hint(ConnectionError("reset"), {}) is None  # only for errors a credential causes


def test_a_whole_read_of_a_small_object_is_one_get(s3_server: S3Server) -> None:
    """A marker, manifest or hint read (its size known, or a bound on it) is one GetObject: s3fs used to send a
    HeadObject before each one (to split big objects into concurrent ranged reads), a second round trip to a
    store that may be in another region. A read without a size still asks for it once, and a big object is still
    read in s3fs's concurrent ranges; every read returns the object's bytes."""
    from tests.s3_fault_proxy import S3FaultProxy

    with S3FaultProxy(s3_server.endpoint_url) as proxy:
        st = Storage(s3_server.unique_uri("one-get"), {**s3_server.storage_options, "endpoint_url": proxy.url,
                                                        "skip_instance_cache": True, "default_block_size": 5 * MiB})
        small, big = os.urandom(300), os.urandom(6 * MiB + 3)
        st.put_bytes("snap/marker.json", small)
        st.put_bytes("snap/big.bin", big)
        proxy.reset()
        assert st.get_bytes("snap/marker.json", size_hint=4096) == small
        assert (proxy.count("HeadObject"), proxy.count("GetObject")) == (0, 1)
        proxy.reset()
        assert st.get_bytes("snap/marker.json") == small
        assert (proxy.count("HeadObject"), proxy.count("GetObject")) == (1, 1)
        proxy.reset()
        assert st.get_bytes("snap/big.bin") == big
        assert proxy.count("GetObject") == 2  # two ranges of at most 5 MiB
