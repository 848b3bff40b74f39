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
from tests.publisher_helpers import config, expected_sha, make_model, train_step
from tests.publisher_helpers import served as served_by


def folders(bucket: str) -> list[str]:
    return sorted(p.name for p in Path(bucket).iterdir() if p.is_dir())


def stages_once_ended(emu: HotLoadEmulator, want: list[str], deployment: str | None = None) -> list[str]:
    """The replicas' stages once they read ``want``, or after 30 s: where the publish need not wait for every
    replica's load to end (no keep_last, or another deployment serves it), each replica starts its load in its
    own time, so one may still read "pending" when ``pub.wait()`` returns."""
    deadline = time.monotonic() + 30
    while True:
        deps = emu.state()["deployments"]
        dep = deps[deployment] if deployment is not None else next(iter(deps.values()))
        stages = [r["stage"] for r in dep["replicas"]]
        if stages == want or time.monotonic() > deadline:
            return stages
        time.sleep(0.01)


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
                if step >= 2 and keep_last is not None:  # the publish waited for every load to end, to delete
                    (dep,) = emu.state()["deployments"].values()
                    assert [r["stage"] for r in dep["replicas"]] == ["error", "error"]
                elif step >= 2:  # it ended at the first failure
                    assert stages_once_ended(emu, ["error", "error"]) == ["error", "error"]
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
            emu.set_load_delay(30.0)  # released below, once its files are changed
            train_step(model, 1)
            assert pub.publish(1, model)
            deadline = time.monotonic() + 30
            stages: list[str] = []
            while time.monotonic() < deadline:  # replica 0 failed, replica 1 waits in its load
                (dep,) = emu.state()["deployments"].values()  # (each replica starts its load in its own time)
                stages = [r["stage"] for r in dep["replicas"]]
                if stages == ["error", "downloading"]:
                    break
                time.sleep(0.01)
            assert stages == ["error", "downloading"], stages
            (dep,) = emu.state()["deployments"].values()
            doomed = dep["replicas"][0]["target"]
            assert dep["replicas"][1]["target"] == doomed
            config_file = Path(bucket) / doomed / "config.json"
            os.utime(config_file, (time.time() + 5, time.time() + 5))  # replica 1 finds it changed: its load fails
            emu.set_load_delay(0)
            pub.wait()
            assert (pub.metrics[-1].identity, pub.metrics[-1].ok) == (doomed, False)
            (dep,) = emu.state()["deployments"].values()
            assert [r["stage"] for r in dep["replicas"]] == ["error", "error"]
            assert folders(bucket) == [pub.metrics[0].identity]


def test_a_load_error_beside_a_deployment_that_serves_it_holds_no_publish(tmp_path: Path) -> None:
    """With "any" and keep_last: pool-us serves the snapshot at once, pool-eu's replica 0 fails its load while its
    replica 1 loads on. The snapshot cannot be loaded nowhere (pool-us serves it), yet the publish waited on for
    pool-eu's slow replica (up to 60 s), past straggler_wait_s. Now it ends as without keep_last."""
    us, eu = "accounts/acct/deployments/pool-us", "accounts/acct/deployments/pool-eu"
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     straggler_wait_s=1.0, keep_last=1, full_every=100)
        with TensorPublisher(model, cfg) as pub:
            train_step(model, 0)
            pub.publish(0, model)
            pub.wait()
            emu.fail_next_loads(1, replica=0, deployment=eu)
            emu.set_load_delay(30, deployment=eu)
            train_step(model, 1)
            t0 = time.monotonic()
            pub.publish(1, model)
            pub.wait()
            took = time.monotonic() - t0
            emu.set_load_delay(0, deployment=eu)
            m = pub.metrics[-1]
            assert m.ok and m.deployments_behind == [eu], (m.ok, m.deployments_behind)
            assert took < 20, f"the publish waited {took:.1f} s for pool-eu's slow replica"  # 30 s before
            assert m.identity in folders(bucket)
            assert {r["identity"] for r in emu.state()["deployments"][us]["replicas"]} == {m.identity}


@pytest.mark.parametrize("required", ["all", "any"])
def test_a_snapshot_every_deployment_failed_to_load_is_deleted(tmp_path: Path, required: str) -> None:
    """Two deployments, every replica of each fails the delta's load, pool-eu's later (its loads are slower, and
    find a file changed): the publish waits for pool-eu's loads to end, finds the snapshot loaded nowhere and
    deletes it, with either readiness rule; the served chain stays whole (a restarted replica of each deployment
    rebuilds it)."""
    us, eu = "accounts/acct/deployments/pool-us", "accounts/acct/deployments/pool-eu"
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required=required,
                     straggler_wait_s=5.0 if required == "any" else None, keep_last=1, full_every=100,
                     keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(2):  # full, delta: served by both
                train_step(model, step)
                assert pub.publish(step, model)
                pub.wait()
            kept, kept_bytes = pub.metrics[-1].identity, expected_sha(model)
            emu.fail_next_loads(1, deployment=us)
            emu.set_load_delay(30.0, deployment=eu)  # released below, once its files are changed
            train_step(model, 2)
            assert pub.publish(2, model)
            deadline = time.monotonic() + 30
            stages: dict[str, list[str]] = {}
            while time.monotonic() < deadline:  # pool-us failed it; pool-eu's replicas wait in their loads
                deps = emu.state()["deployments"]  # (each replica starts its load in its own time)
                stages = {name: [r["stage"] for r in deps[name]["replicas"]] for name in (us, eu)}
                if stages == {us: ["error", "error"], eu: ["downloading", "downloading"]}:
                    break
                time.sleep(0.01)
            assert stages == {us: ["error", "error"], eu: ["downloading", "downloading"]}, stages
            doomed_id = emu.state()["deployments"][eu]["replicas"][0]["target"]
            config_file = Path(bucket) / doomed_id / "config.json"
            os.utime(config_file, (time.time() + 5, time.time() + 5))  # pool-eu finds it changed: its loads fail
            emu.set_load_delay(0, deployment=eu)
            pub.wait()
            doomed = pub.metrics[-1]
            assert (doomed.identity, doomed.kind, doomed.ok) == (doomed_id, "delta", False), doomed.error
            for name in (us, eu):
                reps = emu.state()["deployments"][name]["replicas"]
                assert [r["stage"] for r in reps] == ["error", "error"], (name, reps)
            assert folders(bucket) == sorted([pub.metrics[0].identity, kept])
            for name in (us, eu):
                emu.restart_replica(0, deployment=name)
                rep = restarted(emu, 0, deployment=name)
                assert rep["error"] is None, (name, rep["error"])
                assert (rep["identity"], {k: t["digest"] for k, t in rep["tensors"].items()}) == (kept, kept_bytes)
            train_step(model, 3)
            assert pub.publish(3, model)
            pub.wait()
            assert (pub.metrics[-1].kind, pub.metrics[-1].ok) == ("full", True)


def test_a_snapshot_one_deployment_serves_is_kept_though_the_other_failed_it(tmp_path: Path) -> None:
    """With "any": every replica of pool-us fails the delta's load and pool-eu serves it. The publish succeeds
    and the snapshot stays (pool-eu's replicas rebuild from it)."""
    us, eu = "accounts/acct/deployments/pool-us", "accounts/acct/deployments/pool-eu"
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     straggler_wait_s=1.0, keep_last=1, full_every=100, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            train_step(model, 0)
            assert pub.publish(0, model)
            pub.wait()
            emu.fail_next_loads(1, deployment=us)
            train_step(model, 1)
            assert pub.publish(1, model)
            pub.wait()
            m = pub.metrics[-1]
            assert m.ok and m.deployments_behind == [us], (m.ok, m.deployments_behind, m.error)
            assert stages_once_ended(emu, ["error", "error"], deployment=us) == ["error", "error"]
            assert {r["identity"] for r in emu.state()["deployments"][eu]["replicas"]} == {m.identity}
            assert m.identity in folders(bucket)


def _replica(current: str, stage: str, target: str) -> dict[str, object]:
    return {"current_snapshot_identity": current, "readiness": True,
            "loading_state": {"stage": stage, "target_snapshot_identity": target}}


@pytest.mark.parametrize("last, told", [("shrunk", "RuntimeError"), ("empty", "RuntimeError"),
                                        ("both failed", "LoadedNowhere")])
def test_a_replica_that_leaves_the_list_mid_load_keeps_the_snapshot(last: str, told: str) -> None:
    """Replica 0 fails the snapshot while replica 1 still loads it, then replica 1 leaves the status (evicted,
    rescheduled mid-load): the one replica listed failed it, and the snapshot counted as loaded nowhere and was
    deleted, though what a replacement loads is not known. A real HTTP server answers the scripted statuses."""
    import json
    from http.server import BaseHTTPRequestHandler

    from fsdp_hotload.engine.signal import LoadedNowhere, Signaller
    from fsdp_hotload.fireworks import HotLoadClient
    from tests.http_fixture import serve

    snap, parent = "step-000002-aaaaaaaa", "step-000001-aaaaaaaa"
    ending = {"shrunk": [_replica(parent, "error", snap)], "empty": [],
              "both failed": [_replica(parent, "error", snap), _replica(parent, "error", snap)]}[last]
    script = [[_replica(parent, "done", parent)] * 2,
              [_replica(parent, "error", snap), _replica(parent, "downloading", snap)], ending]
    polls = [0]

    class Api(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _answer(self, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._answer({"replicas": script[min(polls[0], len(script) - 1)]})
            polls[0] += 1

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer({})

    with serve(Api) as url:
        client = HotLoadClient(url, account_id="a", model_id="m", deployment_id="d", api_key="k" * 20,
                               poll_interval_s=0.01, retry_budget_s=1)
        sig = Signaller([client], ready_timeout_s=5, settle_s=1.0)
        with pytest.raises((RuntimeError, LoadedNowhere)) as err:
            sig.signal_and_wait(snap, previous=None)
    assert type(err.value).__name__ == told, err.value
