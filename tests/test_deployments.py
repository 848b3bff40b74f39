"""Several deployments on one bucket with ``deployments_required="any"``: one that fails is left behind while the
others take every snapshot, it catches up at the next full one, and retention keeps what it serves."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.engine import PublishError
from fsdp_hotload.publish import TensorPublisher
from tests.test_emulator_restart import restarted
from tests.test_publisher import API_KEY, config, expected_sha, make_model, train_step

US, EU = "accounts/acct/deployments/pool-us", "accounts/acct/deployments/pool-eu"


def replica(emu: HotLoadEmulator, deployment: str) -> dict[str, Any]:
    (rep,) = emu.state()["deployments"][deployment]["replicas"]
    return rep


def serves(emu: HotLoadEmulator, deployment: str) -> tuple[str | None, dict[str, str]]:
    rep = replica(emu, deployment)
    return rep["identity"], {k: t["digest"] for k, t in rep["tensors"].items()}


def test_a_failing_deployment_is_left_behind_and_the_others_take_every_snapshot(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With "all", one pool that fails a load fails the publish for both and the next one is full. With "any" the
    other pool gets every snapshot; the failing one keeps serving its last one (which retention keeps, with
    keep_last=1, so a restarted replica rebuilds it), and it is signalled again at the next full snapshot."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=3, keep_last=1)
        digests: list[dict[str, str]] = []
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"), TensorPublisher(model, cfg) as pub:
            for step in range(7):
                train_step(model, step)
                digests.append(expected_sha(model))
                if step == 1:
                    emu.fail_next_loads(2, deployment=EU)  # its loads of steps 1 and 3 (a full) fail
                pub.publish(step, model)
                pub.wait()  # retention too
                m = pub.metrics[-1]
                assert m.ok, m.error
                assert serves(emu, US) == (m.identity, digests[step])  # bit for bit, at every step
                if step == 4:  # kept: pool-eu serves step 0; steps 1 and 2 are neither served nor parents
                    names = {p.name for p in Path(bucket).iterdir()}
                    assert pub.metrics[0].identity in names
                    assert not names & {pub.metrics[1].identity, pub.metrics[2].identity}
                    emu.restart_replica(0, deployment=EU)  # rebuilds step 0 from the bucket
                    rep = restarted(emu, 0, deployment=EU)
                    assert (rep["stage"], rep["error"]) == ("done", None), rep
                eu = serves(emu, EU)
                if step in (0, 6):
                    assert eu == (m.identity, digests[step]) and m.deployments_behind == []
                else:
                    assert eu == (pub.metrics[0].identity, digests[0]) and m.deployments_behind == [EU]
        assert [m.kind for m in pub.metrics] == ["full", "delta", "delta", "full", "delta", "delta", "full"]
        signalled = [r["identity"] for r in emu.state()["deployments"][EU]["ledger"]]
        assert signalled == [pub.metrics[i].identity for i in (0, 1, 3, 6)]  # no delta after it fell behind
    behind = [r.getMessage() for r in caplog.records if "does not serve" in r.getMessage()]
    assert len(behind) == 1 and "pool-eu" in behind[0], behind  # said once, not at every step it stays behind
    assert any("pool-eu serves" in r.getMessage() and "no longer behind" in r.getMessage() for r in caplog.records)


def test_every_deployment_failing_still_fails_the_publish(tmp_path: Path) -> None:
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any")
        with TensorPublisher(model, cfg) as pub:
            pub.publish(0, model)
            pub.wait()
            emu.fail_next_loads(1)
            train_step(model, 0)
            pub.publish(1, model)
            pub.wait()
            train_step(model, 1)
            with pytest.raises(PublishError, match="pool-us.*pool-eu|pool-eu.*pool-us"):
                pub.publish(2, model)  # the stored error is raised here
            pub.publish(3, model)
            pub.wait()
        assert [(m.kind, m.ok) for m in pub.metrics] == [("full", True), ("delta", False), ("full", True)]
        assert pub.metrics[1].deployments_behind == [EU, US]
        assert serves(emu, US) == serves(emu, EU) == (pub.metrics[2].identity, expected_sha(model))
