"""A restarted emulator replica rebuilds what it served from the bucket, so a broken chain in storage shows."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.fireworks import HotLoadError
from fsdp_hotload.publish import TensorPublisher
from tests.emulator_fixture import EMULATOR_API_KEY, digest_map, perturb, write_delta_snapshot
from tests.test_emulator import DEP, client_for, load_full, served, settle
from tests.test_format_corrupt import _corrupt_header
from tests.publisher_helpers import config, expected_sha, make_model, train_step
from tests.publisher_helpers import served as served_by


def restarted(emu: HotLoadEmulator, replica: int, count: int = 1, timeout_s: float = 30,
              deployment: str | None = None) -> dict[str, Any]:
    """Wait until ``replica`` (of ``deployment``, or of the only one) has finished its ``count``-th restart;
    returns its state."""
    deadline = time.monotonic() + timeout_s
    while True:
        deps = emu.state()["deployments"]
        (dep,) = deps.values() if deployment is None else [deps[deployment]]
        rep = dep["replicas"][replica]
        if rep["restarts"] >= count and rep["stage"] in ("done", "error", "idle"):
            return rep
        if time.monotonic() > deadline:
            raise AssertionError(f"replica {replica} did not finish restarting: {rep}")
        time.sleep(0.01)


def test_a_restarted_replica_rebuilds_the_served_chain_bit_exact(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    m2, m3 = perturb(m1, seed=1), perturb(perturb(m1, seed=1), seed=2)
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, m2)
    client.signal("step-2", previous_identity="step-1")
    client.wait_ready("step-2", timeout_s=30)
    write_delta_snapshot(emulator.bucket, "step-3", "step-2", m2, m3)
    client.signal("step-3", previous_identity="step-2")
    emulator.restart_replica(0)  # queued behind the load of step-3: it rebuilds step-1, step-2, step-3
    client.wait_ready("step-3", timeout_s=30)
    rep = restarted(emulator, 0)
    assert (rep["stage"], rep["error"], rep["readiness"]) == ("done", None, True)
    assert served(emulator) == [("step-3", digest_map(m3))] * 2
    write_delta_snapshot(emulator.bucket, "step-4", "step-3", m3, perturb(m3, seed=3))
    client.signal("step-4", previous_identity="step-3")  # the chain goes on from the rebuilt bytes
    client.wait_ready("step-4", timeout_s=30)
    assert served(emulator)[0] == served(emulator)[1]


def test_a_chain_broken_in_storage_fails_the_restart_and_then_every_delta(emulator: HotLoadEmulator) -> None:
    """A deleted link: the restarted replica serves the base model with the error, and the next delta, which no
    longer applies to what every replica serves, is refused until a full snapshot loads."""
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    m2 = perturb(m1, seed=1)
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, m2)
    client.signal("step-2", previous_identity="step-1")
    client.wait_ready("step-2", timeout_s=30)
    os.remove(Path(emulator.bucket) / "step-1" / "model-00001.safetensors")
    emulator.restart_replica(1)
    rep = restarted(emulator, 1)
    assert (rep["stage"], rep["identity"], rep["target"], rep["readiness"]) == ("error", None, "step-2", True)
    assert "rebuilding 'step-2' failed" in rep["error"] and "step-1/model-00001.safetensors" in rep["error"]
    assert served(emulator)[0] == ("step-2", digest_map(m2))
    write_delta_snapshot(emulator.bucket, "step-3", "step-2", m2, perturb(m2, seed=2))
    with pytest.raises(HotLoadError, match="HTTP 400.*not the snapshot the replicas serve"):
        client.signal("step-3", previous_identity="step-2")
    load_full(emulator, client, "step-4", seed=4)
    assert served(emulator)[0] == served(emulator)[1]


@pytest.mark.parametrize("when", ["queued", "running"])
def test_a_restart_does_not_loosen_the_delta_check(emulator: HotLoadEmulator, when: str) -> None:
    """A restart marked its replica busy, which switches the check of a delta's parent to "the newest ledger
    row" for the whole deployment: with replica 1 still on step-1 (its load of step-2 failed), a delta on
    step-2 was taken while replica 0 restarted, and then failed on replica 1."""
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    m2 = perturb(m1, seed=1)
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, m2)
    emulator.fail_next_loads(1, replica=1)
    client.signal("step-2", previous_identity="step-1")
    settle(emulator, "step-2")
    write_delta_snapshot(emulator.bucket, "step-3", "step-2", m2, perturb(m2, seed=2))
    real = emulator.settings.get_bytes
    emulator.settings.get_bytes = lambda path: (time.sleep(0.2), real(path))[1]  # a restore that takes a while
    emulator.restart_replica(0)
    if when == "running":
        deadline = time.monotonic() + 10
        while emulator.state()["deployments"][DEP]["replicas"][0]["restarts"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    with pytest.raises(HotLoadError, match="HTTP 400.*not the snapshot the replicas serve.*'step-2', 'step-1'"):
        client.signal("step-3", previous_identity="step-2")
    emulator.settings.get_bytes = real
    assert restarted(emulator, 0)["identity"] == "step-2"


def test_a_delta_signalled_during_a_restore_applies_after_it(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    m2 = perturb(m1, seed=1)
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, m2)
    real = emulator.settings.get_bytes
    emulator.settings.get_bytes = lambda path: (time.sleep(0.1), real(path))[1]
    emulator.restart_replica(1)
    deadline = time.monotonic() + 10
    while emulator.state()["deployments"][DEP]["replicas"][1]["restarts"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    client.signal("step-2", previous_identity="step-1")  # replica 1 will serve step-1 again: the delta applies
    emulator.settings.get_bytes = real
    client.wait_ready("step-2", timeout_s=30)
    assert served(emulator) == [("step-2", digest_map(m2))] * 2


def test_a_file_rewritten_after_its_signal_fails_the_restart(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    load_full(emulator, client, "step-1")
    victim = Path(emulator.bucket) / "step-1" / "config.json"
    victim.write_text(victim.read_text() + " ")
    emulator.restart_replica(0)
    assert "changed after it was signalled" in restarted(emulator, 0)["error"]


def test_a_replica_serving_the_base_model_restarts_empty(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    client.status()  # names the deployment
    emulator.restart_replica(1)
    rep = restarted(emulator, 1)
    assert (rep["stage"], rep["identity"], rep["error"], rep["readiness"]) == ("idle", None, None, True)
    with pytest.raises(ValueError, match="replica must be in"):
        emulator.restart_replica(2)
    with pytest.raises(ValueError, match="no deployment"):
        emulator.restart_replica(0, deployment="accounts/acct/deployments/other")


def test_a_chain_older_than_the_kept_ledger_rows_is_named(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    with HotLoadEmulator(str(bucket), replicas=1, api_key=EMULATOR_API_KEY, history_limit=2) as emu:
        client = client_for(emu)
        m1 = load_full(emu, client, "step-1")
        m2 = perturb(m1, seed=1)
        for identity, parent, before, after in (("step-2", "step-1", m1, m2), ("step-3", "step-2", m2,
                                                                               perturb(m2, seed=2))):
            write_delta_snapshot(bucket, identity, parent, before, after)
            client.signal(identity, previous_identity=parent)
            client.wait_ready(identity, timeout_s=30)
        emu.restart_replica(0)
        assert "'step-1', a link of the chain to 'step-3', is older than" in restarted(emu, 0)["error"]
        assert "history_limit=2" in emu.state()["deployments"][DEP]["replicas"][0]["error"]


def test_a_delta_whose_chunks_carry_no_crc_is_refused(emulator: HotLoadEmulator) -> None:
    """The reader takes files written before chunks carried a CRC-32; the emulator, standing for what this
    library must write, does not, so a writer that dropped them fails its tests."""
    import json

    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    folder = write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, perturb(m1, seed=1))
    victim = folder / "model-00002.safetensors"

    def drop_crcs(doc: dict[str, Any]) -> None:
        table = json.loads(doc["__metadata__"]["arc_tensors"])
        for entry in table.values():
            for chunk in entry["chunks"]:
                chunk.pop("crc32")
        doc["__metadata__"]["arc_tensors"] = json.dumps(table)

    victim.write_bytes(_corrupt_header(victim.read_bytes(), drop_crcs))
    client.signal("step-2", previous_identity="step-1")
    with pytest.raises(HotLoadError, match="failed to load"):
        client.wait_ready("step-2", timeout_s=30)
    deadline = time.monotonic() + 30  # the first replica's failure ends the wait; the other may still be loading
    while True:
        (dep,) = emulator.state()["deployments"].values()
        if all(r["error"] is not None for r in dep["replicas"]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert all("model-00002.safetensors: tensor" in (r["error"] or "") and "without a CRC-32" in r["error"]
               for r in dep["replicas"]), dep["replicas"]


def test_retention_keeps_every_link_a_restarted_replica_needs(tmp_path: Path) -> None:
    """keep_last=1 deletes all but the newest snapshot and the chain it stands on: a replica restarted after
    any publish must still rebuild the served bytes from what is left."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, full_every=3, keep_last=1)
        with TensorPublisher(model, cfg) as pub:
            for step in range(8):
                train_step(model, step)
                assert pub.publish(step, model)
                pub.wait()
                emu.restart_replica(step % 2)
                rep = restarted(emu, step % 2, count=step // 2 + 1)
                assert rep["error"] is None, rep["error"]
                for identity, digests in served_by(emu):
                    assert (identity, digests) == (pub.metrics[-1].identity, expected_sha(model))
        assert [m.kind for m in pub.metrics] == ["full", "delta", "delta"] * 2 + ["full", "delta"]
        left = sorted(p.name for p in Path(bucket).iterdir() if p.is_dir())
        assert left == sorted(m.identity for m in pub.metrics[-2:])  # the others were deleted


def test_a_late_retention_pass_spares_a_snapshot_one_replica_serves(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A retention pass protected only the snapshot it was queued for. One that ran late (another pass still
    running, a bucket of many markers) after a delta failed on one replica and loaded on the other, and a full
    after it failed everywhere, kept only the newest commit and the queued one's chain: it deleted the delta
    replica 0 served, which that replica could then not rebuild on a restart. The passes are held here till then."""
    import threading

    import fsdp_hotload.retention as retention

    bucket = str(tmp_path / "bucket")
    model = make_model()
    release = threading.Event()
    real = retention.retain_after

    def held(*args: Any, **kwargs: Any) -> None:
        assert release.wait(60)
        real(*args, **kwargs)

    monkeypatch.setattr(retention, "retain_after", held)
    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_last=1, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(4):  # full, delta (both served); a delta replica 1 fails; a full both fail
                if step == 2:
                    emu.fail_next_loads(1, replica=1)
                elif step == 3:
                    emu.fail_next_loads(1)
                train_step(model, step)
                assert pub.publish(step, model)
                deadline = time.monotonic() + 30  # not wait(): it waits for the retention held here too
                while len(pub.metrics) <= step and time.monotonic() < deadline:
                    time.sleep(0.01)
                if step == 2:
                    partial, partial_bytes = pub.metrics[-1].identity, expected_sha(model)
            assert [(m.kind, m.ok) for m in pub.metrics] == [("full", True), ("delta", True), ("delta", False),
                                                             ("full", False)]
            assert [identity for identity, _ in served_by(emu)] == [partial, pub.metrics[1].identity]
            release.set()
            pub.wait()  # both passes: the one queued at step 0, then the one for step 1
            assert (Path(bucket) / partial).is_dir()
            emu.restart_replica(0)
            rep = restarted(emu, 0)
            assert rep["error"] is None, rep["error"]
            assert served_by(emu)[0] == (partial, partial_bytes)
            train_step(model, 4)
            assert pub.publish(4, model)
            pub.wait()  # served everywhere: its pass lets the failed ones go
            assert pub.metrics[-1].ok
        left = sorted(p.name for p in Path(bucket).iterdir() if p.is_dir())
        assert left == [pub.metrics[-1].identity]


@pytest.mark.parametrize("keep_last", [1, None], ids=["keep_last", "keep-all"])
def test_a_snapshot_whose_signal_every_deployment_refused_is_deleted_at_once(tmp_path: Path,
                                                                           keep_last: int | None) -> None:
    """No retention pass runs while publishes fail, so with keep_training_on_error a fleet that refused every
    signal left a committed full snapshot per publish in the bucket until one was served. A snapshot whose signal
    no deployment took (HTTP 400 here) is loaded by no replica: with keep_last it is deleted at once, and the
    served chain stays whole (a restarted replica rebuilds it). Without keep_last every snapshot is kept."""
    bucket = str(tmp_path / "bucket")
    model = make_model()

    def folders() -> list[str]:
        return sorted(p.name for p in Path(bucket).iterdir() if p.is_dir())

    with HotLoadEmulator(bucket, replicas=2, api_key="test-key") as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_last=keep_last, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(4):  # full, delta (served); a delta, then a full, both refused
                if step >= 2:
                    emu.reject_next_signals(1, status=400, message="injected: refused")
                train_step(model, step)
                assert pub.publish(step, model)
                pub.wait()
                if step == 1:
                    served_bytes = expected_sha(model)
            ids = [m.identity for m in pub.metrics]
            assert [(m.kind, m.ok) for m in pub.metrics] == [("full", True), ("delta", True), ("delta", False),
                                                             ("full", False)]
            assert all("injected: refused" in str(m.error) for m in pub.metrics[2:])
            assert folders() == sorted(ids if keep_last is None else ids[:2])
            emu.restart_replica(0)
            rep = restarted(emu, 0)
            assert rep["error"] is None, rep["error"]
            assert served_by(emu) == [(ids[1], served_bytes)] * 2
            train_step(model, 4)
            assert pub.publish(4, model)
            pub.wait()
            assert (pub.metrics[-1].kind, pub.metrics[-1].ok) == ("full", True)
        last = pub.metrics[-1].identity
    assert folders() == sorted([*ids, last] if keep_last is None else [last])


def test_a_snapshot_signalled_to_no_deployment_is_deleted(tmp_path: Path) -> None:
    """A hot-load manager that never comes up: nothing is signalled, so nothing is loaded, and each publish's
    committed full snapshot is deleted as its wait for the manager ends (keep_last)."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key="test-key", manager_delay_s=3600) as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_last=2, keep_training_on_error=True,
                     ready_timeout_s=0.3)
        with TensorPublisher(model, cfg) as pub:
            for step in range(3):
                train_step(model, step)
                assert pub.publish(step, model)
                pub.wait()
            assert [(m.kind, m.ok) for m in pub.metrics] == [("full", False)] * 3
    assert [p.name for p in Path(bucket).iterdir() if p.is_dir()] == []
