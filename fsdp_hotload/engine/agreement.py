"""The ranks' agreements: the skip policy's "is some rank busy?" before a publish (a reduction on the trainer's side
group, ``ctrl``), and close()'s vote on publishing the newest step (in the job's key-value store).

Why the busy agreement is a reduction apart from the publisher's own group: it runs from the training thread,
between steps, while the snapshots use the other group in the background; every rank takes it at the same point.
Why its failure is kept: a reduction that failed (a peer gone, or one rank paused past ``collective_timeout_s``)
stays failed and leaves ``ctrl`` unusable. Read again at every later step it raised gloo's own error at each one,
``keep_training_on_error`` or not. Now it is reported once, no further agreement starts, and every later step
counts as busy, so publishing stops while training goes on.

Why close()'s vote is taken in the store, not on ``ctrl``: a vote must be able to end without every rank's. A rank
that leaves on an exception does not vote (its weights may be half updated), and a rank whose close() deadline
passes stops waiting. A gloo reduction cannot be cancelled: left pending, it held the process's exit until the
other ranks' processes exited, and could end it in SIGABRT. In the store each rank counts its arrival (and its
objection), and the decision is set once, atomically (``compare_set``): "publish"/"skip" by the rank that sees
every rank arrived, or "abort" by one that withdraws (:meth:`Agreements.withdraw`) or stops waiting. Every rank
reads the one decision, so no rank publishes alone. A store call not answered in time (a paused host) is retried at
the next poll; an arrival not answered may still count later, so that rank acts only on a decision read once the
store answers again (it settles "abort", or reads a "publish" set after its arrival counted).

Example::

    agreements = Agreements(ctrl, key="a1b2c3d4-5e6f")
    agreements.start(busy=no_free_slot)          # every rank, the same step
    busy = agreements.read(on_failure=store)     # True: skip this publish
    objected = agreements.vote(0, deadline)      # close(): every rank; NoVote where one withdrew
"""
from __future__ import annotations

import time
from typing import Callable

from .comm import Comm, StoreError, StoreTimeout
from .exits import deadline_after, left
from .jobs import PublishError

POLL_S = 0.25  # the longest a rank waiting in the vote sleeps between two looks at the store
FIRST_POLL_S = 0.005  # the first sleep; doubled up to POLL_S (the ranks usually arrive within milliseconds)
READ_S = 5.0  # the longest rank 0 waits, after a decision, for every rank to have read it (see Agreements._read)
ABORT = "abort:"  # the decision's prefix when the vote ended without every rank's (then the reason)


class NoVote(PublishError):
    """close()'s vote ended without every rank's: one closes without voting, or close()'s deadline passed. No rank
    publishes then."""


class Agreements:
    """The busy agreement (one pending max-reduction on ``ctrl`` at a time) and close()'s votes (in the store).

    ``key``: unique to this publisher in the job, the same on every rank (its keys in the store start with it).
    ``wait_s``: how long a vote waits for the others where close() has no deadline (the side group's timeout)."""

    def __init__(self, ctrl: Comm, key: str = "", wait_s: float | None = None) -> None:
        self.ctrl = ctrl
        self._key = f"hotload/{key}"
        self._absent = f"{self._key}/closes-without-voting"  # the note of a rank that will not vote
        self._wait_s = wait_s
        self._votes = 0  # votes taken: the next one's number, the same on every rank
        self.failed: BaseException | None = None  # the first failed reduction: ctrl is unusable
        self._pending: Callable[..., int] | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def start(self, busy: bool) -> None:
        """Start the "some rank is busy" reduction, unless one is pending or ctrl has failed."""
        if self._pending is None and self.failed is None:
            self._pending = self.ctrl.allreduce_max_async(int(busy))

    def read(self, on_failure: Callable[[PublishError], None]) -> bool:
        """The pending agreement's result, read once: True where some rank was busy, and from the moment ctrl
        failed (``on_failure`` is given that failure once); False where none is pending."""
        pending, self._pending = self._pending, None
        if self.failed is not None or pending is None:
            return self.failed is not None
        try:
            return bool(self._result(pending))
        except PublishError as exc:
            on_failure(exc)
            return True

    def vote(self, value: int, deadline: float | None = None) -> int:
        """1 where some rank voted a nonzero ``value`` (it objects), else 0; :class:`NoVote` once some rank said it
        will not vote (:meth:`withdraw`) or at ``deadline`` (monotonic; None: ``wait_s``); a PublishError where the
        job's store cannot be reached. Every rank that reads the decision gets the same one."""
        if self.failed is not None:
            raise PublishError(f"the ranks' agreement on the trainer's side group failed earlier: {self.failed!r}")
        vote = f"{self._key}/vote{self._votes}"
        self._votes += 1
        deadline = deadline if deadline is not None else deadline_after(self._wait_s)
        try:
            held = self._decide(vote, value, deadline)
            if not held.startswith(ABORT):
                self._read(vote, deadline)
            return self._decided(held)
        except StoreError as exc:  # as a collective that failed: raised by close() (logged where errors are)
            why = f"rank {self.ctrl.rank} could not reach the job's store: {exc}"
            self.ctrl.note(self._absent, why)  # best effort: where the store is gone, the others find it so too
            raise PublishError(why) from exc

    def _decide(self, vote: str, value: int, deadline: float | None) -> str:
        """The vote's decision, set by this rank where it is the last to arrive (or gives up), else read."""
        ctrl, decision = self.ctrl, f"{vote}/decision"
        try:
            if value:  # counted before the arrival: a rank that sees every arrival sees every objection
                ctrl.count(f"{vote}/objections", 1)
            arrived = ctrl.count(f"{vote}/arrived", 1)
        except StoreTimeout:  # it may still be counted once the store answers: act only on a decision set from now
            return self._abort_when_answered(decision, deadline)
        sleep = FIRST_POLL_S
        while True:
            try:  # a call the store did not answer in time is retried at the next poll (a host paused a while)
                if arrived >= ctrl.world:
                    return ctrl.settle(decision, "skip" if ctrl.count(f"{vote}/objections", 0) else "publish")
                held = ctrl.noted(decision)
                if held is not None:
                    return held
                absent = ctrl.noted(self._absent)
                if absent is not None:
                    return ctrl.settle(decision, ABORT + absent)
            except StoreTimeout:
                pass
            if left(deadline) == 0:
                why = f"rank {ctrl.rank} stopped waiting for the others at close()'s deadline"
                ctrl.note(self._absent, why)  # for a later vote, and a busy agreement left pending (read_at_close)
                return ctrl.settle(decision, ABORT + why)
            time.sleep(sleep if deadline is None else min(sleep, left(deadline) or 0.0))
            sleep = min(sleep * 2, POLL_S)
            try:
                arrived = ctrl.count(f"{vote}/arrived", 0)
            except StoreTimeout:
                pass

    def _abort_when_answered(self, decision: str, deadline: float | None) -> str:
        """This rank's arrival was not answered in time: settle "abort" once the store answers again (before the
        deadline), and take whatever decision holds then (a "publish" set once the arrival was counted)."""
        why = f"rank {self.ctrl.rank}'s vote did not reach the job's store in time"
        while True:
            try:
                return self.ctrl.settle(decision, ABORT + why)
            except StoreTimeout:
                if left(deadline) == 0:
                    raise
            time.sleep(POLL_S if deadline is None else min(POLL_S, left(deadline) or 0.0))

    def _read(self, vote: str, deadline: float | None) -> None:
        """Each rank says it read the decision; rank 0 waits (``READ_S`` at most) until every rank has. Why: with
        ``env://`` init rank 0's process hosts the store, and one that exits right after it decided leaves the
        others, still between two polls, with no store to read the decision from."""
        ctrl, until = self.ctrl, time.monotonic() + READ_S
        try:
            read = ctrl.count(f"{vote}/read", 1)
            while ctrl.rank == 0 and read < ctrl.world and time.monotonic() < until and left(deadline) != 0:
                time.sleep(FIRST_POLL_S)
                read = ctrl.count(f"{vote}/read", 0)
        except StoreError:  # the decision is known: a store that fails now changes nothing for this rank
            pass

    @staticmethod
    def _decided(held: str) -> int:
        if held.startswith(ABORT):
            raise NoVote(held[len(ABORT):])
        return int(held == "skip")

    def read_at_close(self, on_failure: Callable[[PublishError], None], deadline: float | None) -> None:
        """close(): read a pending "busy" agreement before the vote, bounded as the vote is. Why: a rank that
        raised before its last publish never started it, so only a note or the deadline can end it; then no vote
        is taken (:attr:`failed`), and no rank publishes. (That reduction stays pending: gloo cannot cancel it.)"""
        pending, self._pending = self._pending, None
        if pending is None or self.failed is not None:
            return
        try:
            self._await(pending, deadline)
        except NoVote:
            pass
        except PublishError as exc:
            on_failure(exc)

    def _await(self, result: Callable[..., int], deadline: float | None) -> int:
        """``result``'s value, waited for until some rank leaves a note or ``deadline`` passes (:class:`NoVote`)."""
        while True:
            try:
                got = self._result(result, POLL_S if deadline is None else min(POLL_S, left(deadline) or 0.0))
            except TimeoutError:
                absent = self.ctrl.noted(self._absent)
                if absent is None and left(deadline) != 0:
                    continue
                if absent is None:  # the others stop waiting too
                    absent = f"rank {self.ctrl.rank} stopped waiting for the others at close()'s deadline"
                    self.ctrl.note(self._absent, absent)
                self.failed = NoVote(absent)
                raise self.failed from None
            except PublishError as exc:  # the group broke: a rank that withdrew has closed its end of it
                absent = self.ctrl.noted(self._absent)
                if absent is None:
                    raise
                self.failed = NoVote(absent)
                raise self.failed from exc
            return got

    def absent(self) -> str | None:
        """The note of a rank that will not vote (it closes on an exception, or exited), if one was left; None also
        where the store cannot be read (it may be gone with that rank)."""
        try:
            return self.ctrl.noted(self._absent)
        except Exception:  # noqa: BLE001 - only adds to an error being reported
            return None

    def withdraw(self, why: str, *, at_exit: bool = False) -> None:
        """Tell the others, without waiting for them, that this rank will not vote (it closes on an exception,
        gives up on close(), or exits without it): the vote they wait in (or will take) ends, no rank publishing."""
        if self.ctrl.world > 1:
            self.ctrl.note(self._absent, f"rank {self.ctrl.rank} {why}", at_exit=at_exit)

    def _result(self, result: Callable[..., int], timeout: float | None = None) -> int:
        try:
            return result(timeout)
        except RuntimeError as exc:
            self.failed = self.failed or exc
            raise PublishError(f"the ranks' agreement on the trainer's side group failed: {exc!r}") from exc
