"""The ranks' agreements on the trainer's side group (``ctrl``): the skip policy's "is some rank busy?" before a
publish, and close()'s vote on publishing the newest step.

Why apart from the publisher's own group: these run from the training thread, between steps, while the snapshots
use the other group in the background; each is a max-reduction every rank must take at the same point.
Why a failure is kept: a reduction that failed (a peer gone, or one rank paused past ``collective_timeout_s``)
stays failed and leaves ``ctrl`` unusable. Read again at every later step it raised gloo's own error at each one,
``keep_training_on_error`` or not. Now it is reported once, no further agreement starts, and every later step
counts as busy, so publishing stops while training goes on.

Example::

    agreements = Agreements(ctrl)
    agreements.start(busy=no_free_slot)          # every rank, the same step
    busy = agreements.read(on_failure=store)     # True: skip this publish
"""
from __future__ import annotations

from typing import Callable

from .comm import Comm
from .jobs import PublishError


class Agreements:
    """Max-reductions on ``ctrl``: one pending "busy" agreement at a time, and votes."""

    def __init__(self, ctrl: Comm) -> None:
        self.ctrl = ctrl
        self.failed: BaseException | None = None  # the first failed reduction: ctrl is unusable
        self._pending: Callable[[], int] | None = None

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

    def vote(self, value: int) -> int:
        """The maximum of every rank's ``value``; a PublishError (not gloo's own error) where it fails."""
        if self.failed is not None:
            raise PublishError(f"the ranks' agreement on the trainer's side group failed earlier: {self.failed!r}")
        return self._result(self.ctrl.allreduce_max_async(value))

    def _result(self, result: Callable[[], int]) -> int:
        try:
            return result()
        except RuntimeError as exc:
            self.failed = self.failed or exc
            raise PublishError(f"the ranks' agreement on the trainer's side group failed: {exc!r}") from exc
