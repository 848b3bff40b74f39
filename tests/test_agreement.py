"""close()'s vote on publishing the newest step, taken in the job's key-value store: every rank that reads a
decision reads the same one, a rank that withdraws or gives up ends it for all, and nothing is left pending on
the trainer's side group. Ranks are threads (tests/thread_comm.py); the store's bounds are checked against a real
torch TCPStore whose host is frozen."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

from fsdp_hotload.engine import PublishError
from fsdp_hotload.engine.agreement import Agreements, NoVote
from fsdp_hotload.engine.comm import STORE_READ_S, JobStore, StoreError, StoreTimeout
from tests.thread_comm import Meeting, ThreadComm, run_ranks


class _StoreOnly(ThreadComm):
    """A side group on which the vote must take no reduction (one left pending holds the process's exit)."""

    def allreduce_max_async(self, value: int) -> Callable[..., int]:
        raise AssertionError("close()'s vote took a reduction on the trainer's side group")


def _agreements(world: int, comm: type = _StoreOnly, wait_s: float = 30.0) -> list[Agreements]:
    meeting = Meeting(world, timeout_s=30.0)
    return [Agreements(comm(meeting, rank, world), key="0123abcd-00", wait_s=wait_s) for rank in range(world)]


def _vote_all(agreements: list[Agreements], values: list[int], delays: list[float],
              deadlines: list[float | None] | None = None) -> dict[int, Any]:
    """Every rank votes after its delay; what each got (an int, or the exception it raised)."""
    got: dict[int, Any] = {}

    def run(rank: int) -> None:
        time.sleep(delays[rank])
        try:
            got[rank] = agreements[rank].vote(values[rank], None if deadlines is None else deadlines[rank])
        except PublishError as exc:
            got[rank] = exc

    run_ranks(run, len(agreements), timeout_s=60)
    return got


@pytest.mark.parametrize("values, expected", [([0, 0, 0], 0), ([0, 1, 0], 1), ([1, 1, 1], 1)])
def test_every_rank_gets_the_same_answer_and_one_objection_is_enough(values: list[int], expected: int) -> None:
    agreements = _agreements(3)
    got = _vote_all(agreements, values, delays=[0.2, 0.0, 0.4])
    assert got == {0: expected, 1: expected, 2: expected}
    again = _vote_all(agreements, [0, 0, 0], delays=[0.0, 0.1, 0.0])  # a second vote is a vote of its own
    assert again == {0: 0, 1: 0, 2: 0}


def test_a_rank_that_arrives_after_another_gave_up_does_not_publish_alone() -> None:
    """Rank 0 stops waiting at its deadline before rank 1 votes. With the reduction, rank 1's vote then ended with
    every rank's (rank 0's was in), and rank 1 could publish a snapshot rank 0 never joins unless it happened to
    read rank 0's note; the decision is now set once, and rank 1 reads rank 0's."""
    agreements = _agreements(2)
    with pytest.raises(NoVote, match="rank 0 stopped waiting for the others at close"):
        agreements[0].vote(0, time.monotonic())
    with pytest.raises(NoVote, match="rank 0 stopped waiting for the others at close"):
        agreements[1].vote(0, None)


def test_a_rank_that_withdraws_ends_the_vote_the_others_wait_in() -> None:
    agreements = _agreements(3)
    threading.Timer(0.5, agreements[2].withdraw, args=("closes on an exception",)).start()
    t0 = time.monotonic()
    got = _vote_all(agreements[:2], [0, 0], delays=[0.0, 0.0])
    took = time.monotonic() - t0
    assert all(isinstance(e, NoVote) and "rank 2 closes on an exception" in str(e) for e in got.values()), got
    assert took < 20, took  # not their wait_s (30 s)


def test_rank_0_returns_from_the_vote_only_once_every_rank_read_the_decision() -> None:
    """With env:// init rank 0's process hosts the store: a rank 0 that decided last and exited at once left the
    others, between two polls, with no store to read the decision from (their close() raised in a clean run)."""
    agreements = _agreements(3)
    meeting = agreements[0].ctrl.meeting
    read_when_rank_0_returned: list[str | None] = []

    def run(rank: int) -> None:
        time.sleep(0.3 if rank == 0 else 0.0)  # rank 0 arrives last and decides; the others are polling
        assert agreements[rank].vote(0, None) == 0
        if rank == 0:
            read_when_rank_0_returned.append(meeting.notes.get("hotload/0123abcd-00/vote0/read"))

    run_ranks(run, 3, timeout_s=60)
    assert read_when_rank_0_returned == ["3"]


def test_without_a_deadline_the_vote_waits_the_side_groups_timeout_not_forever() -> None:
    agreements = _agreements(2, wait_s=0.5)
    with pytest.raises(NoVote, match="rank 0 stopped waiting"):
        agreements[0].vote(0, None)  # rank 1 never comes


class _NoStore(ThreadComm):
    """Rank 0's job store cannot be reached (its host is gone); the others' can."""

    def count(self, key: str, n: int) -> int:
        if self.rank == 0:
            raise StoreError("injected: Connection reset by peer")
        return super().count(key, n)


def test_a_rank_that_cannot_reach_the_store_fails_its_vote_and_the_others_do_not_publish() -> None:
    """Rank 0's failure is raised (by close(), as any failed collective); rank 1 reads rank 0's note (where the
    store is gone for all, it fails the same way) and publishes nothing."""
    agreements = _agreements(2, comm=_NoStore)
    got = _vote_all(agreements, [0, 0], delays=[0.0, 0.3])
    assert type(got[0]) is PublishError and "rank 0 could not reach the job's store" in str(got[0]), got
    assert isinstance(got[1], NoVote) and "rank 0 could not reach the job's store" in str(got[1]), got


@pytest.fixture
def store_host() -> Any:
    """A torch TCPStore served by a process of its own (so that it can be frozen); its port."""
    code = ("import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, None, True, "
            "wait_for_workers=False); print(s.port, flush=True); time.sleep(300)")
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        yield host, int(host.stdout.readline())
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait()


def _freeze(pid: int) -> None:
    """SIGSTOP, then wait until every thread of the process is stopped: the signal is delivered asynchronously, and
    a server thread still running when the next request arrives answers it (seen once on a loaded 2-core CI)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
        if states and all(s in "tT" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {states}"
        time.sleep(0.01)


def test_a_store_whose_host_stops_answering_is_given_up_on_within_its_bound(store_host: Any) -> None:
    """A frozen host (a node lost without a TCP reset looks the same) held a read past the store's own timeout
    (60 s here, 30 minutes by default); each call is now waited for STORE_READ_S, the calls made while it has not
    returned fail at once (one thread waits on the store, not one per poll), and once the host answers again the
    store is used again."""
    import datetime

    import torch.distributed as dist

    host, port = store_host
    kv = JobStore(dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60)))
    assert kv.count("arrived", 1) == 1 and kv.count("arrived", 0) == 1
    assert kv.settle("decision", "publish") == "publish" and kv.settle("decision", "abort:x") == "publish"
    kv.note("absent", "rank 1 closes on an exception")
    assert kv.noted("absent") == "rank 1 closes on an exception" and kv.noted("other") is None
    _freeze(host.pid)
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="did not answer within"):
        kv.count("arrived", 1)
    assert time.monotonic() - t0 < STORE_READ_S + 10
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="an earlier call has not returned"):
        kv.settle("decision", "abort:y")
    assert kv.noted("absent") is None
    kv.note("absent", "not left")  # best effort: returns
    assert time.monotonic() - t0 < 1.0  # not STORE_READ_S again per call
    os.kill(host.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while True:  # the stuck call returns once the host answers: its add took effect
        try:
            assert kv.count("arrived", 0) == 2
            break
        except StoreTimeout:
            assert time.monotonic() < deadline, "the store was not used again once its host answered"
            time.sleep(0.1)
    assert kv.noted("decision") == "publish"
