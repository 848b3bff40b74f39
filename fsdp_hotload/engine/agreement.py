"""The ranks' agreements on the trainer's side group (``ctrl``): the skip policy's "is some rank busy?" before a
publish, and close()'s vote on publishing the newest step.

Why apart from the publisher's own group: these run from the training thread, between steps, while the snapshots
use the other group in the background; each is a max-reduction every rank must take at the same point.
Why a failure is kept: a reduction that failed (a peer gone, or one rank paused past ``collective_timeout_s``)
stays failed and leaves ``ctrl`` unusable. Read again at every later step it raised gloo's own error at each one,
``keep_training_on_error`` or not. Now it is reported once, no further agreement starts, and every later step
counts as busy, so publishing stops while training goes on.

Why close()'s vote is bounded: a rank that leaves on an exception does not vote (its weights may be half updated,
and the others may be stuck elsewhere, in a training collective, so a vote it started could hold its exit until
the group's timeout). It leaves a note instead (:meth:`Agreements.withdraw`, in the job's store); a rank waiting
in the vote reads it and stops waiting. A rank that stops waiting at close()'s deadline leaves one too, so the
others stop as well, and one whose vote ends later still reads it: no rank publishes then.

Example::

    agreements = Agreements(ctrl, session="a1b2c3d4")
    agreements.start(busy=no_free_slot)          # every rank, the same step
    busy = agreements.read(on_failure=store)     # True: skip this publish
"""
from __future__ import annotations

from typing import Callable

from .comm import Comm
from .exits import left
from .jobs import PublishError

POLL_S = 0.25  # how often a rank waiting in the vote looks for a note that some rank will not vote


class NoVote(PublishError):
    """close()'s vote ended without every rank's: one closes without voting, or close()'s deadline passed. The
    reduction stays pending on ``ctrl`` (gloo cannot cancel it), so no other agreement starts on it."""


class Agreements:
    """Max-reductions on ``ctrl``: one pending "busy" agreement at a time, and votes."""

    def __init__(self, ctrl: Comm, session: str = "") -> None:
        self.ctrl = ctrl
        self._absent = f"hotload/{session}/closes-without-voting"  # the note's key: one per publisher of the job
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
        """The maximum of every rank's ``value``; a PublishError (not gloo's own error) where it fails, and
        :class:`NoVote` once some rank said it will not vote (:meth:`withdraw`) or at ``deadline`` (monotonic)."""
        if self.failed is not None:
            raise PublishError(f"the ranks' agreement on the trainer's side group failed earlier: {self.failed!r}")
        got = self._await(self.ctrl.allreduce_max_async(value), deadline)
        # Every rank voted, but one may have stopped waiting just before the last vote came: it does not publish,
        # so neither does this one. (Its note comes before it stops waiting; a vote ending in that instant is
        # missed, and the snapshot that rank does not join fails with the error.)
        absent = self.ctrl.noted(self._absent)
        if absent is not None:
            raise NoVote(absent)
        return got

    def read_at_close(self, on_failure: Callable[[PublishError], None], deadline: float | None) -> None:
        """close(): read a pending "busy" agreement before the vote, bounded as the vote is. Why: a rank that
        raised before its last publish never started it, so only a note or the deadline can end it; then no vote
        is taken (:attr:`failed`), and no rank publishes."""
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
                if absent is None:  # the others stop waiting too, and one whose vote ends later reads it
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

    def withdraw(self, why: str) -> None:
        """Tell the others, without waiting for them, that this rank will not vote (it closes on an exception)."""
        if self.failed is None and self.ctrl.world > 1:
            self.ctrl.note(self._absent, f"rank {self.ctrl.rank} {why}")

    def _result(self, result: Callable[..., int], timeout: float | None = None) -> int:
        try:
            return result(timeout)
        except RuntimeError as exc:
            self.failed = self.failed or exc
            raise PublishError(f"the ranks' agreement on the trainer's side group failed: {exc!r}") from exc
