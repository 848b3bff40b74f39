"""What happens to snapshots still in flight when the trainer stops waiting for them.

Why a module of its own: the publisher's threads are daemons, because an exiting trainer must not hang on a remote
fleet or a stuck storage call. So a process that ends without ``close()``, or a ``close()`` whose deadline
(``close_timeout_s``) passes, drops what is still publishing; this module makes sure that is said, with where the
snapshot was stuck, instead of lost silently. ``close()`` itself lives here too (:func:`close_publisher`): the
last vote, the wait within the deadline, and which error the caller sees.

Example::

    track(publisher)                       # the exit warning covers it from now on
    deadline = deadline_after(30.0)
    publisher.wait(left(deadline))         # TimeoutError once the 30 s are spent
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import sys
import threading
import time
import weakref
from typing import Any

from .jobs import PublishError

log = logging.getLogger("fsdp_hotload")

_open: "weakref.WeakSet[Any]" = weakref.WeakSet()


def track(pub: Any) -> None:
    """Have the exit warning cover ``pub`` (a Publisher: ``closed``, ``_pending``, ``_close_called``, ``rank``)."""
    _open.add(pub)


@atexit.register
def _warn_unclosed() -> None:
    for pub in list(_open):
        if not pub._close_called and pub.config.publish_on_close:  # the others' close() must not wait for it
            pub.agreements.withdraw("exited without calling close()", at_exit=True)
        if not pub.closed and pub._pending:  # close() never called, or blocked (a storage call that hangs?)
            how = "while close() waits for them" if pub._close_called else "and close() never called"
            hint = "" if pub._close_called else "; call close() (or use `with`) to wait for them"
            log.warning("hotload: exiting with %d snapshot(s) still publishing on rank %d %s: they are dropped and "
                        "the fleet keeps its last snapshot%s", pub._pending, pub.rank, how, hint)


def deadline_after(timeout: float | None) -> float | None:
    """A ``time.monotonic`` deadline ``timeout`` seconds from now (None: no deadline; so is a timeout beyond
    ``threading.TIMEOUT_MAX``, ``math.inf`` included, which no lock or condition accepts)."""
    if timeout is None or timeout >= threading.TIMEOUT_MAX:
        return None
    if timeout != timeout:
        raise ValueError("timeout is NaN: give seconds, or None to wait as long as it takes")
    return time.monotonic() + timeout


def left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (never negative; None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def gave_up_message(timeout: float | None, pending: int, rank: int, where: str) -> str:
    """What close() says when its deadline passed with ``pending`` snapshots in flight (``where``: the progress
    line of the one running)."""
    return (f"close() gave up after {timeout:g} s (close_timeout_s) with {pending} snapshot(s) still publishing on "
            f"rank {rank}: {where}. They are dropped: none not yet committed will be, so the fleet keeps the last "
            "snapshot it accepted (one already signalled may still load); the stuck call is left to a daemon thread")


def abandon(pub: Any, timeout: float | None, raise_errors: bool, locked_out: bool = False) -> None:
    """close()'s deadline passed: leave the stuck snapshots of ``pub`` (a Publisher) to the daemon threads (the
    process may exit) and free nothing under them: the publisher thread frees its helpers once the stuck call
    returns, if it does (the side groups stay for the process's exit); snapshots still queued are dropped, and a
    publish() waiting for a slot (the wait policy) raises instead of waiting on. ``locked_out``: close() could not
    take the publisher from another call (then it says so, where no snapshot is in flight)."""
    pub.closed = pub.abandoned = True
    pub._broken = pub._broken or PublishError("close() gave up on the snapshots in flight")
    pub.stager.refuse()
    if pub.signaller is not None:  # a thread stuck polling the deployment ends now, not at ready_timeout_s
        pub.signaller.cancel()
    if pub._pending or not locked_out:
        msg = gave_up_message(timeout, pub._pending, pub.rank, pub._prog.describe(time.perf_counter(), pub.latest_step))
    else:  # the last publish is not described: it ended
        msg = (f"close() gave up after {timeout:g} s (close_timeout_s) on rank {pub.rank} with no snapshot in "
               "flight: another call held the publisher all that time (a publish() on the training thread, or a "
               "close() on another thread), so nothing more is published")
    pub._progress.close()  # the dropped snapshot is not reported on while the stuck call lasts
    with contextlib.suppress(queue.Full):  # (never full: the running job left it) the thread ends after it
        pub._queue.put_nowait(None)
    err = pub._errors.take()
    log.error("hotload: %s%s", msg, "" if err is None else f" (an earlier publish failed: {err})")
    if raise_errors:
        raise PublishError(msg) from err


def close_publisher(pub: Any, raise_errors: bool, sources: Any, timeout: float | None,
                    propagating: bool | None) -> None:
    """The body of ``Publisher.close`` (see there); ``pub`` is the Publisher."""
    final_error: Exception | None = None
    pub._close_called = True
    timeout = pub.config.close_timeout_s if timeout is None else timeout
    deadline = deadline_after(timeout)
    # Bounded too: with the wait policy, a publish() on the trainer's thread waits for a slot behind a stuck one.
    if not pub._api_lock.acquire(timeout=-1 if deadline is None else left(deadline)):
        if not pub.closed:
            if pub.config.publish_on_close and not pub._closing:  # the others' vote must not wait for it
                pub.agreements.withdraw("gave up on close() while another call held the publisher")
            abandon(pub, timeout, raise_errors, locked_out=True)
        return
    try:
        if pub.closed:
            return
        if pub._pending and pub.rank == 0:  # readiness can take minutes: say what close() waits for
            log.info("hotload: close() waits for %d snapshot(s) in flight", pub._pending)
        final = raise_errors and pub.config.publish_on_close and not pub._closing
        propagating = sys.exc_info()[1] is not None if propagating is None else propagating
        if final and propagating and pub.latest_step > pub._last_staged:
            log.warning("hotload: closing while an exception propagates: the newest step %d is not published",
                        pub.latest_step)
        if pub.config.publish_on_close and not pub._closing and not (final and not propagating):
            # the others vote at their close: a vote this rank started could hold its exit while they are
            # stuck elsewhere (a training collective), so it leaves a note instead (agreement.py)
            pub.agreements.withdraw("closes on an exception")
        if final and not propagating:
            try:
                pub.publish_final(sources, timeout=left(deadline))
            except Exception as exc:  # noqa: BLE001 - raised once the threads are stopped
                final_error = exc
        pub._closing = True
    finally:
        pub._api_lock.release()
    try:
        pub.wait(left(deadline))
    except TimeoutError:
        abandon(pub, timeout, raise_errors)
        return
    pub.closed = True
    if pub._thread is not None:
        pub._queue.put(None)
        pub._thread.join()
    if pub._carried is not None:  # no later snapshot carried it
        pub._errors.store(pub._carried, pub._staged)
    pub._free(deadline, drain=raise_errors and not propagating)  # not on an exception: it may be a hang
    if raise_errors:
        if final_error is not None and pub._errors.due(pub._staged) and not pub.config.keep_training_on_error:
            log.error("hotload: publishing the newest step at close failed: %r", final_error)  # raised: the other
        pub.raise_if_failed()
        if final_error is not None:
            raise final_error
        return
    err = pub._errors.take()  # closing on an exception path: the caller's error wins, this one is still told
    if err is not None:
        why = "closing on another error" if propagating else "close(raise_errors=False)"
        log.warning("hotload: a publish failed before close (not raised: %s): %s", why, err)
