"""Several deployments on one bucket whose loads are slow or hang: a load that outlasts its readiness wait is found
by the catch-up, replicas hanging in a load cost a full snapshot but no second wait, and with straggler_wait_s a
slow deployment is left to its catch-up (waited for only where no other deployment takes the delta)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.publish import TensorPublisher
from tests.publisher_helpers import API_KEY, config, expected_sha, make_model, train_step
from tests.test_deployments import EU, US, every_replica, ledger, serves, until


def test_a_load_that_outlasts_its_readiness_wait_is_found_by_the_catch_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pool-eu's load of step 1 takes longer than ready_timeout_s: the publish gives up on it, but the load ends
    later. The catch-up after step 2 asks whether it serves step 1 by now (a second signal of it would be
    refused), finds it does, and signals it step 2: it serves the newest weights again without a full snapshot,
    where it used to wait for the next one (here 10 publishes later)."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=10, ready_timeout_s=1.5)
        digests: list[dict[str, str]] = []
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"), TensorPublisher(model, cfg) as pub:
            assert pub.engine.signaller is not None
            for step in range(4):
                train_step(model, step)
                digests.append(expected_sha(model))
                emu.set_load_delay(3.0 if step == 1 else 0.0, deployment=EU)
                pub.publish(step, model)
                pub.wait()
                assert pub.engine.signaller.drain(30)
                if step == 1:  # given up on, and still loading: then it serves step 1 after all
                    assert pub.metrics[-1].deployments_behind == [EU] and serves(emu, EU)[0] != pub.metrics[1].identity
                    until("pool-eu's late load", lambda: serves(emu, EU) == (pub.metrics[1].identity, digests[1]))
                assert every_replica(emu, US) == [(pub.metrics[-1].identity, digests[step])]
            ids = [m.identity for m in pub.metrics]
            assert [m.deployments_behind for m in pub.metrics] == [[], [EU], [EU], []]
            assert [m.kind for m in pub.metrics] == ["full"] + ["delta"] * 3
            assert serves(emu, EU) == (ids[3], digests[3])
        assert ledger(emu, EU) == ids  # step 1 signalled once, step 2 by the catch-up
    assert f"deployment {EU} serves {ids[1]} after all" in caplog.text


def test_replicas_hanging_in_a_load_cost_a_full_snapshot_no_readiness_wait(tmp_path: Path) -> None:
    """pool-eu's replicas hang in the load of step 1 (its readiness wait times out). The full snapshot of step 2 is
    signalled to it by its catch-up, on a thread of its own: the publish does not wait ready_timeout_s for it
    again (it used to at every full snapshot), and pool-eu still ends on the newest weights once its load ends."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=2, ready_timeout_s=3.0)
        with TensorPublisher(model, cfg) as pub:
            assert pub.engine.signaller is not None
            for step in range(4):
                train_step(model, step)
                if step == 1:
                    emu.set_load_delay(120.0, deployment=EU)
                pub.publish(step, model)
                pub.wait()
                m = pub.metrics[-1]
                assert m.ok, m.error
                if step == 1:
                    assert m.ready_s >= cfg.ready_timeout_s and m.deployments_behind == [EU]
                if step == 2:  # left to its catch-up, which is waiting for it
                    assert m.kind == "full" and m.ready_s < cfg.ready_timeout_s, m
                    assert m.deployments_behind == m.deployments_catching_up == [EU]
                    until("the catch-up's signal", lambda: m.identity in ledger(emu, EU))
                    emu.set_load_delay(0.0, deployment=EU)  # the hang ends: step 1, then step 2
                assert pub.engine.signaller.drain(30)
                assert serves(emu, US) == (m.identity, expected_sha(model))
                if step != 1:
                    assert serves(emu, EU) == (m.identity, expected_sha(model))
            assert pub.metrics[-1].deployments_behind == []  # back on the deltas


def test_a_slow_deployment_is_left_to_its_catch_up_after_straggler_wait_s(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pool-eu's loads take 2 s from step 1 on. With straggler_wait_s=0.3 each publish waits for it 0.3 s after
    pool-us served the snapshot, then leaves it to its catch-up: the next snapshots reach pool-us at pool-us's pace
    (they were held 2 s each), and the catch-up waits out pool-eu's load, then signals it the deltas after it, in
    order, so it ends on the newest bytes from deltas alone once its loads are quick again."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=10, ready_timeout_s=10.0, straggler_wait_s=0.3)
        digests: list[dict[str, str]] = []
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"), TensorPublisher(model, cfg) as pub:
            sig = pub.engine.signaller
            assert sig is not None
            for step in range(5):
                train_step(model, step)
                digests.append(expected_sha(model))
                emu.set_load_delay(2.0 if step in (1, 2) else 0.0, deployment=EU)
                if step == 3:
                    assert sig.drain(15)  # step 1, waited out; then step 2, signalled by the catch-up
                    assert serves(emu, EU) == (pub.metrics[2].identity, digests[2])
                pub.publish(step, model)
                pub.wait()
                m = pub.metrics[-1]
                assert m.ok, m.error
                assert serves(emu, US) == (m.identity, digests[step])
                if step in (1, 2):
                    assert m.ready_s < 1.5, m  # not the 2 s of pool-eu's load
                    assert m.deployments_behind == m.deployments_catching_up == [EU]
                else:
                    assert m.deployments_behind == [], (step, m.deployments_behind)
            assert sig.drain(15)
        assert [m.kind for m in pub.metrics] == ["full"] + ["delta"] * 4
        assert serves(emu, EU) == (pub.metrics[-1].identity, digests[-1])
        assert ledger(emu, EU) == [m.identity for m in pub.metrics]  # each signalled once, in order
    assert f"deployment {EU} serves {pub.metrics[1].identity}, after straggler_wait_s" in caplog.text


def test_with_straggler_wait_s_a_publish_does_not_wait_for_a_catch_ups_load_in_flight(tmp_path: Path) -> None:
    """pool-eu's loads take 2 s. After straggler_wait_s left step 1's load to its catch-up, that catch-up signals
    step 2 and loads it; steps 3 and 4, published meanwhile, go to pool-us alone, not waiting for that load (a
    publish that joined the catch-up waited for it, a whole slow load, which the option is set to avoid). The
    catch-up signals them after it, in order, and close() waits for its three loads, each within ready_timeout_s
    though not all three together, so pool-eu ends on the newest bytes."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=10, ready_timeout_s=3.0, straggler_wait_s=0.3)
        digests: list[str] = []
        with TensorPublisher(model, cfg) as pub:
            sig = pub.engine.signaller
            assert sig is not None
            for step in range(5):
                train_step(model, step)
                digests.append(expected_sha(model))
                if step == 1:
                    emu.set_load_delay(2.0, deployment=EU)
                if step == 3:  # the catch-up waited out step 1's load and now loads step 2
                    deadline = time.monotonic() + 10
                    while pub.metrics[2].identity not in ledger(emu, EU) and time.monotonic() < deadline:
                        time.sleep(0.02)
                    assert ledger(emu, EU)[-1] == pub.metrics[2].identity
                t0 = time.monotonic()
                pub.publish(step, model)
                pub.wait()
                m = pub.metrics[-1]
                assert m.ok, m.error
                assert serves(emu, US) == (m.identity, digests[step])
                if step >= 1:
                    assert m.deployments_behind == m.deployments_catching_up == [EU], (step, m)
                if step >= 3:
                    assert time.monotonic() - t0 < 1.5, (step, m)  # not the rest of pool-eu's 2 s load
                    assert ledger(emu, EU)[-1] == pub.metrics[2].identity  # still loading it: not signalled
        assert serves(emu, EU) == (pub.metrics[-1].identity, digests[-1])
        assert ledger(emu, EU) == [m.identity for m in pub.metrics]  # each signalled once, in order


def test_with_straggler_wait_s_a_catch_ups_load_is_waited_for_when_no_other_deployment_takes_the_delta(
        tmp_path: Path) -> None:
    """Three deployments: c failed step 1's load (it waits for the next full snapshot), b's catch-up loads step 2
    slowly, and a's hot-load manager is down when step 3 is published. Only b can take step 3: it is waited for
    and signalled, not left out because c, which serves no parent of the delta, would have been "another one"."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    a, b, c = (f"accounts/acct/deployments/{n}" for n in "abc")
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["a", "b", "c"], deployments_required="any",
                     full_every=100, ready_timeout_s=10.0, straggler_wait_s=0.2)
        with TensorPublisher(model, cfg) as pub:
            sig = pub.engine.signaller
            assert sig is not None
            for step in range(4):
                train_step(model, step)
                if step == 1:
                    emu.fail_next_loads(1, deployment=c)
                    emu.set_load_delay(1.5, deployment=b)
                if step == 3:  # b's catch-up loads step 2; c's asked after step 1 and ended
                    deadline = time.monotonic() + 15
                    while (ledger(emu, b)[-1] != pub.metrics[2].identity or c in sig._lanes) and \
                            time.monotonic() < deadline:
                        time.sleep(0.02)
                    emu.set_manager_up(False, deployment=a)
                pub.publish(step, model)
                pub.wait()
                m = pub.metrics[-1]
                assert m.ok, (step, m.error)
            assert m.deployments_behind == [a, c]
            assert serves(emu, b) == (m.identity, expected_sha(model))
            emu.set_manager_up(True, deployment=a)
            emu.set_load_delay(0.0, deployment=b)
        ids = [m.identity for m in pub.metrics]
        assert ledger(emu, b) == ids and ledger(emu, c) == ids[:2]
