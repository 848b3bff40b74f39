"""A fixed pool of daemon worker threads that hands back standard futures.

Why not ``ThreadPoolExecutor``: Python joins its workers when the interpreter exits, so a trainer that ends
with a publish still in flight (no ``close()``, or Ctrl-C inside it) waited for that publish's uploads, hints and
readiness polls, minutes against an unreachable fleet, and for ever on a write to a hung mount (the commit's
small files, which the storage layer writes on several threads). Daemon workers let the process exit at once;
what was in flight is dropped, the fleet keeps its last snapshot, and the next run starts with a full one.

Example::

    pool = DaemonPool(4, "hotload-upload-0")
    futures = [pool.submit(upload, name) for name in files]
    wait(futures)
    pool.shutdown()
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonPool:
    """A fixed number of daemon worker threads running submitted calls in order, each handing back a standard
    :class:`~concurrent.futures.Future` (``wait``, ``cancel`` and ``result`` work as with an executor's)."""

    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(workers)]
        started = 0
        try:
            for t in self._threads:
                t.start()
                started += 1
        except BaseException:
            # Out of threads part way ("can't start new thread"): no pool is returned to shut down, so the
            # workers that did start would wait on the queue for good, more of them at each snapshot that fails so.
            for _ in range(started):
                self._tasks.put(None)
            for t in self._threads[:started]:
                t.join()
            raise

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("pool is shut down")
        future: Future[T] = Future()
        self._tasks.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args, kwargs = task
            del task  # a finished task's function must not stay alive here until the next one (serve_weakly)
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever holds the future
                    future.set_exception(exc)
            del future, fn, args, kwargs

    def shutdown(self, wait: bool = True) -> None:
        """Run what was submitted, then stop the workers; ``wait``: until they have stopped."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads if wait else ():
            t.join()
