"""close() on several ranks (in-process threads): the ranks vote on publishing the newest step, and no rank waits
for another in that vote nor publishes alone, whether a rank's close times out, gives up on taking the publisher,
closes on an exception, failed its busy agreement, or the vote itself fails."""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.engine.publisher import Publisher
from fsdp_hotload.layout import TensorSpec
from fsdp_hotload.publish import WholeChunk
from tests.snapshots import rebuild_accepted
from tests.test_close import _HangingWeightWrites
from tests.thread_comm import Meeting, ThreadComm, run_ranks


@pytest.mark.parametrize("objector", [None, 1])
def test_ranks_vote_on_the_newest_step_at_close(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                objector: int | None) -> None:
    """Two ranks (threads): both publish the skipped newest step, rebuilt bit-exact from the bucket, or, when one
    rank cannot (its publish() was given tensors that close() was not), neither does and nothing hangs."""
    bucket = str(tmp_path / "bucket")
    names, n = ["a", "b"], 4096
    tensors = [torch.zeros(n), torch.zeros(n)]
    specs = [TensorSpec(name, (n,), "F32") for name in names]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    cfg = HotloadConfig(bucket_url=bucket, hf_config_dir=str(hf), snapshot_dtype="float32", publish_every=3,
                        busy_policy="skip", full_every=100)
    data, ctrl = Meeting(2), Meeting(2)
    pubs: list[Any] = [None, None]
    failures: list[BaseException] = []

    def make(rank: int) -> None:
        chunk = WholeChunk(names[rank], (n,), "F32", "flat", Box.flat(0, n), tensors[rank])
        pubs[rank] = Publisher([chunk], specs, cfg, comm=ThreadComm(data, rank, 2), ctrl=ThreadComm(ctrl, rank, 2))

    def train(rank: int) -> None:
        try:
            for step in range(5):
                tensors[rank].fill_(step + 0.5 * rank)
                pubs[rank].publish(step, [tensors[rank]] if rank == objector else None)
                pubs[rank].wait()
            pubs[rank].close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        for target in (make, train):
            run_ranks(target, 2)
    assert not failures, failures
    records = pubs[0].metrics.records
    assert all(m.ok for m in records)
    # Step 3 is skipped: without early agreement its vote was cast as step 0 took the only slot.
    if objector is None:
        assert [m.step for m in records] == [0, 4] and records[-1].skipped_before == 1
        rebuilt = rebuild_accepted(bucket, records)[records[-1].identity]
        want = {name: RawTensor.from_any(t).digest() for name, t in zip(names, tensors)}
        assert {k: t.digest() for k, t in rebuilt.items()} == want
    else:
        assert [m.step for m in records] == [0]
        assert "step 4 is not published at close: another rank cannot publish it" in caplog.text
        assert "close() was not given them again" in caplog.text


def test_a_rank_whose_close_times_out_still_votes_so_the_others_do_not_wait_for_it(tmp_path: Path) -> None:
    """In-process ranks. Rank 0's write hangs past its close(timeout=0.5); the write returns at 2 s, so rank 1's
    close (no deadline) sees the snapshot end and votes on publishing the newest step. Rank 0 used to give up
    before that vote and never take part in it, leaving rank 1 waiting in it until the trainer group's timeout
    (over an hour by default; 10 s here). Rank 0 now votes (against) past its deadline, without waiting for the
    others' votes (a deadline bounds the vote too), and gives the snapshot up, as close_timeout_s says; rank 1's
    vote ends with rank 0's, and its close raises that the snapshot was given up. Neither waits for the other."""
    import time

    import fsspec

    from fsdp_hotload.engine import PublishError
    from fsdp_hotload.storage import Storage

    bucket = str(tmp_path / "bucket")
    names, n = ["a", "b"], 1024
    specs = [TensorSpec(name, (n,), "BF16") for name in names]
    cfg = HotloadConfig(bucket_url=bucket, full_every=100)
    data, ctrl = Meeting(2, timeout_s=30.0), Meeting(2, timeout_s=10.0)
    hanging = _HangingWeightWrites(fsspec.filesystem("file"))
    pubs: list[Any] = [None, None]
    raised: dict[int, BaseException | None] = {0: None, 1: None}
    took: dict[int, float] = {}

    def make(rank: int) -> None:
        chunk = WholeChunk(names[rank], (n,), "BF16", "flat", Box.flat(0, n), torch.zeros(n, dtype=torch.bfloat16))
        storage = Storage(bucket, fs=hanging) if rank == 0 else Storage(bucket)
        pubs[rank] = Publisher([chunk], specs, cfg, comm=ThreadComm(data, rank, 2), ctrl=ThreadComm(ctrl, rank, 2),
                               storage=storage)

    def run(rank: int) -> None:
        pubs[rank].publish(0)
        pubs[rank].publish(1)  # skipped (busy): the newest step, which close votes on
        t0 = time.monotonic()
        try:
            pubs[rank].close(timeout=0.5 if rank == 0 else None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised[rank] = exc
        took[rank] = time.monotonic() - t0

    run_ranks(make, 2)
    hanging.armed = True
    unstick = threading.Timer(2.0, hanging.release.set)
    unstick.start()
    try:
        run_ranks(run, 2, timeout_s=60)
    finally:
        hanging.release.set()
        unstick.cancel()
    assert isinstance(raised[0], PublishError) and "close() gave up after 0.5 s" in str(raised[0]), raised
    assert isinstance(raised[1], PublishError) and "close() gave up on it" in str(raised[1]), raised  # not a hang
    assert max(took.values()) < 8, took
    # Rank 0's thread, which close() left behind, records step 0's end once its write returns (at 2 s): maybe after
    # rank 1's close returned, on a busy machine.
    deadline = time.monotonic() + 30
    while not pubs[0].metrics.records and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [(m.step, m.ok) for m in pubs[0].metrics.records] == [(0, False)]  # step 1 not published: rank 0 was late


def _thread_rank_publishers(bucket: str, ctrl_comm: type = ThreadComm, **settings: Any) -> list[Any]:
    """Two in-process ranks' publishers of one 1024-element bf16 tensor each (a, b), step 1 left to publish at close
    (``publish_every=2``); ``ctrl_comm`` makes the trainer's side group."""
    from fsdp_hotload.storage import Storage

    names, n = ["a", "b"], 1024
    specs = [TensorSpec(name, (n,), "BF16") for name in names]
    cfg = HotloadConfig(bucket_url=bucket, **{"publish_every": 2, "busy_policy": "wait", **settings})
    data, ctrl = Meeting(2, timeout_s=20.0), Meeting(2, timeout_s=20.0)
    pubs: list[Any] = [None, None]

    def make(rank: int) -> None:
        chunk = WholeChunk(names[rank], (n,), "BF16", "flat", Box.flat(0, n), torch.zeros(n, dtype=torch.bfloat16))
        pubs[rank] = Publisher([chunk], specs, cfg, comm=ThreadComm(data, rank, 2), ctrl=ctrl_comm(ctrl, rank, 2),
                               storage=Storage(bucket))

    run_ranks(make, 2)
    return pubs


def test_close_timeout_bounds_the_vote_and_no_rank_publishes_alone(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """In-process ranks, step 1 left to publish at close. Rank 1 reaches close() 4 s after rank 0 (a slow write of
    its own after the last step); rank 0's close has a 1 s deadline. Rank 0 waited in the vote past its deadline
    until rank 1 came (until the trainer group's timeout if it never does). Now it stops at its deadline and
    publishes nothing more; rank 1's vote, which ends at once with rank 0's, sees that rank 0 stopped, so it does
    not publish step 1 alone either (a snapshot rank 0 would never join)."""
    import time

    pubs = _thread_rank_publishers(str(tmp_path / "bucket"))
    raised: dict[int, BaseException | None] = {0: None, 1: None}
    took: dict[int, float] = {}

    def run(rank: int) -> None:
        pubs[rank].publish(0)
        pubs[rank].publish(1)  # not a publish step: the newest one, which close votes on
        pubs[rank].wait()
        time.sleep(4.0 if rank == 1 else 0.0)
        t0 = time.monotonic()
        try:
            pubs[rank].close(timeout=1.0 if rank == 0 else None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised[rank] = exc
        took[rank] = time.monotonic() - t0

    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        run_ranks(run, 2, timeout_s=60)
    said = [r.getMessage() for r in caplog.records]
    assert raised == {0: None, 1: None}, raised
    assert took[0] < 3 and took[1] < 3, took  # rank 0 at its deadline, not when rank 1 came (4 s)
    assert [(m.step, m.ok) for m in pubs[0].metrics.records] == [(0, True)]
    assert len([line for line in said if "step 1 is not published at close" in line
                and "rank 0 stopped waiting for the others at close()'s deadline" in line]) == 2, said


def test_a_watchdog_close_that_cannot_take_the_publisher_ends_the_others_vote(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In-process ranks, step 1 left to publish at close. On rank 0 another call holds the publisher (its training
    thread stuck in a publish), and a watchdog's close(timeout=0.5) gives up on taking it. That close returned
    without a word for the others, so rank 1's close waited in the vote for rank 0 until the side group's timeout
    (20 s here); now it leaves a note, and rank 1 stops at once, publishing nothing more."""
    import time

    from fsdp_hotload.engine import PublishError

    pubs = _thread_rank_publishers(str(tmp_path / "bucket"), collective_timeout_s=20)
    raised: dict[int, BaseException | None] = {0: None, 1: None}
    took: dict[int, float] = {}

    def run(rank: int) -> None:
        pubs[rank].publish(0)
        pubs[rank].publish(1)
        pubs[rank].wait()
        if rank == 1:
            time.sleep(0.5)
            close(1, None)
            return
        with pubs[0]._api_lock:  # the training thread, stuck inside a publish
            watchdog = threading.Thread(target=close, args=(0, 0.5))
            watchdog.start()
            watchdog.join()

    def close(rank: int, timeout: float | None) -> None:
        t0 = time.monotonic()
        try:
            pubs[rank].close(timeout=timeout)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised[rank] = exc
        took[rank] = time.monotonic() - t0

    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        run_ranks(run, 2, timeout_s=60)
    assert raised[1] is None and took[1] < 10, (raised, took)  # not the side group's timeout (20 s)
    assert isinstance(raised[0], PublishError) and "with no snapshot in flight: another call held the publisher" in str(
        raised[0]), raised
    assert [(m.step, m.ok) for m in pubs[0].metrics.records] == [(0, True)]
    assert any("step 1 is not published at close" in r.getMessage() and "rank 0 gave up on close()" in r.getMessage()
               for r in caplog.records), caplog.text


def test_a_busy_agreement_left_pending_at_close_ends_when_the_other_rank_closes_on_an_exception(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In-process ranks, skip policy. Rank 1 raises before its step 1 and closes on it; rank 0's step 1 was
    skipped (busy) and started the agreement for the next publish, which rank 1 never starts. Rank 0's clean close
    read it with no bound before its vote, so it waited until the trainer group's timeout (over an hour by default;
    20 s here) and raised; now rank 1's note ends that wait too, and rank 0 publishes nothing more."""
    import time

    pubs = _thread_rank_publishers(str(tmp_path / "bucket"), busy_policy="skip", publish_every=1)
    raised: dict[int, BaseException | None] = {0: None, 1: None}
    took: dict[int, float] = {}

    def run(rank: int) -> None:
        pubs[rank].publish(0)
        if rank == 0:
            assert pubs[0].publish(1) is False  # busy: step 0's snapshot held the slot when its agreement began
        t0 = time.monotonic()
        try:
            pubs[rank].close(raise_errors=rank == 0)
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised[rank] = exc
        took[rank] = time.monotonic() - t0

    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        run_ranks(run, 2, timeout_s=60)
    assert raised == {0: None, 1: None}, raised
    assert took[0] < 10, took  # not the group's timeout (20 s)
    assert [(m.step, m.ok) for m in pubs[0].metrics.records] == [(0, True)]
    assert "step 1 is not published at close: no vote can be taken: rank 1 closes on an exception" in caplog.text


class _BusyAgreementFailsOnRank0(ThreadComm):
    """The skip policy's "is some rank busy?" reduction fails on rank 0 only (it says busy, so rank 1 skips too)."""

    def allreduce_max_async(self, value: int) -> Any:
        done = super().allreduce_max_async(1 if self.rank == 0 else value)
        if self.rank != 0:
            return done

        def result(timeout: float | None = None) -> int:
            raise RuntimeError("injected: Connection closed by peer")

        return result


def test_a_rank_whose_busy_agreement_failed_does_not_leave_the_others_waiting_in_the_vote(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In-process ranks, skip policy, step 1 skipped on both and left to publish at close. Rank 0's busy agreement
    failed (on its side only), so it takes no vote; rank 1's vote waited for it until the side group's timeout
    (20 s here, over an hour by default). Now rank 0 leaves the note, and rank 1 stops at once."""
    import time

    pubs = _thread_rank_publishers(str(tmp_path / "bucket"), _BusyAgreementFailsOnRank0, busy_policy="skip",
                                   publish_every=1, collective_timeout_s=20, keep_training_on_error=True)
    took: dict[int, float] = {}

    def run(rank: int) -> None:
        pubs[rank].publish(0)
        assert pubs[rank].publish(1) is False  # busy on both: rank 0's agreement failed, and it said busy
        t0 = time.monotonic()
        pubs[rank].close()
        took[rank] = time.monotonic() - t0

    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        run_ranks(run, 2, timeout_s=60)
    assert took[1] < 10, took  # not the side group's timeout
    assert [(m.step, m.ok) for m in pubs[0].metrics.records] == [(0, True)]
    assert any("step 1 is not published at close" in r.getMessage() and "rank 0 cannot vote" in r.getMessage()
               for r in caplog.records), caplog.text


class _BrokenVoteComm(ThreadComm):
    """The job's store fails in close()'s vote (as when its host is gone)."""

    def count(self, key: str, n: int) -> int:
        from fsdp_hotload.engine.comm import StoreError

        raise StoreError("injected: Connection reset by peer")


@pytest.mark.parametrize("keep", [False, True], ids=["raise", "keep_training_on_error"])
def test_a_failed_vote_is_raised_by_close_unless_errors_are_only_logged(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture,
                                                                       keep: bool) -> None:
    """In-process ranks, step 1 left to publish at close, and the vote on it fails. close() raised that failure
    even with keep_training_on_error, which logs every other publishing error; now it logs it there (and still
    raises it otherwise). No rank publishes step 1 either way."""
    from fsdp_hotload.engine import PublishError

    pubs = _thread_rank_publishers(str(tmp_path / "bucket"), _BrokenVoteComm, keep_training_on_error=keep)
    raised: dict[int, BaseException | None] = {0: None, 1: None}

    def run(rank: int) -> None:
        pubs[rank].publish(0)
        pubs[rank].publish(1)
        try:
            pubs[rank].close()
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised[rank] = exc

    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        run_ranks(run, 2, timeout_s=60)
    if keep:
        assert raised == {0: None, 1: None}, raised
        assert caplog.text.count("the ranks' vote on publishing the newest step at close failed") == 2, caplog.text
    else:
        assert all(isinstance(e, PublishError) and "injected: Connection reset by peer" in str(e)
                   for e in raised.values()), raised
    assert [(m.step, m.ok) for m in pubs[0].metrics.records] == [(0, True)]
