"""Several deployments on one bucket with ``deployments_required="any"``: one that fails is left behind while the
others take every snapshot, it catches up by loading those it missed in order (or at the next full one after a
failed load), and retention keeps what it serves. Slow or hanging loads are in test_deployments_slow_loads.py, a
hot-load manager that is down in test_deployments_managers.py; both use the helpers here."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import pytest

from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.engine import PublishError
from fsdp_hotload.engine.signal import Signaller
from fsdp_hotload.publish import TensorPublisher
from tests.test_emulator_restart import restarted
from tests.publisher_helpers import API_KEY, config, expected_sha, make_model, train_step

US, EU = "accounts/acct/deployments/pool-us", "accounts/acct/deployments/pool-eu"


def every_replica(emu: HotLoadEmulator, deployment: str) -> list[tuple[str | None, dict[str, str]]]:
    return [(r["identity"], {k: t["digest"] for k, t in r["tensors"].items()})
            for r in emu.state()["deployments"][deployment]["replicas"]]


def serves(emu: HotLoadEmulator, deployment: str) -> tuple[str | None, dict[str, str]]:
    (only,) = every_replica(emu, deployment)
    return only


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
        hinted = {h["identity"] for h in emu.state()["deployments"][EU]["hints"]}
        assert hinted == {pub.metrics[0].identity, pub.metrics[1].identity}  # none once it was behind
        assert {h["identity"] for h in emu.state()["deployments"][US]["hints"]} == {m.identity for m in pub.metrics}
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


def test_retention_keeps_what_any_replica_of_a_deployment_left_behind_serves(tmp_path: Path) -> None:
    """A deployment whose replicas split on a delta (one loads it, one fails) and that then fails the next full
    snapshot: the delta is served by one of its replicas, so retention must keep it, though the deployment's
    confirmed snapshot is older and a newer one was signalled since."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=3, keep_last=1)
        with TensorPublisher(model, cfg) as pub:
            for step in range(5):
                train_step(model, step)
                if step == 1:
                    emu.fail_next_loads(1, replica=1, deployment=EU)
                if step == 3:
                    emu.fail_next_loads(1, deployment=EU)  # both replicas fail the full
                if step == 1:
                    digest_1 = expected_sha(model)
                pub.publish(step, model)
                pub.wait()
                assert pub.metrics[-1].ok and pub.metrics[-1].deployments_behind == ([EU] if step else [])
            names = {p.name for p in Path(bucket).iterdir()}
            assert pub.metrics[2].identity not in names  # retention did run
            emu.restart_replica(0, deployment=EU)  # it served step 1: rebuilt from the bucket
            rep = restarted(emu, 0, deployment=EU)
            assert (rep["stage"], rep["error"]) == ("done", None), rep
            (_, first), _ = every_replica(emu, EU)
            assert rep["identity"] == pub.metrics[1].identity and first == digest_1


def test_close_ends_a_deployment_left_behind_on_the_final_weights(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The step close() publishes would be a delta, which a deployment left behind is not signalled: it is full
    then, so every deployment ends on the trainer's final bytes. Where close() has nothing more to publish, it
    says which deployment is behind and what it serves."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     publish_every=2)
        pub = TensorPublisher(model, cfg)
        for step in range(4):  # steps 0 and 2 are published; 3 is the newest, left to close()
            train_step(model, step)
            if step == 2:
                emu.fail_next_loads(1, deployment=EU)
            pub.publish(step, model)
            pub.wait()
        pub.close()
        assert [(m.step, m.kind, m.deployments_behind) for m in pub.metrics] == \
            [(0, "full", []), (2, "delta", [EU]), (3, "full", [])]
        assert serves(emu, US) == serves(emu, EU) == (pub.metrics[-1].identity, expected_sha(model))

        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any")
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"), TensorPublisher(model, cfg) as pub:
            pub.publish(0, model)
            pub.wait()
            emu.fail_next_loads(1, deployment=EU)
            train_step(model, 4)
            pub.publish(1, model)  # the newest step: close() has nothing more to publish
        assert pub.metrics[-1].deployments_behind == [EU]
        assert f"{EU} serves {pub.metrics[0].identity}" in caplog.text and "closing with deployment(s) left" \
            in caplog.text


def ledger(emu: HotLoadEmulator, deployment: str) -> list[str]:
    return [r["identity"] for r in emu.state()["deployments"][deployment]["ledger"]]


@pytest.mark.parametrize("status", [400, 501])
def test_a_deployment_that_refused_signals_catches_up_on_the_deltas_it_missed(
        status: int, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """pool-eu refuses the signals of step 1 (and the first catch-up's; a 4xx, or a 5xx the client does not retry:
    both are sent again): it is left behind, and once it takes
    signals again it is signalled steps 1 and 2 in order, each after the one before is served, so it serves the
    newest weights before the next full snapshot, from deltas alone. Retention (keep_last=1) keeps what it loads.
    No snapshot is held for it: the publishes of the others take no longer."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=10, keep_last=1)
        digests: list[dict[str, str]] = []
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"), TensorPublisher(model, cfg) as pub:
            for step in range(5):
                train_step(model, step)
                digests.append(expected_sha(model))
                if step == 1:
                    emu.reject_next_signals(2, status=status, message="injected: refused", deployment=EU)
                pub.publish(step, model)
                pub.wait()
                assert pub.engine.signaller is not None and pub.engine.signaller.drain(30)
                m = pub.metrics[-1]
                assert m.ok, m.error
                assert m.deployments_behind == ([EU] if step in (1, 2) else []), (step, m.deployments_behind)
                assert every_replica(emu, US) == [(m.identity, digests[step])] * 2
                if step != 1:  # step 1: the catch-up's signal was refused too; from step 2 on it serves the newest
                    assert every_replica(emu, EU) == [(m.identity, digests[step])] * 2
                else:
                    assert every_replica(emu, EU) == [(pub.metrics[0].identity, digests[0])] * 2
        assert [m.kind for m in pub.metrics] == ["full"] + ["delta"] * 4  # no full snapshot for it
        assert ledger(emu, EU) == [m.identity for m in pub.metrics]  # each once, in order
        rows = emu.state()["deployments"][EU]["ledger"]
        assert [r["previous"] for r in rows[1:]] == [m.identity for m in pub.metrics[:-1]]
    said = caplog.text
    assert "catch-up stopped at " + pub.metrics[1].identity in said
    assert f"deployment {EU} caught up: serves {pub.metrics[2].identity} (2 snapshot(s) loaded" in said


def test_a_deployment_down_at_a_full_snapshot_catches_up_from_it(tmp_path: Path) -> None:
    """pool-eu refuses signals from step 1 through the full snapshot of step 3 (and a catch-up after it): when it
    takes signals again it loads that full snapshot and the deltas after it, never the deltas of the chain
    before (deleted by retention meanwhile, keep_last=1), and serves the newest bytes."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=3, keep_last=1)
        with TensorPublisher(model, cfg) as pub:
            for step in range(6):
                train_step(model, step)
                if step == 1:  # the main signals of steps 1-3 and the catch-ups after steps 1 and 3 (step 2 had
                    emu.reject_next_signals(5, status=400, deployment=EU)  # none: its next, step 1, was refused)
                pub.publish(step, model)
                pub.wait()
                assert pub.engine.signaller is not None and pub.engine.signaller.drain(30)
                m = pub.metrics[-1]
                assert m.ok and m.deployments_behind == ([EU] if step in (1, 2, 3, 4) else []), (step, m)
        kinds = [m.kind for m in pub.metrics]
        assert kinds == ["full", "delta", "delta", "full", "delta", "delta"]
        ids = [m.identity for m in pub.metrics]
        assert ledger(emu, EU) == [ids[0], ids[3], ids[4], ids[5]]
        assert serves(emu, EU) == serves(emu, US) == (ids[5], expected_sha(model))


def test_close_waits_for_a_deployment_catching_up(tmp_path: Path) -> None:
    """Loads slow enough that pool-eu still catches up when close() starts: close() waits for it, and it ends on
    the trainer's final bytes like the others."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     publish_on_close=False)
        pub = TensorPublisher(model, cfg)
        for step in range(3):
            train_step(model, step)
            if step == 1:
                emu.reject_next_signals(2, status=400, deployment=EU)
                emu.set_load_delay(0.3)
            pub.publish(step, model)
            pub.wait()
        assert pub.metrics[-1].deployments_behind == [EU]
        pub.close()
        assert serves(emu, US) == serves(emu, EU) == (pub.metrics[-1].identity, expected_sha(model))


def test_a_deployment_whose_loads_are_slow_rejoins_the_publishes_after_catching_up(tmp_path: Path) -> None:
    """Loads slower than an upload, publishes back to back: the catch-up after step 1 still loads step 1 when step
    2 is signalled. pool-eu is signalled step 2 once it ends, with the others, instead of being left out again
    (and caught up after each publish, behind for the rest of the job)."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any")
        emu.set_load_delay(0.3)
        with TensorPublisher(model, cfg) as pub:
            for step in range(6):
                train_step(model, step)
                if step == 1:
                    emu.reject_next_signals(1, status=400, deployment=EU)
                pub.publish(step, model)
                pub.wait()
            assert [m.deployments_behind for m in pub.metrics] == [[], [EU], [], [], [], []]
            assert serves(emu, EU) == serves(emu, US) == (pub.metrics[-1].identity, expected_sha(model))
            hinted = {h["identity"] for h in emu.state()["deployments"][EU]["hints"]}
            assert {m.identity for m in pub.metrics[3:]} <= hinted  # hinted again once it had rejoined


@pytest.mark.parametrize("lane_ends_first", [False, True], ids=["as-it-comes", "catch-up-ends-first"])
def test_close_publishes_a_delta_for_a_deployment_catching_up_and_waits_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lane_ends_first: bool) -> None:
    """pool-eu was catching up at the last publish: the step close() publishes is a delta (its catch-up takes it;
    a full snapshot is for a deployment that cannot catch up), and close() waits until it serves it.

    ``catch-up-ends-first``: the publisher's thread reads who is catching up only once the catch-up it started has
    ended (refused at once, while the publisher's thread was descheduled: a loaded machine); it counts still."""
    if lane_ends_first:
        catch_up = Signaller._catch_up

        def catch_up_then_wait(self: Signaller) -> set[str]:
            started = catch_up(self)
            assert self.drain(30)
            return started

        monkeypatch.setattr(Signaller, "_catch_up", catch_up_then_wait)
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     publish_every=2)
        emu.set_load_delay(0.2)
        pub = TensorPublisher(model, cfg)
        for step in range(6):  # 0, 2 and 4 are published; 5 is left to close()
            train_step(model, step)
            if step == 2:  # its signal and the catch-up's after it
                emu.reject_next_signals(2, status=400, deployment=EU)
            pub.publish(step, model)
            pub.wait()
        assert [(m.deployments_behind, m.deployments_catching_up) for m in pub.metrics] == \
            [([], []), ([EU], [EU]), ([EU], [EU])]  # a catch-up started after each (the first one's refused)
        pub.close()
        assert [(m.step, m.kind) for m in pub.metrics] == [(0, "full"), (2, "delta"), (4, "delta"), (5, "delta")]
        assert serves(emu, US) == serves(emu, EU) == (pub.metrics[-1].identity, expected_sha(model))


def test_closing_on_an_exception_does_not_wait_for_a_catch_up(tmp_path: Path) -> None:
    """An exception leaving the ``with`` block: close() cancels a catch-up at once (the job may be hung, and the
    user waits for the error), rather than waiting for every snapshot it has left."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any")
        with pytest.raises(ValueError, match="diverged"):
            with TensorPublisher(model, cfg) as pub:
                for step in range(6):
                    train_step(model, step)
                    if step == 1:
                        emu.reject_next_signals(5, status=400, deployment=EU)  # steps 1-4 and the catch-ups
                    if step == 5:
                        emu.set_load_delay(1.0)  # from here a catch-up of 5 snapshots takes 5 s
                    pub.publish(step, model)
                    pub.wait()
                assert pub.metrics[-1].deployments_catching_up == [EU]
                raise ValueError("training diverged")
        assert len(ledger(emu, EU)) < 3  # cancelled at the first or second load of its catch-up


def until(what: str, ok: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("fault", ["refused", "manager-down"])
def test_a_deployment_left_to_its_catch_up_is_signalled_once_the_others_fail(tmp_path: Path, fault: str) -> None:
    """pool-eu's load of step 1 outlasts its wait (then ends), so the full snapshot of step 2 leaves it to its
    catch-up while pool-us is signalled. ``refused``: pool-us refuses every signal from step 2, so step 2 fails
    everywhere; step 3 signals pool-eu again, which then serves every later step, where it used to be left out of
    every publish while pool-us failed. ``manager-down``: pool-us's manager is down from step 2; the status read
    before the signal finds it so, pool-us is not signalled (it used to be, and fail), and pool-eu serves step 2."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=2, ready_timeout_s=1.5, keep_training_on_error=True, send_hints=False)
        with TensorPublisher(model, cfg) as pub:
            assert pub.engine.signaller is not None
            for step in range(6):
                train_step(model, step)
                emu.set_load_delay(3.0 if step == 1 else 0.0, deployment=EU)
                if step == 2:
                    until("pool-eu's late load", lambda: serves(emu, EU)[0] == pub.metrics[1].identity)
                    if fault == "refused":
                        emu.reject_next_signals(100, status=400, deployment=US)
                    else:
                        emu.set_manager_up(False, US)
                pub.publish(step, model)
                pub.wait()
                assert pub.engine.signaller.drain(30)
                if step >= 3:
                    assert serves(emu, EU) == (pub.metrics[-1].identity, expected_sha(model))
            served = [i != 2 or fault == "manager-down" for i in range(6)]
            assert [m.ok for m in pub.metrics] == served
            first = 2 if served[2] else 3
            assert [m.deployments_behind for m in pub.metrics[first:]] == [[US]] * (6 - first)
        assert ledger(emu, EU) == [m.identity for i, m in enumerate(pub.metrics) if served[i]]
        assert emu.state()["deployments"][US]["premature_signals"] == 0


def test_a_catch_up_loading_across_publishes_counts_as_catching_up(tmp_path: Path) -> None:
    """pool-eu's catch-up loads steps 2-6 at 2 s a load while steps 6 and 8 are published: it is reported as
    catching up (the snapshot it loads was signalled, which had made it look like one that only asks after an
    earlier signal), so close() publishes the last step as a delta that its catch-up takes, not a full snapshot."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], deployments_required="any",
                     full_every=20, publish_every=2, send_hints=False)
        pub = TensorPublisher(model, cfg)
        assert pub.engine.signaller is not None
        for step in range(0, 10, 2):
            train_step(model, step)
            if step == 2:
                emu.reject_next_signals(3, status=400, message="injected", deployment=EU)
            if step == 6:
                emu.set_load_delay(1.0, deployment=EU)
            pub.publish(step, model)
            pub.wait()
            if step < 6:
                assert pub.engine.signaller.drain(30)
        assert [m.deployments_catching_up for m in pub.metrics[1:]] == [[EU]] * 4
        train_step(model, 9)
        pub.publish(9, model)  # skipped (publish_every=2): close() publishes it
        pub.close()
        assert [m.kind for m in pub.metrics] == ["full"] + ["delta"] * 5
        assert serves(emu, EU) == (pub.metrics[-1].identity, expected_sha(model))
        assert ledger(emu, EU) == [m.identity for m in pub.metrics]
