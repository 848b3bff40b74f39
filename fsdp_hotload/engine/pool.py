"""Background threads: the fixed pool of daemon workers (:class:`~fsdp_hotload.daemon_pool.DaemonPool`, kept
beside the storage layer, which uses it too), warm-ups, a lower priority, and the slot where a background error
waits for the trainer's thread.

Example::

    thread = start_warm_up(codec.warm_up, name="hotload-warmup-0", nice=10, what="the arc_v2 codec")
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

from ..daemon_pool import DaemonPool  # noqa: F401 (re-exported: the engine's pools)

log = logging.getLogger("fsdp_hotload")


# Warm-up threads still running. They are daemons, so an early exit is not held by them; but a process whose
# interpreter finalises while one is inside numba's LLVM aborts ("terminate called without an active exception",
# status 134) instead of exiting, so exit waits for them (bounded).
_warming: set[threading.Thread] = set()
_warming_lock = threading.Lock()
WARM_UP_EXIT_WAIT_S = 120.0


def start_warm_up(fn: Callable[[], Any], *, name: str, nice: int, what: str) -> threading.Thread:
    """Run ``fn`` (loading or compiling kernels) on a daemon thread at ``nice``; a failure is logged, since the
    first real use loads them again and raises there if it must.

    Example::

        thread = start_warm_up(codec.warm_up, name="hotload-warmup-0", nice=10, what="the arc_v2 codec")
    """
    def run() -> None:
        lower_thread_priority(nice)
        try:
            fn()
        except Exception:  # noqa: BLE001
            log.warning("hotload: warming up %s failed; its first use will retry", what, exc_info=True)
        finally:
            with _warming_lock:
                _warming.discard(threading.current_thread())

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _warming_lock:
        _warming.add(thread)
    thread.start()
    return thread


@atexit.register
def _finish_warm_ups() -> None:
    deadline = time.monotonic() + WARM_UP_EXIT_WAIT_S
    with _warming_lock:
        threads = list(_warming)
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))


def serve_weakly(owner: "weakref.ref[Any]", jobs: "queue.Queue[Any]", nice: int) -> None:
    """A background thread's loop that holds its owner only while a job is queued or handled: each item is
    ``(owner, job)``, for ``owner._handle(job)``; at ``None``, ``owner._stopped()``; it ends once the owner is gone.

    Why: a thread's target is a root for the garbage collector, so an owner held by its thread for good (a bound
    method as the target) was never collected: a publisher dropped without close() kept its staging buffers,
    cache and threads until the process exited. Held weakly it is collected, and :func:`stop_dropped`, its
    finalizer, ends this loop. A queued job holds its owner itself: held only by this thread, an owner dropped
    right after queueing a job was collected before the thread took it, and that snapshot (which ``publish``
    had reported started) was dropped without a word, the exit warning included."""
    lower_thread_priority(nice)
    while True:
        item = jobs.get()
        if item is None:
            target = owner()
            if target is not None:
                target._stopped()
            return
        target, job = item
        del item
        target._handle(job)
        del target, job  # nothing of the owner is held while the thread waits for the next job


def weak_getter(owner: Any, attr: str) -> Callable[[], Any]:
    """A function returning ``owner.attr`` (None once the owner is gone) that does not hold the owner: for the
    helpers of an owner its threads hold weakly (:func:`serve_weakly`)."""
    ref = weakref.ref(owner)

    def get() -> Any:
        target = ref()
        return None if target is None else getattr(target, attr)
    return get


def stop_dropped(jobs: "queue.Queue[Any]", helpers: list[Any]) -> None:
    """The finalizer of an owner collected without close(): its thread ends, and its helpers (each one's
    ``shutdown()`` or ``close()``; errors are dropped, nobody is left to be told)."""
    with contextlib.suppress(queue.Full):
        jobs.put_nowait(None)
    for helper in helpers:
        with contextlib.suppress(Exception):
            (helper.shutdown if hasattr(helper, "shutdown") else helper.close)()


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value (Linux: per thread; other systems: no-op). Encoding and uploading
    then take CPU the trainer leaves idle instead of competing with it."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as exc:  # e.g. a sandbox that forbids it: publishing still works, at normal priority
        log.debug("hotload: cannot lower publisher thread priority: %s", exc)


class StoredError:
    """The first background error not yet raised on the trainer's thread, with the job it came from.

    Why the job: with several ranks the trainer raises an error only at a step every rank reaches with the same
    knowledge (see ``Publisher.publish``), which ``due`` tells from the job's position. Errors that come while
    one waits are logged, never dropped in silence.

    Example::

        errors = StoredError()
        errors.store(exc, seq=job.seq)             # background thread
        if errors.due(staged - max_inflight):      # trainer's thread
            raise PublishError(str(errors.take()))
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exc: BaseException | None = None
        self._seq = 0
        self._logged = False

    def store(self, exc: BaseException, seq: int, *, logged: bool = False) -> None:
        """``logged``: this rank has already logged ``exc`` at WARNING or above (e.g. its publish's summary), so
        a caller that only logs it need not repeat it."""
        with self._lock:
            if self._exc is None:
                self._exc, self._seq, self._logged = exc, seq, logged
                return
        log.error("hotload: another publish failed before the previous error was raised: %s", exc)

    def due(self, seq: int) -> bool:
        """An error is waiting, from job ``seq`` or an earlier one."""
        with self._lock:
            return self._exc is not None and self._seq <= seq

    def take(self) -> BaseException | None:
        return self.take_logged()[0]

    def take_logged(self) -> tuple[BaseException | None, bool]:
        """The error, and whether it was stored as already logged on this rank."""
        with self._lock:
            exc, logged, self._exc, self._logged = self._exc, self._logged, None, False
        return exc, logged
