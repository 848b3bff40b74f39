"""Several deployments on one bucket, one whose hot-load manager is down at the start or goes down mid-run (also
during its catch-up): it is asked before the next signal rather than signalled or hinted while down, costs the
others no wait, and catches up from the full snapshot once it is up, serving the newest weights bit for bit."""
from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.publish import TensorPublisher
from tests.publisher_helpers import API_KEY, config, expected_sha, make_model, train_step
from tests.test_deployments import EU, US, ledger, serves, until


def test_a_deployment_whose_manager_comes_up_late_catches_up_from_the_full_snapshot(tmp_path: Path) -> None:
    """pool-eu's hot-load manager is down when the trainer starts and comes up after step 1: its catch-up, which
    asks it after each publish (one status request, off the publisher's thread), finds it up and loads the full
    snapshot and the deltas after it, without a signal before it was up and without waiting for the next full."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        emu.set_manager_up(False, deployment=EU)
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=10, ready_timeout_s=1.5)
        with TensorPublisher(model, cfg) as pub:
            assert pub.engine.signaller is not None
            for step in range(4):
                train_step(model, step)
                if step == 2:
                    emu.set_manager_up(True, deployment=EU)
                pub.publish(step, model)
                pub.wait()
                assert pub.engine.signaller.drain(30)
                assert serves(emu, US) == (pub.metrics[-1].identity, expected_sha(model))
            ids = [m.identity for m in pub.metrics]
            assert [m.deployments_behind for m in pub.metrics] == [[EU], [EU], [EU], []]
            assert [m.kind for m in pub.metrics] == ["full"] + ["delta"] * 3
            assert serves(emu, EU) == (ids[3], expected_sha(model))
        assert ledger(emu, EU) == ids  # the full snapshot, then each delta, once
        assert emu.state()["deployments"][EU]["premature_signals"] == 0


@pytest.mark.parametrize("hints", [True, False], ids=["hints", "no-hints"])
@pytest.mark.parametrize("required", ["any", "all"])
def test_a_manager_that_goes_down_mid_run_is_asked_before_the_next_signal(tmp_path: Path, required: str,
                                                                          hints: bool) -> None:
    """pool-eu's hot-load manager goes down after step 1 (its serving container restarts) and is up again for step 4.
    Each snapshot's first request there (a hint, or the signal) follows a status read, so nothing is signalled or
    hinted to it until its status reports a replica again. It used to get a signal (and hints) at every publish,
    then step 2's first request only (its hints, or without them its signal and the transport's retry of it): each
    can crash a container that is starting. It then serves the newest weights, bit for bit."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required=required,
                     full_every=10, ready_timeout_s=1.0, keep_training_on_error=True, send_hints=hints)
        with TensorPublisher(model, cfg) as pub:
            assert pub.engine.signaller is not None
            for step in range(6):
                train_step(model, step)
                emu.set_manager_up(step not in (2, 3), deployment=EU)
                pub.publish(step, model)
                pub.wait()
                assert pub.engine.signaller.drain(30)
            ids = [m.identity for m in pub.metrics]
            assert serves(emu, EU) == serves(emu, US) == (ids[5], expected_sha(model))
        state = emu.state()["deployments"][EU]
        assert state["premature_signals"] == state["premature_hints"] == 0, state
        assert bool(state["hints"]) == hints
        if required == "all":  # steps 2 and 3 failed; step 4 is a full snapshot
            assert [m.ok for m in pub.metrics] == [True, True, False, False, True, True]
            assert ledger(emu, EU) == [ids[0], ids[1], ids[4], ids[5]]
        else:  # caught up on steps 2-4 once up, then back on the publishes
            assert [m.deployments_behind for m in pub.metrics] == [[], [], [EU], [EU], [EU], []]
            assert ledger(emu, EU) == ids


def test_a_manager_that_goes_down_mid_run_costs_the_others_no_wait(tmp_path: Path) -> None:
    """deployments_required="any", hints on: pool-eu's manager goes down at step 2. The publish leaves it out at
    once and pool-us serves step 2. It used to wait for pool-eu's manager for up to ready_timeout_s (300 s at most):
    the hints had marked both managers up before the first signal, which then never waited for them, and only a
    publish that has waited once does not wait again."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=10, ready_timeout_s=20.0)
        with TensorPublisher(model, cfg) as pub:
            for step in range(3):
                train_step(model, step)
                emu.set_manager_up(step < 2, deployment=EU)
                pub.publish(step, model)
                pub.wait()
            m = pub.metrics[-1]
            assert (m.ok, m.kind, m.deployments_behind) == (True, "delta", [EU]), m
            assert m.total_s < cfg.ready_timeout_s / 2, m  # not the 20 s wait for pool-eu's manager
            assert serves(emu, US) == (m.identity, expected_sha(model))
        assert emu.state()["deployments"][EU]["premature_signals"] == 0


def test_a_manager_that_goes_down_during_a_catch_up_is_asked_before_the_next_signal(tmp_path: Path) -> None:
    """pool-eu refuses step 1's signal, so its catch-up signals it; pool-eu's manager goes down while that load
    runs past the readiness wait, which ends on a status with no replica. The full snapshot of step 2 then asks
    pool-eu's status first and leaves it out, where it used to be signalled (a signal that can crash a container
    that is starting). Up again for step 3, pool-eu catches up and serves the newest weights, bit for bit."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=2, ready_timeout_s=1.0, send_hints=False)
        with TensorPublisher(model, cfg) as pub:
            assert pub.engine.signaller is not None
            for step in range(5):
                train_step(model, step)
                if step == 1:
                    emu.reject_next_signals(1, status=400, message="injected: refused", deployment=EU)
                    emu.set_load_delay(3.0, deployment=EU)
                if step == 3:
                    emu.set_load_delay(0.0, deployment=EU)
                    emu.set_manager_up(True, deployment=EU)
                pub.publish(step, model)
                pub.wait()
                if step == 1:
                    until("pool-eu's catch-up signal", lambda: pub.metrics[1].identity in ledger(emu, EU))
                    emu.set_manager_up(False, deployment=EU)
                assert pub.engine.signaller.drain(30)
                assert pub.metrics[-1].ok, pub.metrics[-1].error
            ids = [m.identity for m in pub.metrics]
            assert [m.deployments_behind for m in pub.metrics] == [[], [EU], [EU], [EU], []]
            assert serves(emu, EU) == serves(emu, US) == (ids[4], expected_sha(model))
        assert emu.state()["deployments"][EU]["premature_signals"] == 0
        assert ledger(emu, EU) == [ids[0], ids[1], ids[2], ids[3], ids[4]]


def test_a_manager_found_down_by_a_catch_up_s_status_request_is_asked_before_the_next_signal(tmp_path: Path) -> None:
    """pool-eu's load of step 1 outlasts its readiness wait, so its catch-up asks its status after each publish
    (that snapshot is never signalled again); pool-eu's manager goes down after step 1, and the status request after
    step 2 lists no replica. The full snapshot of step 3 then asks first and sends nothing there, where it used to
    be signalled. Up again for step 4, pool-eu catches up and serves the newest weights, bit for bit."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=3, ready_timeout_s=1.0)
        with TensorPublisher(model, cfg) as pub:
            assert pub.engine.signaller is not None
            for step in range(5):
                train_step(model, step)
                emu.set_load_delay(3.0 if step == 1 else 0.0, deployment=EU)
                if step == 4:
                    emu.set_manager_up(True, deployment=EU)
                pub.publish(step, model)
                pub.wait()
                assert pub.engine.signaller.drain(30)
                if step == 1:
                    emu.set_manager_up(False, deployment=EU)
                assert pub.metrics[-1].ok, pub.metrics[-1].error
            ids = [m.identity for m in pub.metrics]
            assert [m.deployments_behind for m in pub.metrics] == [[], [EU], [EU], [EU], [EU]]  # step 4: caught up
            assert serves(emu, EU) == serves(emu, US) == (ids[4], expected_sha(model))  # after the publish
        state = emu.state()["deployments"][EU]
        assert state["premature_signals"] == state["premature_hints"] == 0, state
        assert ledger(emu, EU) == [ids[0], ids[1], ids[3], ids[4]]
