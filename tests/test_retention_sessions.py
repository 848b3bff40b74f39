"""Retention where several sessions meet under one root: two publishers without a hot-load API, each keeping its own
``keep_last`` newest (another live run's snapshots, kept anyway, hold no place), also when one of its kept markers
was retracted; and, after a restart with ``deployments_required="any"``, the earlier run's snapshot that a
deployment left behind still serves."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.publish import TensorPublisher
from fsdp_hotload.retention import (COMMIT_MARKER, CommitInfo, MarkerCache, apply_retention, list_committed,
                                    write_commit_marker)
from fsdp_hotload.storage import Storage
from tests.publisher_helpers import API_KEY, config, expected_sha, make_model, train_step


def _committed(bucket: str) -> list[str]:
    return [c.identity for c in list_committed(Storage(bucket))]


def test_two_publishers_without_an_api_under_one_root_each_keep_their_previous_snapshot(tmp_path: Path) -> None:
    """No hot-load API, ``keep_last=2`` (what the README advises there: a reader may still download the previous
    snapshot), two trainers under one root taking turns. Each one's previous snapshot stays once its next one
    commits: the other trainer's snapshots (kept anyway, as a live run's) took the places, and each publisher's
    previous snapshot went as soon as the other committed in between. Older ones still go."""
    bucket = str(tmp_path / "bucket")
    models = {"a": make_model(1), "b": make_model(2)}
    pubs: dict[str, TensorPublisher] = {}
    for name in models:
        (tmp_path / name).mkdir()
        pubs[name] = TensorPublisher(models[name], config(bucket, None, tmp_path / name, keep_last=2, full_every=1))
    try:
        for step in range(3):
            for name, pub in pubs.items():
                train_step(models[name], step)
                pub.publish(step, models[name])
                pub.wait()
                mine = [m.identity for m in pub.metrics]
                assert all(m.ok for m in pub.metrics)
                assert set(mine[-2:]) <= set(_committed(bucket)), (name, step, _committed(bucket))
    finally:
        for pub in pubs.values():
            pub.close()
    a, b = ([m.identity for m in pubs[n].metrics] for n in ("a", "b"))
    assert sorted(_committed(bucket)) == sorted(a[-2:] + b[-2:])  # each one's first went at its third publish


def _commit(st: Storage, identity: str, at: float) -> None:
    """A full snapshot's shard, then its marker, created at ``at``."""
    files = {"model-00001-of-00001.safetensors": {"size": 2}}
    st.put_many({f"{identity}/model-00001-of-00001.safetensors": os.urandom(2)})
    write_commit_marker(st, CommitInfo(identity, "full", None, files, at))


def test_a_retracted_marker_is_read_again_while_another_live_run_commits_newer_snapshots(tmp_path: Path) -> None:
    """A publisher's passes reuse the markers they read, and read again those they may keep by count. Another live
    publisher's snapshots are newer than all of this one's, and hold no place: the markers read again are this
    run's newest, so the one an operator retracted does not take a place, and the one before it stays."""
    st = Storage(str(tmp_path / "bucket"))
    ours, theirs, t0 = "a1b2c3d4", "0f0f0f0f", time.time()
    markers = MarkerCache(ours)
    for step in (1, 2, 3):
        _commit(st, f"step-{step:06d}-{ours}", t0 + step)
    for step in (1, 2):  # the other publisher commits newer ones
        _commit(st, f"step-{step:06d}-{theirs}", t0 + 10 + step)
    gone = apply_retention(st, 2, {f"step-000003-{ours}"}, session=ours, since=t0, grace_s=60, markers=markers)
    assert gone == [f"step-000001-{ours}"]
    st.delete_prefix(f"step-000003-{ours}/{COMMIT_MARKER}")  # an operator retracts step 3: step 2 serves again
    _commit(st, f"step-000004-{ours}", t0 + 4)
    apply_retention(st, 2, {f"step-000004-{ours}"}, session=ours, since=t0, grace_s=60, markers=markers)
    assert sorted(_committed(str(tmp_path / "bucket"))) == sorted(
        [f"step-000002-{ours}", f"step-000004-{ours}", f"step-000001-{theirs}", f"step-000002-{theirs}"])


def _replica(emu: HotLoadEmulator, deployment: str) -> dict[str, Any]:
    (rep,) = emu.state()["deployments"][deployment]["replicas"]
    return rep


def test_a_restarted_run_keeps_the_earlier_runs_snapshot_a_deployment_left_behind_serves(tmp_path: Path) -> None:
    """Run A publishes to two deployments and ends. Its restart, B (a new session, ``deployments_required="any"``,
    A past ``retention_grace_s``), publishes while eu refuses its signals: eu serves A's last snapshot still, which
    B's first status of eu reported. B's pass keeps it, so a replica of eu that restarts rebuilds it from the
    bucket; once eu serves one of B's snapshots, A's goes."""
    bucket = str(tmp_path / "bucket")
    us, eu = "accounts/acct/deployments/us", "accounts/acct/deployments/eu"
    model = make_model(1)
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        a = TensorPublisher(model, config(bucket, emu, tmp_path / "a", keep_last=1, deployment_id=["us", "eu"]))
        train_step(model, 0)
        a.publish(0, model)
        a.close()
        x, x_sha = a.metrics[-1].identity, expected_sha(model)
        emu.reject_next_signals(2, status=400, message="refused", deployment=eu)  # B's signal, then its catch-up's
        b = TensorPublisher(model, config(bucket, emu, tmp_path / "b", keep_last=1, deployment_id=["us", "eu"],
                                          deployments_required="any", retention_grace_s=0.001, full_every=1,
                                          publish_on_close=False))
        try:
            train_step(model, 1)
            b.publish(1, model)
            b.wait()
            assert b.engine.signaller is not None and b.engine.signaller.drain(30)
            assert b.metrics[-1].ok and b.metrics[-1].deployments_behind == [eu]
            assert (_replica(emu, us)["identity"], _replica(emu, eu)["identity"]) == (b.metrics[-1].identity, x)
            assert sorted(_committed(bucket)) == sorted([x, b.metrics[-1].identity])
            emu.restart_replica(0, deployment=eu)
            deadline = time.monotonic() + 10
            while not ((rep := _replica(emu, eu))["restarts"] and rep["stage"] in ("done", "error", "idle")):
                assert time.monotonic() < deadline, rep
                time.sleep(0.01)
            assert (rep["stage"], rep["identity"], rep["error"]) == ("done", x, None)
            assert {k: t["digest"] for k, t in rep["tensors"].items()} == x_sha
            train_step(model, 2)  # eu takes this one: A's snapshot is no deployment's any more
            b.publish(2, model)
            b.wait()
            assert b.metrics[-1].ok and b.metrics[-1].deployments_behind == []
            assert _committed(bucket) == [b.metrics[-1].identity]
        finally:
            b.close(raise_errors=False)
