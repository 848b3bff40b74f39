"""Retention's sweep of what crashed, killed or finished runs left behind: unmarked folders (judged by the store's
file times and the grace period), a writer's hidden temp files, open multipart uploads no writer will finish,
deletes refused or stopped part way (marker first, shards last), and the names a sweep may never touch."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fsdp_hotload.retention import COMMIT_MARKER, CommitInfo, apply_retention, list_committed
from fsdp_hotload.storage import Storage, StorageError
from tests.s3_fixture import DeleteErrorsProxy, S3Server  # the s3_server fixture comes from tests/conftest.py
from tests.test_retention import _publish


def test_a_finished_runs_unmarked_folders_go_and_nothing_that_may_still_be_written(tmp_path: Path) -> None:
    """A run killed mid-upload leaves a folder without a marker that nothing ever reads. The next run's retention
    deletes it once every file is older than that run's start by the grace period; folders of its own session,
    of a live session, with a recent file, not laid out like a snapshot, or not named like one stay."""
    from fsdp_hotload.retention import INCOMPLETE_GRACE_S

    st = Storage(str(tmp_path))
    now = time.time()
    files = {"model-00001-of-00002.safetensors": {"size": 4}}
    _publish(st, CommitInfo("step-000003-11111111", "full", None, files, now + 5))  # ours
    _publish(st, CommitInfo("step-000004-22222222", "full", None, files, now + 6))  # a live publisher's
    old = now - INCOMPLETE_GRACE_S - 60
    # qwen3-8b: a model folder kept under the root, flat and as old, but not a name a publisher makes
    unmarked = {"step-000013-deadbeef": old, "step-000014-deadbeef": now - 30, "step-000009-11111111": old,
                "step-000009-22222222": old, "step-000020-cafecafe": old, "qwen3-8b": old}
    for identity, mtime in unmarked.items():
        name = "notes.txt" if identity.endswith("cafecafe") else "model-00002-of-00002.safetensors"
        (tmp_path / identity).mkdir()
        (tmp_path / identity / name).write_bytes(b"part")
        os.utime(tmp_path / identity / name, (mtime, mtime))
    half = tmp_path / "step-000015-deadbeef"  # one file old, one written just now: an upload still going on
    half.mkdir()
    for name, mtime in (("model-00001-of-00002.safetensors", old), ("model-00002-of-00002.safetensors", now)):
        (half / name).write_bytes(b"part")
        os.utime(half / name, (mtime, mtime))
    deleted = apply_retention(st, keep_last=5, session="11111111", since=now)
    assert deleted == ["step-000013-deadbeef"]
    assert set(st.list_dirs()) == {"step-000003-11111111", "step-000004-22222222", half.name,
                                   *unmarked} - set(deleted)


def test_a_trainer_clock_ahead_of_the_store_does_not_make_a_fresh_upload_look_abandoned(tmp_path: Path) -> None:
    """File times come from the store's clock, ``since`` from the trainer's. With the trainer 20 minutes ahead,
    another run's upload in progress (files written just now, store time) used to look older than the grace
    period and was deleted. The store's time of this session's newest commit bounds the test instead."""
    from fsdp_hotload.retention import INCOMPLETE_GRACE_S

    st = Storage(str(tmp_path))
    now = time.time()
    files = {"model-00001-of-00002.safetensors": {"size": 4}}
    _publish(st, CommitInfo("step-000003-11111111", "full", None, files, now + 1200))  # written now, store time
    old = now - INCOMPLETE_GRACE_S - 60
    for identity, mtime in {"step-000000-bbbbbbbb": now - 5, "step-000013-deadbeef": old}.items():
        (tmp_path / identity).mkdir()
        (tmp_path / identity / "model-00001-of-00002.safetensors").write_bytes(b"part")
        os.utime(tmp_path / identity / "model-00001-of-00002.safetensors", (mtime, mtime))
    deleted = apply_retention(st, keep_last=5, session="11111111", since=now + 1200)
    assert deleted == ["step-000013-deadbeef"]  # the abandoned one still goes; the upload in flight stays
    assert "step-000000-bbbbbbbb" in st.list_dirs()


def test_an_own_folder_whose_delete_failed_goes_at_the_next_pass(tmp_path: Path) -> None:
    """Retention removes a snapshot's marker, then its folder; when the folder's delete failed, the folder was no
    longer committed and, as this session's, was skipped like an upload in flight: it stayed for the whole run
    (the log said it would be retried). Own unmarked folders above the newest own commit are still left alone."""
    import fsspec
    import torch

    from fsdp_hotload import HotloadConfig
    from fsdp_hotload.publish import TensorPublisher

    class FailOneRm:
        def __init__(self, inner: object) -> None:
            self.inner, self.failed = inner, False

        def rm(self, path: str, *args: object, **kwargs: object) -> object:
            if not self.failed and not str(path).endswith("hotload.commit.json"):
                self.failed = True
                raise PermissionError(13, "injected: delete refused once", str(path))
            return self.inner.rm(path, *args, **kwargs)  # type: ignore[attr-defined]

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    bucket = tmp_path / "bucket"
    model = {"model.layers.0.w": torch.zeros(4096)}
    pub = TensorPublisher(model, HotloadConfig(bucket_url=str(bucket), keep_last=1, full_every=1),
                          storage=Storage(str(bucket), fs=FailOneRm(fsspec.filesystem("file"))))
    for step in range(4):
        model["model.layers.0.w"].add_(1)
        pub.publish(step, model)
        pub.wait()
    for ahead_step in (5, 9):  # as uploads in flight of this session look (the next step's too: max_inflight)
        ahead = bucket / f"step-00000{ahead_step}-{pub.engine.session}"
        ahead.mkdir()
        (ahead / "model-00001-of-00001.safetensors").write_bytes(b"part")
    model["model.layers.0.w"].add_(1)
    pub.publish(4, model)
    pub.close()
    assert sorted(p.name for p in bucket.iterdir()) == [f"step-00000{s}-{pub.engine.session}" for s in (4, 5, 9)]
    assert (bucket / f"step-000004-{pub.engine.session}" / "hotload.commit.json").exists()


def test_a_killed_writer_s_temp_files_alone_still_mark_a_finished_run_s_folder(tmp_path: Path) -> None:
    """A writer killed during its first uploads leaves only hidden temp files (hundreds of MB each) on a local
    root. Listings hide them, so the folder looked empty and was kept for ever; it now goes like any unmarked
    folder of a finished run, and a temp file of something that is not a shard does not count."""
    from fsdp_hotload.retention import INCOMPLETE_GRACE_S
    from fsdp_hotload.storage import TMP_PREFIX

    st = Storage(str(tmp_path))
    now = time.time()
    _publish(st, CommitInfo("step-000003-11111111", "full", None,
                            {"model-00001-of-00002.safetensors": {"size": 4}}, now + 5))
    old = now - INCOMPLETE_GRACE_S - 60
    temp = {"step-000007-deadbeef": f"{TMP_PREFIX}model-00001-of-00002.safetensors.0123456789ab",
            "step-000008-deadbeef": f"{TMP_PREFIX}notes.txt.0123456789ab"}
    for identity, name in temp.items():
        (tmp_path / identity).mkdir()
        (tmp_path / identity / name).write_bytes(b"part")
        os.utime(tmp_path / identity / name, (old, old))
    assert st.list("step-000007-deadbeef") == []  # still hidden from ordinary listings
    deleted = apply_retention(st, keep_last=5, session="11111111", since=now)
    assert deleted == ["step-000007-deadbeef"]
    assert set(st.list_dirs()) == {"step-000003-11111111", "step-000008-deadbeef"}


def test_a_refused_marker_delete_stops_retention_before_the_files_go(s3_server: S3Server) -> None:
    """Retention deletes a snapshot's marker before its files, so that no committed snapshot ever lacks them. A
    marker S3 refused to delete (HTTP 200 with a per-key AccessDenied) passed for deleted, and the files went."""
    uri = s3_server.unique_uri("refused-marker")
    direct = Storage(uri, s3_server.storage_options)
    files = {"model-00000.safetensors": {"size": 3}}
    for info in (CommitInfo("A", "full", None, files, 1.0), CommitInfo("B", "delta", "A", files, 2.0),
                 CommitInfo("C", "full", None, files, 3.0)):
        _publish(direct, info)
    # Only a delete of markers alone is refused: were the files deleted first (with their marker in the same
    # request), that request would go through and the snapshot would be gone.
    refuse_markers = lambda body: COMMIT_MARKER.encode() in body and b".safetensors" not in body  # noqa: E731
    with DeleteErrorsProxy(s3_server.endpoint_url, "AccessDenied", refuse_markers) as proxy:
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url})
        with pytest.raises(StorageError, match="AccessDenied"):
            apply_retention(st, keep_last=1)
        assert proxy.answered == 1
    for info in list_committed(direct):  # every snapshot that is still committed still has its files
        assert {rel: direct.size(f"{info.identity}/{rel}") for rel in info.files} == {
            rel: meta["size"] for rel, meta in info.files.items()}
    assert [c.identity for c in list_committed(direct)] == ["A", "B", "C"]


def test_a_crashed_writer_s_open_multipart_uploads_are_aborted(s3_server: S3Server,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer killed mid-upload leaves its multipart uploads open: no listing shows them, yet S3 keeps (and
    bills) their parts for good, and retention, which deletes what a crash left, never saw them. It now aborts
    those no writer will finish, and no other."""
    uri = s3_server.unique_uri("uploads")
    st = Storage(uri, s3_server.storage_options)
    client, bucket = s3_server.client(), s3_server.bucket
    prefix = uri.split(f"s3://{bucket}/", 1)[1]
    shard = "model-00001-of-00002.safetensors"
    files = {shard: {"size": 3}}
    own, finished, other = "a1b2c3d4", "0badc0de", "feedface"
    now = time.time()
    _publish(st, CommitInfo(f"step-000004-{own}", "full", None, files, now))
    _publish(st, CommitInfo(f"step-000001-{finished}", "full", None, files, now - 7 * 3600))
    _publish(st, CommitInfo(f"step-000002-{other}", "full", None, files, now))
    names = [f"step-000003-{own}/{shard}",       # this run's failed snapshot, below its newest commit
             f"step-000004-{own}/{shard}",       # a timed-out attempt under this run's committed snapshot
             f"step-000008-{own}/{shard}",       # this run's next snapshot, uploading now
             f"step-000003-{other}/{shard}",     # a live run's upload
             f"step-000009-{finished}/{shard}",  # the finished run's crash
             f"step-000009-{finished}/notes/{shard}", "qwen3-8b/model.safetensors"]  # not a publisher's
    for name in names:
        client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{name}")

    def open_uploads() -> list[str]:
        listing = client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/")
        return sorted(u["Key"][len(prefix) + 1:] for u in listing.get("Uploads", []))

    assert apply_retention(st, keep_last=3, session=own, since=now) == []
    # moto dates every upload years back, so the finished run's counts as abandoned; the live run's, as old,
    # and this run's in flight stay.
    assert open_uploads() == sorted(names[2:4] + names[5:])
    # An upload of a run that is not live but began less than ABANDONED_UPLOAD_AGE_S ago (moto's dates made
    # recent by a longer age) may be a run uploading its first snapshot: it stays.
    late = f"step-000010-{finished}/{shard}"
    client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{late}")
    monkeypatch.setattr("fsdp_hotload.retention.ABANDONED_UPLOAD_AGE_S", 1e11)
    apply_retention(st, keep_last=3, session=own, since=now)
    assert late in open_uploads()


def _age_objects(bucket: str, prefix: str, seconds: float) -> int:
    """Move the store's time of every object under ``prefix`` back (moto's server runs in this process)."""
    import datetime

    from moto.s3.models import s3_backends

    aged = 0
    for regions in s3_backends.values():
        for backend in regions.values():
            found = backend.buckets.get(bucket)
            for name, key in list(found.keys.items()) if found is not None else ():
                if name.startswith(prefix):
                    key.last_modified -= datetime.timedelta(seconds=seconds)
                    aged += 1
    return aged


def test_a_folder_with_a_live_multipart_upload_is_not_taken_for_abandoned(s3_server: S3Server,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trainers under one root: A's first full snapshot is uploading, its last shard an open multipart upload
    (no listing shows it) and the others finished 20 minutes ago. B's retention took A's folder for one a crash
    left (every file it saw was old) and deleted it: A's commit then failed, or, interleaved with it, committed
    a folder whose files were gone. A folder with an open upload now stays, and so does every unmarked folder of
    another run where the uploads cannot be listed; once A's upload is gone (A was killed), the folder goes."""
    monkeypatch.setattr("fsdp_hotload.retention.ABANDONED_UPLOAD_AGE_S", 1e11)  # moto dates every upload 2010
    uri = s3_server.unique_uri("live-upload")
    st = Storage(uri, s3_server.storage_options)
    client, bucket = s3_server.client(), s3_server.bucket
    prefix = uri.split(f"s3://{bucket}/", 1)[1]
    a_id, b_id = "step-000000-aaaaaaaa", "step-000100-bbbbbbbb"
    shard = "model-{:05d}-of-00004.safetensors".format
    st.put_many({f"{a_id}/{shard(i)}": b"x" * 100 for i in (1, 2, 3)})
    assert _age_objects(bucket, f"{prefix}/{a_id}/", 20 * 60) == 3
    key = f"{prefix}/{a_id}/{shard(4)}"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    _publish(st, CommitInfo(b_id, "full", None, {shard(1): {"size": 10}}))
    assert apply_retention(st, 3, session="bbbbbbbb", since=time.time() - 300) == []
    assert sorted(st.list_info(a_id)) == [f"{a_id}/{shard(i)}" for i in (1, 2, 3)]
    with DeleteErrorsProxy(s3_server.endpoint_url, "AccessDenied", lambda body: False, deny_uploads=True) as proxy:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
        unlisted = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url})
        assert apply_retention(unlisted, 3, session="bbbbbbbb", since=time.time() - 300) == []
    assert apply_retention(st, 3, session="bbbbbbbb", since=time.time() - 300) == [a_id]  # the sweep still works
    assert st.list_info(a_id) == {}


def test_retention_goes_on_where_open_uploads_cannot_be_listed(s3_server: S3Server,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Listing multipart uploads is a permission of its own (s3:ListBucketMultipartUploads), often not granted:
    retention then deletes as before and says once why no upload is aborted."""
    uri = s3_server.unique_uri("no-uploads-listing")
    files = {"model-00000.safetensors": {"size": 3}}
    with DeleteErrorsProxy(s3_server.endpoint_url, "AccessDenied", lambda body: False, deny_uploads=True) as proxy:
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url})
        for i in range(3):
            _publish(st, CommitInfo(f"step-00000{i}-a1b2c3d4", "full", None, files, time.time() + i))
        with caplog.at_level("WARNING", logger="fsdp_hotload.retention"):
            for _ in range(2):
                apply_retention(st, keep_last=1, session="a1b2c3d4", since=time.time())
        assert [c.identity for c in list_committed(st)] == ["step-000002-a1b2c3d4"]
    assert sum("cannot list the open multipart uploads" in r.getMessage() for r in caplog.records) == 1


def test_a_foreign_folder_with_a_name_no_publisher_makes_is_never_listed(tmp_path: Path) -> None:
    """The unmarked-folder sweep listed every folder (recursively: one LIST per 1,000 keys on S3) before
    testing its name, on every publish."""
    listed: list[str] = []

    class Counting(Storage):
        def list_info(self, prefix: str, *args: object, **kwargs: object) -> dict:  # type: ignore[override]
            listed.append(prefix)
            return super().list_info(prefix, *args, **kwargs)  # type: ignore[arg-type]

    st = Counting(str(tmp_path))
    now = time.time()
    _publish(st, CommitInfo("step-000003-11111111", "full", None, {"model-00001-of-00001.safetensors":
                                                                     {"size": 4}}, now))
    (tmp_path / "checkpoints").mkdir()
    for k in range(5):
        (tmp_path / "checkpoints" / f"model-0000{k}-of-00005.safetensors").write_bytes(b"x")
    assert apply_retention(st, keep_last=1, session="11111111", since=now) == []
    assert "checkpoints" not in listed and (tmp_path / "checkpoints").is_dir()


@pytest.mark.parametrize("session", ["ABCDEF12", "run1", "abcdef123"])
def test_a_session_retention_would_not_recognise_is_refused(tmp_path: Path, session: str) -> None:
    """Retention sweeps a run's failed leftovers (and aborts its open uploads) only under names with an 8-hex
    session: any other session published, and its leftovers stayed for good."""
    import torch

    from fsdp_hotload.arc.boxes import Box
    from fsdp_hotload.config import HotloadConfig
    from fsdp_hotload.engine.publisher import Publisher
    from fsdp_hotload.layout import TensorSpec
    from fsdp_hotload.publish import WholeChunk

    t = torch.zeros(8)
    with pytest.raises(ValueError, match="8 lowercase hex digits"):
        Publisher([WholeChunk("a", (8,), "BF16", "flat", Box.flat(0, 8), t)], [TensorSpec("a", (8,), "BF16")],
                  HotloadConfig(bucket_url=str(tmp_path / "bucket")), session=session)


def test_a_run_killed_while_writing_its_chat_templates_leaves_nothing_for_good(tmp_path: Path) -> None:
    """The small files go up before the marker, chat templates in ``additional_chat_templates/``: a folder left
    with those counted as "not flat, not a snapshot" and no later run ever swept it. Other sub-folders still
    mean a folder that is not a publisher's."""
    from fsdp_hotload.retention import INCOMPLETE_GRACE_S

    st = Storage(str(tmp_path))
    now = time.time()
    _publish(st, CommitInfo("step-000003-11111111", "full", None, {"model-00001-of-00001.safetensors":
                                                                     {"size": 4}}, now))
    old = now - INCOMPLETE_GRACE_S - 60
    layouts = {"step-000001-deadbeef": "additional_chat_templates/tool_use.jinja",
               "step-000002-deadbeef": "checkpoints/tool_use.jinja",
               "step-000004-deadbeef": "additional_chat_templates/deeper/tool_use.jinja"}
    for identity, extra in layouts.items():
        for rel in ("model-00001-of-00001.safetensors", extra):
            (tmp_path / identity / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / identity / rel).write_bytes(b"part")
            os.utime(tmp_path / identity / rel, (old, old))
    assert apply_retention(st, keep_last=1, session="11111111", since=now) == ["step-000001-deadbeef"]
    assert sorted(st.list_dirs()) == ["step-000002-deadbeef", "step-000003-11111111", "step-000004-deadbeef"]


def test_a_quick_restart_lets_the_crashed_runs_unmarked_folder_go_with_its_snapshots(tmp_path: Path) -> None:
    """A run that crashed a minute before the restart left a folder without a marker. It was judged against the
    restarted run's start, so it stayed for that run's whole life, while the crashed run's committed snapshots went
    once it was no longer live. A run that committed here and is not live is judged at the store's time now."""
    from fsdp_hotload.retention import INCOMPLETE_GRACE_S

    st = Storage(str(tmp_path))
    now = time.time()
    since = now - 2 * 86400  # this run started two days ago, a minute after the other one crashed
    shard = "model-00001-of-00001.safetensors"
    _publish(st, CommitInfo("step-000010-bbbbbbbb", "full", None, {shard: {"size": 4}}, since - 120))
    _publish(st, CommitInfo("step-000500-aaaaaaaa", "full", None, {shard: {"size": 4}}, now))
    for identity, mtime in {"step-000011-bbbbbbbb": since - 60,  # the crashed run's last upload
                            "step-000012-cafecafe": since - 60,  # a run that never committed: judged as before
                            "step-000013-bbbbbbbb": now - INCOMPLETE_GRACE_S + 60}.items():  # written just now
        (tmp_path / identity).mkdir()
        (tmp_path / identity / shard).write_bytes(b"part")
        os.utime(tmp_path / identity / shard, (mtime, mtime))
    deleted = apply_retention(st, keep_last=1, session="aaaaaaaa", since=since, now=now)
    assert deleted == ["step-000010-bbbbbbbb", "step-000011-bbbbbbbb"]
    assert sorted(st.list_dirs()) == ["step-000012-cafecafe", "step-000013-bbbbbbbb", "step-000500-aaaaaaaa"]


def test_what_a_delete_stopped_part_way_left_of_a_finished_runs_snapshot_goes(tmp_path: Path) -> None:
    """A snapshot's delete that stopped after its shards went left config.json and tokenizer.json: without a shard
    file a finished run's folder never looked like a snapshot, and stayed for good. Of a run that committed here,
    files a snapshot holds are enough; a folder with anything else, or of a run that never did, stays."""
    st = Storage(str(tmp_path))
    now = time.time()
    since = now - 86400
    shard = "model-00001-of-00001.safetensors"
    _publish(st, CommitInfo("step-000010-bbbbbbbb", "full", None, {shard: {"size": 4}}, since - 7200))
    _publish(st, CommitInfo("step-000500-aaaaaaaa", "full", None, {shard: {"size": 4}}, now))
    left = {"step-000011-bbbbbbbb": ["config.json", "tokenizer.json", "model.safetensors.index.json",
                                     "additional_chat_templates/tool_use.jinja"],
            "step-000012-bbbbbbbb": ["config.json", "notes.txt"],
            "step-000013-cafecafe": ["config.json", "tokenizer.json"]}
    for identity, names in left.items():
        for name in names:
            path = tmp_path / identity / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"{}")
            os.utime(path, (since - 7200, since - 7200))
    deleted = apply_retention(st, keep_last=5, session="aaaaaaaa", since=since, now=now)
    assert deleted == ["step-000011-bbbbbbbb"]
    assert sorted(st.list_dirs()) == ["step-000010-bbbbbbbb", "step-000012-bbbbbbbb", "step-000013-cafecafe",
                                      "step-000500-aaaaaaaa"]


def test_a_snapshot_s_shards_go_last_so_what_a_stopped_delete_leaves_is_swept(s3_server: S3Server,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot's delete that stopped after its shards went left config.json and the tokenizer: once its run had
    no commit left, nothing marked that folder as a publisher's, and it stayed for good. The shards now go last, in
    requests of their own, so a delete that stops leaves one, and a later pass sweeps the folder."""
    from fsdp_hotload import retention

    monkeypatch.setattr(retention, "INCOMPLETE_GRACE_S", 0.0)  # S3 file times are the upload's: no waiting 600 s
    uri = s3_server.unique_uri("shards-last")
    direct = Storage(uri, s3_server.storage_options)
    shard, small = "model-00001-of-00001.safetensors", ["config.json", "tokenizer.json", "model.safetensors.index.json"]
    files = {n: {"size": 3} for n in [shard, *small]}
    now = time.time()
    # A finished run's only snapshot, then this run's.
    _publish(direct, CommitInfo("step-000010-bbbbbbbb", "full", None, files, now - 3 * 86400))
    time.sleep(1.1)  # S3 file times have whole seconds
    _publish(direct, CommitInfo("step-000500-aaaaaaaa", "full", None, files, now))
    bodies: list[bytes] = []

    def refuse_shards(body: bytes) -> bool:
        bodies.append(body)
        return shard.encode() in body

    with DeleteErrorsProxy(s3_server.endpoint_url, "AccessDenied", refuse_shards) as proxy:
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url})
        with pytest.raises(StorageError, match="AccessDenied"):
            apply_retention(st, keep_last=1, session="aaaaaaaa", since=now - 86400, now=now)
    # The marker, then every other file, then the shards: no request names a shard beside another file.
    assert [COMMIT_MARKER.encode() in b for b in bodies] == [True, False, False]
    assert all(name.encode() in bodies[1] for name in small) and shard.encode() not in bodies[1]
    assert direct.list("step-000010-bbbbbbbb") == [f"step-000010-bbbbbbbb/{shard}"]
    assert [c.identity for c in list_committed(direct)] == ["step-000500-aaaaaaaa"]  # that run has no commit left
    deleted = apply_retention(direct, keep_last=1, session="aaaaaaaa", since=time.time(), now=time.time())
    assert deleted == ["step-000010-bbbbbbbb"]
    assert direct.list_dirs() == ["step-000500-aaaaaaaa"]


def test_a_per_key_slowdown_in_a_delete_counts_as_throttled(s3_server) -> None:  # type: ignore[no-untyped-def]
    """S3 answers DeleteObjects with HTTP 200 and a SlowDown per key: botocore's hook never sees it as a throttle,
    yet the retry after it is Storage's own; README: ``throttled`` counts every SlowDown answer, retention's too."""
    uri = s3_server.unique_uri("slowdown-delete")
    direct = Storage(uri, s3_server.storage_options)
    direct.put_bytes("step-000001-aaaaaaaa/model-00001-of-00001.safetensors", b"abc")
    left = [1]

    def once(body: bytes) -> bool:
        left[0] -= 1
        return left[0] >= 0

    with DeleteErrorsProxy(s3_server.endpoint_url, "SlowDown", once) as proxy:
        st = Storage(uri, {**s3_server.storage_options, "endpoint_url": proxy.url}, sleep=lambda s: None)
        st.delete_prefix("step-000001-aaaaaaaa")
        assert proxy.answered == 1
    assert direct.list("step-000001-aaaaaaaa") == []
    assert st.stats.retries == 1 and st.stats.throttled == 1, st.stats.snapshot()


def test_only_uploads_under_names_a_publisher_makes_are_aborted(s3_server) -> None:  # type: ignore[no-untyped-def]
    """PUBLISHED_NAME alone (``.+-<step>-<session>``) also matches names no publisher can make: a foreign tool's
    upload under ``my run-000001-deadbeef`` was aborted, and one under a name with a backslash failed every pass."""
    uri = s3_server.unique_uri("foreign-uploads")
    st = Storage(uri, s3_server.storage_options)
    client, bucket = s3_server.client(), s3_server.bucket
    prefix = uri.split(f"s3://{bucket}/", 1)[1]
    shard = "model-00001-of-00001.safetensors"
    for step in (1, 2):
        _publish(st, CommitInfo(f"step-00000{step}-aaaaaaaa", "full", None, {shard: {"size": 3}}, time.time() + step))
    foreign = [f"my run-000001-deadbeef/{shard}", f"tool\\x-000001-deadbeef/{shard}"]
    for key in foreign:
        client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/{key}")
    assert apply_retention(st, keep_last=1, session="aaaaaaaa", since=time.time()) == ["step-000001-aaaaaaaa"]
    left = client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/").get("Uploads", [])
    assert sorted(u["Key"][len(prefix) + 1:] for u in left) == sorted(foreign)
