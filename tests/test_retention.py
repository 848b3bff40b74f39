"""Commit markers and retention: markers round-trip on real backends (local, memory://, moto S3), malformed
markers are reported with their URI, and retention keeps every chain a kept or served snapshot needs (also with
live publishers beside it, a marker read as missing once, and markers cached between passes). The sweep of what
crashed or finished runs left is in test_retention_sweep.py."""
from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.retention import (
    COMMIT_MARKER,
    CommitInfo,
    CommitMarkerError,
    apply_retention,
    list_committed,
    plan_retention,
    read_commit_marker,
    write_commit_marker,
)
from fsdp_hotload.storage import Storage
from tests.s3_fixture import S3Server  # the s3_server fixture comes from tests/conftest.py


@pytest.fixture
def make_storage(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[str], Storage]:
    def make(kind: str) -> Storage:
        if kind == "local":
            return Storage(str(tmp_path / f"root-{uuid.uuid4().hex[:6]}"))
        if kind == "memory":
            return Storage(f"memory://hotload-tests/{uuid.uuid4().hex}")
        server: S3Server = request.getfixturevalue("s3_server")
        return Storage(server.unique_uri("commit"), server.storage_options)

    return make


# ------------------------------------------------------------------------------------------------------------
# Commit markers
# ------------------------------------------------------------------------------------------------------------


def _publish(st: Storage, info: CommitInfo) -> CommitInfo:
    """Upload the files a CommitInfo names (random bytes of the stated sizes), then its marker."""
    st.put_many({f"{info.identity}/{rel}": os.urandom(meta["size"]) for rel, meta in info.files.items()})
    write_commit_marker(st, info)
    return info


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_commit_marker_round_trip(kind: str, make_storage: Callable[..., Storage]) -> None:
    st = make_storage(kind)
    full = _publish(st, CommitInfo("step-4-aa", "full", None, {"model-00000.safetensors": {"size": 10},
                                                              "config.json": {"size": 2}}, created_at=100.0))
    delta = _publish(st, CommitInfo("step-8-aa", "delta", "step-4-aa", {"model-00000.safetensors": {"size": 3}},
                                    created_at=200.0))
    st.put_bytes("step-12-aa/model-00000.safetensors", b"in flight")  # no marker: incomplete
    assert read_commit_marker(st, "step-4-aa") == full
    assert read_commit_marker(st, "step-8-aa") == delta
    assert read_commit_marker(st, "step-12-aa") is None
    assert [c.identity for c in list_committed(st)] == ["step-4-aa", "step-8-aa"]
    raw = json.loads(st.get_bytes(f"step-8-aa/{COMMIT_MARKER}"))
    assert raw == {"format": "hotload-commit", "version": 1, "identity": "step-8-aa", "kind": "delta",
                   "parent_identity": "step-4-aa", "files": {"model-00000.safetensors": {"size": 3}},
                   "created_at": 200.0}


def test_list_committed_sorts_by_created_at(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    for name, t in [("b", 3.0), ("a", 2.0), ("c", 1.0)]:
        write_commit_marker(st, CommitInfo(name, "full", created_at=t))
    assert [c.identity for c in list_committed(st)] == ["c", "a", "b"]


def test_commit_marker_verifies_files(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    st.put_bytes("s1/model-00000.safetensors", b"12345")
    with pytest.raises(CommitMarkerError, match="model-00001.safetensors.*missing"):
        write_commit_marker(st, CommitInfo("s1", "full", files={"model-00000.safetensors": {"size": 5},
                                                                "model-00001.safetensors": {"size": 1}}))
    with pytest.raises(CommitMarkerError, match="5 bytes"):
        write_commit_marker(st, CommitInfo("s1", "full", files={"model-00000.safetensors": {"size": 6}}))
    assert read_commit_marker(st, "s1") is None


@pytest.mark.parametrize("content,match", [
    (b"{not json", "not valid JSON"),
    (b"[]", "expected a JSON object"),
    (json.dumps({"format": "other", "version": 1}).encode(), "format"),
    (json.dumps({"format": "hotload-commit", "version": 99, "identity": "s1", "kind": "full", "files": {},
                 "created_at": 1.0}).encode(), "newer"),
    (json.dumps({"format": "hotload-commit", "version": 1, "identity": "s1", "kind": "delta",
                 "parent_identity": None, "files": {}, "created_at": 1.0}).encode(), "parent_identity"),
    (json.dumps({"format": "hotload-commit", "version": 1, "identity": "s1", "kind": "full",
                 "files": {"a": {"size": -1}}, "created_at": 1.0}).encode(), "size"),
    (json.dumps({"format": "hotload-commit", "version": 1, "identity": "other", "kind": "full", "files": {},
                 "created_at": 1.0}).encode(), "directory"),
])
def test_malformed_marker_names_its_uri(tmp_path: Path, content: bytes, match: str) -> None:
    st = Storage(str(tmp_path))
    st.put_bytes(f"s1/{COMMIT_MARKER}", content)
    with pytest.raises(CommitMarkerError, match=match) as info:
        read_commit_marker(st, "s1")
    assert st.uri(f"s1/{COMMIT_MARKER}") in str(info.value)
    with pytest.raises(CommitMarkerError):
        list_committed(st)
    assert list_committed(st, strict=False) == []


def test_commit_info_validation() -> None:
    with pytest.raises(ValueError, match="single path segment"):
        CommitInfo("a/b", "full")
    with pytest.raises(ValueError, match="kind"):
        CommitInfo("a", "partial")
    with pytest.raises(ValueError, match="full snapshot has no parent"):
        CommitInfo("a", "full", parent_identity="b")
    with pytest.raises(ValueError, match="own parent"):
        CommitInfo("a", "delta", parent_identity="a")


# ------------------------------------------------------------------------------------------------------------
# Retention
# ------------------------------------------------------------------------------------------------------------


def _snap(identity: str, t: float, parent: str | None = None) -> CommitInfo:
    return CommitInfo(identity, "delta" if parent else "full", parent, {}, created_at=t)


# Two chains: A <- B <- C, then D <- E <- F, then a lone full G.
CHAINS = [_snap("A", 1), _snap("B", 2, "A"), _snap("C", 3, "B"), _snap("D", 4), _snap("E", 5, "D"),
          _snap("F", 6, "E"), _snap("G", 7)]


def test_plan_retention_keeps_last_and_their_chains() -> None:
    assert plan_retention(CHAINS, keep_last=1, protected=set()) == ["A", "B", "C", "D", "E", "F"]
    # F is among the last two: its whole chain back to D stays.
    assert plan_retention(CHAINS, keep_last=2, protected=set()) == ["A", "B", "C"]
    assert plan_retention(CHAINS[:6], keep_last=1, protected=set()) == ["A", "B", "C"]
    assert plan_retention(CHAINS, keep_last=100, protected=set()) == []
    assert plan_retention(list(reversed(CHAINS)), keep_last=1, protected=set()) == ["A", "B", "C", "D", "E", "F"]


def test_plan_retention_protects_served_snapshots_and_ancestors() -> None:
    assert plan_retention(CHAINS, keep_last=1, protected={"B"}) == ["C", "D", "E", "F"]
    assert plan_retention(CHAINS, keep_last=1, protected={"B", "unknown"}) == ["C", "D", "E", "F"]


def test_plan_retention_tolerates_gaps_and_cycles() -> None:
    broken = [_snap("X", 1, "gone"), _snap("Y", 2, "X"), _snap("Z", 3)]
    assert plan_retention(broken, keep_last=2, protected=set()) == []
    cyc = [_snap("P", 1, "Q"), _snap("Q", 2, "P"), _snap("R", 3)]
    assert plan_retention(cyc, keep_last=1, protected=set()) == ["P", "Q"]
    assert plan_retention(cyc, keep_last=2, protected=set()) == []
    with pytest.raises(ValueError, match="keep_last"):
        plan_retention(CHAINS, keep_last=0, protected=set())
    with pytest.raises(ValueError, match="twice"):
        plan_retention([_snap("A", 1), _snap("A", 2)], keep_last=1, protected=set())


@st.composite
def _histories(draw: st.DrawFn) -> list[CommitInfo]:
    n = draw(st.integers(1, 12))
    snaps: list[CommitInfo] = []
    for i in range(n):
        parent = None
        if snaps and draw(st.booleans()):
            parent = snaps[draw(st.integers(0, len(snaps) - 1))].identity
        snaps.append(_snap(f"s{i:02d}", float(i), parent))
    return snaps


@settings(max_examples=150, deadline=None)
@given(_histories(), st.integers(1, 5), st.sets(st.integers(0, 11), max_size=3))
def test_plan_retention_property(snaps: list[CommitInfo], keep_last: int, prot_idx: set[int]) -> None:
    protected = {f"s{i:02d}" for i in prot_idx}
    doomed = set(plan_retention(snaps, keep_last, protected))
    by_id = {s.identity: s for s in snaps}
    needed: set[str] = set()
    for root in [s.identity for s in snaps[-keep_last:]] + [p for p in protected if p in by_id]:
        node: str | None = root
        while node is not None:
            needed.add(node)
            node = by_id[node].parent_identity
    assert doomed == set(by_id) - needed  # deletes exactly what no kept chain needs


def test_apply_retention_on_local_storage(tmp_path: Path) -> None:
    st = Storage(str(tmp_path))
    now = time.time()
    files = {"model-00000.safetensors": {"size": 4}}
    for s in [CommitInfo("A", "full", None, files, now - 50), CommitInfo("B", "delta", "A", files, now - 40),
              CommitInfo("C", "full", None, files, now - 30), CommitInfo("D", "delta", "C", files, now - 20)]:
        _publish(st, s)
    shard = "model-00001-of-00002.safetensors"
    st.put_bytes(f"stale/{shard}", b"half")   # abandoned long ago
    os.utime(tmp_path / "stale" / shard, (now - 1000, now - 1000))
    st.put_bytes(f"inflight/{shard}", b"half")  # being written right now
    # Old, markerless, named like identities, but not laid out like a snapshot: never deleted.
    for path in ("notes/readme.txt", "base-model/model.safetensors", f"nested/sub/{shard}"):
        st.put_bytes(path, b"user data")
        os.utime(tmp_path / path, (now - 1000, now - 1000))

    assert apply_retention(st, keep_last=1, protected={"B"}) == []  # B is served: B and A stay; D needs C
    assert apply_retention(st, keep_last=1) == ["B", "A"]  # children first
    user_dirs = ["base-model", "nested", "notes"]
    assert st.list_dirs() == sorted(["C", "D", "inflight", "stale", *user_dirs])
    assert [c.identity for c in list_committed(st)] == ["C", "D"]

    assert apply_retention(st, keep_last=1, delete_incomplete=True) == ["stale"]
    assert st.list_dirs() == sorted(["C", "D", "inflight", *user_dirs])
    assert st.get_bytes("base-model/model.safetensors") == b"user data"


def test_apply_retention_on_s3(s3_server: S3Server) -> None:
    st = Storage(s3_server.unique_uri("retention"), s3_server.storage_options)
    files = {"model-00000.safetensors": {"size": 3}}
    _publish(st, CommitInfo("A", "full", None, files, 1.0))
    _publish(st, CommitInfo("B", "delta", "A", files, 2.0))
    _publish(st, CommitInfo("C", "full", None, files, 3.0))
    assert apply_retention(st, keep_last=1) == ["B", "A"]
    assert st.list_dirs() == ["C"] and st.list("A") == [] and st.list("B") == []


def test_foreign_directories_under_the_root_are_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    st = Storage(str(tmp_path))
    files = {"model-00000.safetensors": {"size": 4}}
    for s in [CommitInfo("A", "full", None, files, 10.0), CommitInfo("B", "delta", "A", files, 20.0),
              CommitInfo("C", "full", None, files, 30.0)]:
        _publish(st, s)
    foreign = ["my logs", ".trash", "date=2024", "x" * 129]
    old = time.time() - 10_000
    for name in foreign:
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.txt").write_text("not a snapshot")
        os.utime(tmp_path / name / "data.txt", (old, old))
    assert set(foreign) <= set(st.list_dirs())

    caplog.set_level("INFO", logger="fsdp_hotload.retention")
    for strict in (True, False):
        assert [c.identity for c in list_committed(st, strict=strict)] == ["A", "B", "C"]
    assert apply_retention(st, keep_last=1, delete_incomplete=True) == ["B", "A"]
    assert [c.identity for c in list_committed(st)] == ["C"]
    assert sorted(st.list_dirs()) == sorted(["C", *foreign])
    for name in foreign:
        assert (tmp_path / name / "data.txt").read_text() == "not a snapshot"
    ignored = [r.getMessage() for r in caplog.records if "not a snapshot identity" in r.getMessage()]
    assert len(ignored) == len(foreign)  # once per directory, not once per pass


def test_a_session_that_committed_shortly_before_this_start_is_live() -> None:
    """Trainer B committed the snapshot its deployment serves 5 s before A started, and nothing since: it is
    live for A (its served snapshot and chain are kept), as is a B whose clock runs minutes behind. A session
    silent for longer than LIVE_GRACE_S is a finished run."""
    from fsdp_hotload.retention import LIVE_GRACE_S, live_sessions

    now = time.time()
    snaps = [CommitInfo("step-000010-bbbbbbbb", "full", None, {}, now - 65),
             CommitInfo("step-000011-bbbbbbbb", "delta", "step-000010-bbbbbbbb", {}, now - 5),
             CommitInfo("step-000001-cccccccc", "full", None, {}, now - 300),
             CommitInfo("step-000001-dddddddd", "full", None, {}, now - LIVE_GRACE_S - 60),
             CommitInfo("step-000001-aaaaaaaa", "full", None, {}, now + 1)]
    assert live_sessions(snaps, "aaaaaaaa", now) == {
        "bbbbbbbb": ["step-000010-bbbbbbbb", "step-000011-bbbbbbbb"], "cccccccc": ["step-000001-cccccccc"]}
    assert plan_retention(snaps, 1, {"step-000010-bbbbbbbb", "step-000011-bbbbbbbb", "step-000001-cccccccc"}) == [
        "step-000001-dddddddd"]


def test_retention_keeps_a_live_publishers_snapshots_and_deletes_a_finished_runs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Three publishers on one bucket, each with its own deployment and ``keep_last=2``. An earlier run's
    snapshots (finished before the others started; no grace here, so that it counts as finished at once) go;
    two live trainers keep each other's chains, so what every deployment serves can still be rebuilt from the
    bucket, bit for bit, and the warning names the other session once."""
    from fsdp_hotload.emulator import HotLoadEmulator
    from fsdp_hotload.publish import TensorPublisher
    from fsdp_hotload.retention import list_committed, session_of
    from tests.snapshots import rebuild_accepted
    from tests.publisher_helpers import API_KEY, config, expected_sha, make_model, train_step

    bucket = str(tmp_path / "bucket")
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        def publisher(model: dict, deployment: str) -> TensorPublisher:
            return TensorPublisher(model, config(bucket, emu, tmp_path, deployment_id=deployment, keep_last=2,
                                                 busy_policy="wait", retention_grace_s=0.001))

        old_model = make_model(seed=3)
        with publisher(old_model, "dep-old") as old:
            for step in range(3):
                train_step(old_model, step)
                old.publish(step, old_model)
        ma, mb = make_model(seed=1), make_model(seed=2)
        a, b = publisher(ma, "dep-a"), publisher(mb, "dep-b")
        with caplog.at_level("WARNING", logger="fsdp_hotload"):
            for step in range(6):
                for pub, model in ((a, ma), (b, mb)):
                    if pub is b and step % 3:
                        continue
                    train_step(model, step)
                    pub.publish(step, model)
                    pub.wait()
            a.close()
            b.close()
        sessions = {session_of(c.identity) for c in list_committed(Storage(bucket))}
        assert session_of(old.metrics[-1].identity) not in sessions  # the finished run's snapshots went
        state = emu.state()["deployments"]
        for pub, model, dep in ((a, ma, "dep-a"), (b, mb, "dep-b")):
            assert all(m.ok for m in pub.metrics)
            (rep,) = state[f"accounts/{config(bucket, emu, tmp_path).account_id}/deployments/{dep}"]["replicas"]
            assert rep["identity"] == pub.metrics[-1].identity
            rebuilt = rebuild_accepted(bucket, pub.metrics)[pub.metrics[-1].identity]  # chain still in the bucket
            assert {k: t.digest() for k, t in rebuilt.items()} == expected_sha(model)
    warnings = [r.getMessage() for r in caplog.records if "another publisher" in r.getMessage()]
    assert len(warnings) == 2, warnings  # each live trainer names the other once


def test_a_run_restarted_into_the_same_bucket_lets_the_crashed_runs_snapshots_go_after_the_grace(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Liveness is judged at each pass, not at this publisher's start: a crashed run that committed 50 minutes
    before the restart kept every snapshot (fulls included) for the restarted run's whole life, and each restart
    warned that "another publisher" shared the bucket. It is kept for the rest of its hour, said at INFO."""
    from fsdp_hotload.retention import LIVE_GRACE_S

    st = Storage(str(tmp_path))
    start = time.time()
    files = {"model-00001-of-00001.safetensors": {"size": 4}}
    crashed = start - LIVE_GRACE_S + 600  # committed 50 minutes before the restart
    _publish(st, CommitInfo("step-000010-bbbbbbbb", "full", None, files, crashed - 60))
    _publish(st, CommitInfo("step-000011-bbbbbbbb", "delta", "step-000010-bbbbbbbb", files, crashed))
    _publish(st, CommitInfo("step-000000-aaaaaaaa", "full", None, files, start + 5))
    with caplog.at_level("INFO", logger="fsdp_hotload"):
        assert apply_retention(st, keep_last=1, session="aaaaaaaa", since=start, now=start + 10) == []
    assert "keeping the snapshots of session bbbbbbbb" in caplog.text and "another publisher" not in caplog.text
    _publish(st, CommitInfo("step-000001-aaaaaaaa", "delta", "step-000000-aaaaaaaa", files, start + 700))
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        deleted = apply_retention(st, keep_last=1, session="aaaaaaaa", since=start, now=start + 700)
    assert deleted == ["step-000011-bbbbbbbb", "step-000010-bbbbbbbb"]
    # a trainer still running that commits less often than the grace looks the same: said, naming the run
    assert ("retention deleted 2 snapshot(s) of session bbbbbbbb (e.g. step-000011-bbbbbbbb), a run taken for "
            "finished: its newest commit is 3700 s old, more than retention_grace_s=3600") in caplog.text
    assert sorted(st.list_dirs()) == ["step-000000-aaaaaaaa", "step-000001-aaaaaaaa"]


def test_retention_grace_s_keeps_a_run_paused_for_longer(tmp_path: Path) -> None:
    """A run paused for two hours, whose deployment still serves its newest snapshot, lost its chain to another
    run's keep_last after the fixed hour; retention_grace_s (config) sets how long such a run counts as live."""
    st = Storage(str(tmp_path))
    start = time.time()
    files = {"model-00001-of-00001.safetensors": {"size": 4}}
    paused = start - 2 * 3600
    _publish(st, CommitInfo("step-000010-bbbbbbbb", "full", None, files, paused - 60))
    _publish(st, CommitInfo("step-000011-bbbbbbbb", "delta", "step-000010-bbbbbbbb", files, paused))
    _publish(st, CommitInfo("step-000000-aaaaaaaa", "full", None, files, start + 5))
    assert apply_retention(st, keep_last=1, session="aaaaaaaa", since=start, now=start + 10,
                           grace_s=3 * 3600) == []
    assert apply_retention(st, keep_last=1, session="aaaaaaaa", since=start, now=start + 10) == [
        "step-000011-bbbbbbbb", "step-000010-bbbbbbbb"]  # the default hour
    with pytest.raises(ValueError, match="retention_grace_s"):
        HotloadConfig(bucket_url=str(tmp_path), retention_grace_s=0)


def _three_step_chain(st: Storage, t: float) -> list[CommitInfo]:
    """Session aaaaaaaa's full at step 1 and two deltas on it, committed at t, t + 1 and t + 2."""
    shard = {"model-00001-of-00001.safetensors": {"size": 4}}
    return [_publish(st, CommitInfo(f"step-00000{step}-aaaaaaaa", "full" if step == 1 else "delta",
                                    None if step == 1 else f"step-00000{step - 1}-aaaaaaaa", shard, t + step - 1))
            for step in (1, 2, 3)]


class OneMissingMarker(Storage):
    """A local store that answers "not found" once for the file named in ``miss``."""
    miss: str | None = None

    def get_bytes(self, relpath: str, size_hint: int | None = None) -> bytes:
        if relpath == self.miss:
            self.miss = None
            raise FileNotFoundError(f"{self.uri(relpath)}: not found (once)")
        return super().get_bytes(relpath, size_hint)


def test_a_marker_read_as_missing_once_does_not_break_the_served_chain(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A marker that one read took for missing (a store that answered "not found" once) made its snapshot look
    like an unmarked folder: the sweep deleted the served delta's parent, and the chain's closure, stopped there,
    doomed the full base. A replica that rebuilds the served snapshot would then find neither."""
    st = OneMissingMarker(str(tmp_path))
    shard = {"model-00001-of-00001.safetensors": {"size": 4}}
    t = time.time()
    chain = _three_step_chain(st, t)
    st.miss = f"step-000002-aaaaaaaa/{COMMIT_MARKER}"
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        assert apply_retention(st, keep_last=1, protected={"step-000003-aaaaaaaa"}, session="aaaaaaaa",
                               since=t - 10) == []
    assert st.miss is None and "no readable commit marker" in caplog.text
    assert [c.identity for c in list_committed(st)] == [c.identity for c in chain]
    # read whole again, the chain is kept as any served chain is; a new full lets it go
    _publish(st, CommitInfo("step-000004-aaaaaaaa", "full", None, shard, t + 3))
    assert apply_retention(st, keep_last=1, protected={"step-000004-aaaaaaaa"}, session="aaaaaaaa",
                           since=t - 10) == [c.identity for c in reversed(chain)]


def test_delete_incomplete_keeps_a_kept_snapshots_parent_whose_marker_was_not_read(tmp_path: Path) -> None:
    """The sweep of unmarked folders skipped a kept chain's parents only with a session; delete_incomplete
    deleted the served delta's parent (marker included) right after plan_retention had logged it as kept."""
    st = OneMissingMarker(str(tmp_path))
    chain = _three_step_chain(st, time.time())
    st.miss = f"step-000002-aaaaaaaa/{COMMIT_MARKER}"
    deleted = apply_retention(st, keep_last=1, protected={"step-000003-aaaaaaaa"}, delete_incomplete=True)
    assert deleted == []
    assert [c.identity for c in list_committed(st)] == [c.identity for c in chain]


def test_a_served_snapshot_whose_own_marker_was_not_read_keeps_its_chain(tmp_path: Path) -> None:
    """The served delta's own marker read as missing named no parent, so its chain was not walked: with the
    newest snapshot another live run's, the whole chain went."""
    st = OneMissingMarker(str(tmp_path))
    shard = {"model-00001-of-00001.safetensors": {"size": 4}}
    t = time.time()
    chain = _three_step_chain(st, t - 30)
    other = _publish(st, CommitInfo("step-000007-bbbbbbbb", "full", None, shard, t - 5))  # a live publisher here
    st.miss = f"step-000003-aaaaaaaa/{COMMIT_MARKER}"
    deleted = apply_retention(st, keep_last=1, protected={"step-000003-aaaaaaaa"}, session="aaaaaaaa",
                              since=t - 60, now=t)
    assert deleted == []
    assert [c.identity for c in list_committed(st)] == [c.identity for c in chain] + [other.identity]


def test_a_run_continuing_from_an_earlier_runs_snapshot_under_the_root_keeps_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """hf_config_dir may be an earlier run's full snapshot under the same local root (RL continuing from the last
    full of an SFT run), read again at every full with carry_base_tensors. Once that run had been silent for
    retention_grace_s, retention deleted it from under the new run."""
    from fsdp_hotload.publish import TensorPublisher
    from tests.publisher_helpers import hf_dir, make_model, train_step

    bucket = tmp_path / "bucket"
    model = make_model()
    with TensorPublisher(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf_dir(tmp_path)))) as pub:
        assert pub.publish(0, model)
    (first,) = [c.identity for c in list_committed(Storage(str(bucket)))]
    cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(bucket / first), keep_last=1, full_every=1,
                        retention_grace_s=1e-3)
    with caplog.at_level("INFO", logger="fsdp_hotload"), TensorPublisher(model, cfg) as pub:
        for step in (1, 2, 3):
            train_step(model, step)
            assert pub.publish(step, model)
            pub.wait()
    assert [m.ok for m in pub.metrics] == [True] * 3
    assert [c.identity for c in list_committed(Storage(str(bucket)))] == [first, pub.metrics[-1].identity]
    assert f"retention keeps {bucket / first}: hf_config_dir reads from it" in caplog.text


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_publishers_passes_read_only_the_markers_they_have_not_read(kind: str,
                                                                     make_storage: Callable[..., Storage]) -> None:
    """Retention keeps the newest full snapshot's whole chain, and read every marker of it on each pass: a GET
    per snapshot on every publish with a long chain (``full_every=1000``). A publisher's passes now read only
    markers they have not read, and those they keep by count (``keep_last``) again, and decide exactly as a pass
    that reads them all (checked on a second bucket), also after an operator retracts a kept snapshot."""
    from fsdp_hotload.retention import MarkerCache

    ours, theirs, t0 = "a1b2c3d4", "0f0f0f0f", time.time()
    cached, fresh = make_storage(kind), make_storage(kind)
    markers = MarkerCache(ours)
    files = {"model-00001-of-00001.safetensors": {"size": 2}}

    def commit(step: int, parent: int | None, session: str = ours, at: float | None = None) -> str:
        name = f"step-{step:06d}-{session}"
        info = CommitInfo(name, "delta" if parent is not None else "full",
                          None if parent is None else f"step-{parent:06d}-{session}", files,
                          t0 + step if at is None else at)
        for root in (cached, fresh):
            _publish(root, info)
        return name

    def passes(served: str) -> int:
        """One pass on each bucket; the GETs of the cached one."""
        before = cached.stats.snapshot()["gets"]
        kept = apply_retention(cached, 2, {served}, session=ours, since=t0, grace_s=60, markers=markers)
        assert kept == apply_retention(fresh, 2, {served}, session=ours, since=t0, grace_s=60)
        assert cached.list_dirs() == fresh.list_dirs()
        return int(cached.stats.snapshot()["gets"] - before)

    commit(1, None, "99999999", at=t0 - 7200)  # a finished run's: it goes at the first pass
    for step in (1, 2):  # a live publisher's (another session): kept, and read again at every pass
        commit(step, None if step == 1 else 1, theirs)
    newest = commit(0, None)
    for step in range(1, 31):
        newest = commit(step, step - 1)
    assert passes(newest) == 34  # the first pass reads them all
    for step in range(31, 34):
        newest = commit(step, step - 1)
        assert passes(newest) == 4  # then the new one, the one before it again (keep_last), the other publisher's
    for root in (cached, fresh):  # that publisher's own retention deletes one of its snapshots
        root.delete_prefix(f"step-000002-{theirs}/{COMMIT_MARKER}")
    newest = commit(34, None)
    assert passes(newest) == 3  # a full: the old chain goes, its markers forgotten
    newest = commit(35, 34)
    assert passes(newest) == 3
    newest = commit(36, None)
    assert passes(newest) == 3
    for root in (cached, fresh):  # an operator retracts step 36: its marker goes, its folder stays
        root.delete_prefix(f"step-000036-{ours}/{COMMIT_MARKER}")
    newest = commit(37, None)
    # step 36 again (gone: not counted), then step 35, which takes its place (and keeps its parent, step 34)
    assert passes(newest) == 3
    assert sorted(markers.reusable(cached.list_dirs())) == [f"step-0000{s}-{ours}" for s in (34, 35, 37)]
    assert [c.identity for c in list_committed(cached)] == [f"step-000001-{theirs}",
                                                            *(f"step-0000{s}-{ours}" for s in (34, 35, 37))]
