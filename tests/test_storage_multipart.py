"""Multipart uploads to S3 under a throttled or flaky store (a real moto server behind a proxy that refuses or
loses chosen requests): a refused part is sent again on its own, a failed upload is aborted by its id, and no
upload is left open (S3 bills the parts of an open upload, and no object listing shows it)."""
from __future__ import annotations

import os
import random
from typing import Any, Iterator

import pytest

from fsdp_hotload.storage import Storage, StorageError
from tests.s3_fault_proxy import S3FaultProxy
from tests.s3_fixture import S3Server, StallingProxy

MiB = 2**20
DATA = os.urandom(15 * MiB)  # three 5 MiB parts at a 10 MiB multipart threshold


class HalfRng(random.Random):
    """Full jitter drawn at the middle: each wait is half its cap, so the backoff can be checked exactly."""

    def random(self) -> float:
        return 0.5


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(s3_server.endpoint_url) as p:
        yield p


def _storage(server: S3Server, endpoint: str, **kwargs: Any) -> Storage:
    options = {**server.storage_options, "endpoint_url": endpoint, "skip_instance_cache": True}
    kwargs.setdefault("sleep", lambda s: None)
    return Storage(server.unique_uri("mpu"), options, multipart_threshold=10 * MiB, base_backoff_s=0.01,
                   throttle_backoff_s=0.5, rng=HalfRng(), **kwargs)


def _open_uploads(server: S3Server, st: Storage) -> list[str]:
    """Open multipart uploads under the storage's root, asked of the store directly (not through the proxy)."""
    prefix = st.root.split(f"s3://{server.bucket}/", 1)[1]
    listing = server.client().list_multipart_uploads(Bucket=server.bucket, Prefix=prefix + "/")
    return [u["Key"] for u in listing.get("Uploads", [])]


def test_a_refused_part_is_sent_again_on_its_own(s3_server: S3Server, proxy: S3FaultProxy) -> None:
    """Each part's first two requests (botocore's two tries) get SlowDown. A part refused twice used to fail the
    whole object, and the next attempt sent every part again from part 1: three attempts did not get three parts
    through. Now each part is retried alone, with the throttle backoff, and counted in the stats."""
    delays: list[float] = []
    st = _storage(s3_server, proxy.url, max_attempts=3, sleep=delays.append)
    proxy.rule = lambda req: "slowdown" if req.op == "UploadPart" and req.part_n <= 2 else None
    st.put_bytes("snap/model.bin", DATA)
    assert proxy.count("CreateMultipartUpload") == 1  # one upload: the object was never started over
    assert proxy.count("UploadPart", "forward") == 3 and proxy.count("UploadPart", "slowdown") == 6
    assert delays == [0.25] * 3  # half of throttle_backoff_s: the first retry of each part
    assert (st.stats.retries, st.stats.throttled, st.stats.failures) == (3, 6, 0)
    assert st.stats.backoff_seconds == pytest.approx(0.75)
    proxy.reset()
    assert st.get_bytes("snap/model.bin") == DATA
    assert _open_uploads(s3_server, st) == []


def test_a_part_that_stays_refused_fails_the_put_naming_the_part(s3_server: S3Server, proxy: S3FaultProxy) -> None:
    """A part that used up its own tries settles the put (sending the other parts again would not help it), and
    the error says which request failed; its upload is aborted by id, with no listing."""
    st = _storage(s3_server, proxy.url, max_attempts=2)
    proxy.rule = lambda req: "slowdown" if req.op == "UploadPart" and req.part == 2 else None
    with pytest.raises(StorageError, match=r"put s3://.*/snap/model\.bin failed after 2 attempts: .*"
                                           r"\(in S3 request UploadPart \(part 2\)\)") as err:
        st.put_bytes("snap/model.bin", DATA)
    assert err.value.attempts == 2
    assert proxy.count("CreateMultipartUpload") == 1 and proxy.count("UploadPart", "slowdown") == 4
    assert proxy.count("AbortMultipartUpload") == 1 and proxy.count("ListMultipartUploads") == 0
    assert (st.stats.retries, st.stats.throttled, st.stats.failures) == (1, 4, 1)
    assert _open_uploads(s3_server, st) == []


def test_a_lost_upload_is_not_retried_part_by_part(s3_server: S3Server, proxy: S3FaultProxy) -> None:
    """NoSuchUpload (the upload was aborted under the writer) fails every part the same way: the object is written
    again from a fresh upload instead."""
    st = _storage(s3_server, proxy.url)
    proxy.rule = lambda req: "nosuchupload" if req.op == "UploadPart" and req.n == 2 else None
    st.put_bytes("snap/model.bin", DATA)
    assert proxy.count("UploadPart", "nosuchupload") == 1 and proxy.count("CreateMultipartUpload") == 2
    proxy.reset()
    assert st.get_bytes("snap/model.bin") == DATA
    assert _open_uploads(s3_server, st) == []


def test_a_failed_upload_is_aborted_by_its_id_while_listings_are_throttled(s3_server: S3Server,
                                                                           proxy: S3FaultProxy) -> None:
    """The completion is refused twice (the attempt fails) and every listing of uploads is throttled. The abort
    used to list the key's uploads first; refused, it gave up, the second attempt succeeded, and the first
    attempt's parts stayed open, billed, for good."""
    st = _storage(s3_server, proxy.url, max_attempts=2)
    proxy.rule = lambda req: "slowdown" if req.op == "ListMultipartUploads" or (
        req.op == "CompleteMultipartUpload" and req.n <= 2) else None
    st.put_bytes("snap/model.bin", DATA)
    assert _open_uploads(s3_server, st) == []
    assert proxy.count("CreateMultipartUpload") == 2 and proxy.count("AbortMultipartUpload", "forward") == 1
    proxy.reset()
    assert st.get_bytes("snap/model.bin") == DATA

    proxy.rule = lambda req: "internal" if req.op == "CompleteMultipartUpload" else None
    with pytest.raises(StorageError, match=r"failed after 2 attempts: .*\(in S3 request CompleteMultipartUpload\)"):
        st.put_bytes("snap/never.bin", DATA)
    assert proxy.count("AbortMultipartUpload", "forward") == 2
    assert _open_uploads(s3_server, st) == []


def test_a_lost_create_reply_leaves_no_second_upload_open(s3_server: S3Server, proxy: S3FaultProxy) -> None:
    """The store made the upload but its reply was lost, so botocore asked again and the write went to the second
    upload; the first stayed open. It is aborted after the write, a listing that an upload created at its first
    try does not cost."""
    st = _storage(s3_server, proxy.url)
    proxy.rule = lambda req: "lost" if req.op == "CreateMultipartUpload" and req.n == 1 else None
    st.put_bytes("snap/model.bin", DATA)
    assert _open_uploads(s3_server, st) == []
    assert proxy.count("CreateMultipartUpload") == 2 and proxy.count("AbortMultipartUpload") == 1
    proxy.reset()
    assert st.get_bytes("snap/model.bin") == DATA

    st.put_bytes("snap/second.bin", DATA)
    assert proxy.count("ListMultipartUploads") == 0 and proxy.count("AbortMultipartUpload") == 0


def test_a_clean_write_lists_no_uploads_where_the_user_sets_botocore_retries(s3_server: S3Server,
                                                                            proxy: S3FaultProxy) -> None:
    """With ``config_kwargs.retries`` given, Storage leaves s3fs's own retry loop on (5 tries); every multipart
    write then listed the key's uploads after it succeeded, a request per large file (and a warning per file where
    the policy lacks s3:ListBucketMultipartUploads), though nothing was sent twice."""
    options = {**s3_server.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True,
               "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 3}}}
    st = Storage(s3_server.unique_uri("mpu"), options, multipart_threshold=10 * MiB)
    st.put_bytes("snap/model.bin", DATA)
    assert proxy.count("CreateMultipartUpload") == 1 and proxy.count("ListMultipartUploads") == 0
    assert st.get_bytes("snap/model.bin") == DATA


def test_a_create_whose_reply_was_lost_and_then_refused_is_aborted_by_listing(s3_server: S3Server,
                                                                                proxy: S3FaultProxy) -> None:
    """No upload id came back (the first reply lost, the second try refused), yet the store made an upload: the
    key's uploads are listed and aborted before the write starts over."""
    st = _storage(s3_server, proxy.url)
    proxy.rule = lambda req: {1: "lost", 2: "slowdown"}.get(req.n) if req.op == "CreateMultipartUpload" else None
    st.put_bytes("snap/model.bin", DATA)
    assert proxy.count("ListMultipartUploads") == 1 and proxy.count("AbortMultipartUpload") == 1
    assert _open_uploads(s3_server, st) == []


def test_a_part_cut_off_by_its_deadline_is_not_waited_on_again_and_again(s3_server: S3Server) -> None:
    """A part gets its own retries for at most its own deadline: one that times out is not sent again on its own
    (max_attempts parts of call_timeout_s each, per attempt of the object); the object is started over."""
    with StallingProxy(s3_server.endpoint_url, b"partNumber=") as stall:
        st = _storage(s3_server, stall.url, max_attempts=3, call_timeout_s=3, min_upload_mb_s=1e6)
        with pytest.raises(StorageError, match=r"after 3 attempts: FSTimeoutError.*UploadPart \(part 1\)"):
            st.put_bytes("snap/model.bin", DATA)
        assert stall.stalled == 3, stall.stalled  # once per attempt of the object, never again on its own
    assert _open_uploads(s3_server, st) == []
