"""Several deployments on one bucket with ``deployments_required="any"``: one that fails is left behind while the
others take every snapshot, it catches up by loading those it missed in order (or at the next full one after a
failed load), and retention keeps what it serves."""
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
