"""A committed snapshot that every replica failed to load is deleted at once (keep_last); one that a replica may
serve or still load stays.

No retention pass runs while publishes fail, and after a failure the next publish is full, so with
keep_training_on_error a fleet that accepts each signal and fails each load would otherwise keep one committed
full snapshot per publish in the bucket.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.publish import TensorPublisher
from tests.test_emulator_restart import restarted
from tests.test_publisher import config, expected_sha, make_model, train_step
from tests.test_publisher import served as served_by


def folders(bucket: str) -> list[str]:
    return sorted(p.name for p in Path(bucket).iterdir() if p.is_dir())


@pytest.mark.parametrize("keep_last", [1, None], ids=["keep_last", "keep-all"])
def test_a_snapshot_every_replica_failed_to_load_is_deleted_at_once(tmp_path: Path, keep_last: int | None) -> None:
    """A delta, then two full snapshots, fail on both replicas: with keep_last each is deleted as its publish
    fails, the served chain stays whole (a restarted replica rebuilds it) and the bucket does not grow; without
    keep_last every snapshot is kept."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_last=keep_last, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(5):  # full, delta (served); a delta and two fulls that fail on every replica
                if step >= 2:
                    emu.fail_next_loads(1)
                train_step(model, step)
                assert pub.publish(step, model)
                pub.wait()
                if step == 1:
                    served_bytes = expected_sha(model)
                    (dep,) = emu.state()["deployments"].values()
                if step >= 2:
                    (dep,) = emu.state()["deployments"].values()
                    assert [r["stage"] for r in dep["replicas"]] == ["error", "error"]
            ids = [m.identity for m in pub.metrics]
            assert [(m.kind, m.ok) for m in pub.metrics] == [("full", True), ("delta", True), ("delta", False),
                                                             ("full", False), ("full", False)]
            assert all("failed to load" in str(m.error) for m in pub.metrics[2:])
            assert folders(bucket) == sorted(ids if keep_last is None else ids[:2])
            emu.restart_replica(0)
            rep = restarted(emu, 0)
            assert rep["error"] is None, rep["error"]
            assert served_by(emu) == [(ids[1], served_bytes)] * 2
            train_step(model, 5)
            assert pub.publish(5, model)
            pub.wait()
            assert (pub.metrics[-1].kind, pub.metrics[-1].ok) == ("full", True)
        last = pub.metrics[-1].identity
    assert folders(bucket) == sorted([*ids, last] if keep_last is None else [last])


def test_a_snapshot_one_replica_loads_and_another_fails_is_kept(tmp_path: Path) -> None:
    """Replica 1 fails the delta's load at once; replica 0 loads it, slowly, after the publish saw the failure:
    the publish fails, and the delta replica 0 serves stays, so that a restart of it rebuilds its weights."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_last=1, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(3):  # full, delta (served); a delta replica 1 fails and replica 0 loads
                if step == 2:
                    emu.fail_next_loads(1, replica=1)
                    emu.set_load_delay(0.5)
                train_step(model, step)
                assert pub.publish(step, model)
                pub.wait()
            partial, partial_bytes = pub.metrics[-1].identity, expected_sha(model)
            assert [(m.kind, m.ok) for m in pub.metrics] == [("full", True), ("delta", True), ("delta", False)]
            deadline = time.monotonic() + 30
            while served_by(emu)[0][0] != partial and time.monotonic() < deadline:
                time.sleep(0.02)
            assert served_by(emu)[0] == (partial, partial_bytes)
            assert partial in folders(bucket)
            emu.set_load_delay(0)
            emu.restart_replica(0)
            rep = restarted(emu, 0)
            assert rep["error"] is None, rep["error"]
            assert served_by(emu)[0] == (partial, partial_bytes)


def test_a_snapshot_whose_load_outlasts_the_readiness_wait_is_kept(tmp_path: Path) -> None:
    """A readiness timeout says nothing of the load's end (the replicas may still be loading): the full snapshot
    stays, and the replicas serve it once their loads end."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_last=1, keep_training_on_error=True,
                     ready_timeout_s=0.5)
        with TensorPublisher(model, cfg) as pub:
            emu.set_load_delay(1.5)
            train_step(model, 0)
            assert pub.publish(0, model)
            pub.wait()
            slow = pub.metrics[-1].identity
            assert not pub.metrics[-1].ok and "was not served by every replica" in str(pub.metrics[-1].error)
            assert slow in folders(bucket)
            deadline = time.monotonic() + 30
            while [i for i, _ in served_by(emu)] != [slow, slow] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert served_by(emu) == [(slow, expected_sha(model))] * 2
            assert slow in folders(bucket)


def test_a_replica_that_fails_after_the_publish_saw_another_fail_is_waited_for(tmp_path: Path) -> None:
    """Replica 0 fails the delta's load at once; replica 1 is still loading it when the publish sees that,
    and fails later (a file rewritten after the signal): the publish asks on until every replica ended its load,
    then deletes the snapshot that none serves (keep_last)."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_last=1, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            train_step(model, 0)
            assert pub.publish(0, model)
            pub.wait()
            emu.fail_next_loads(1, replica=0)
            emu.set_load_delay(1.0)
            train_step(model, 1)
            assert pub.publish(1, model)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # replica 0 failed, replica 1 waits in its load
                (dep,) = emu.state()["deployments"].values()
                if dep["replicas"][0]["stage"] == "error":
                    break
                time.sleep(0.01)
            (dep,) = emu.state()["deployments"].values()
            doomed = dep["replicas"][0]["target"]
            assert dep["replicas"][1]["stage"] == "downloading" and dep["replicas"][1]["target"] == doomed
            config_file = Path(bucket) / doomed / "config.json"
            os.utime(config_file, (time.time() + 5, time.time() + 5))  # replica 1 finds it changed: its load fails
            pub.wait()
            assert (pub.metrics[-1].identity, pub.metrics[-1].ok) == (doomed, False)
            (dep,) = emu.state()["deployments"].values()
            assert [r["stage"] for r in dep["replicas"]] == ["error", "error"]
            assert folders(bucket) == [pub.metrics[0].identity]
