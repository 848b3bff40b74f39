"""Background threads: a fixed pool of daemon workers that hands back standard futures, and a lower priority.

Why not ``ThreadPoolExecutor``: Python joins its workers when the interpreter exits, so a trainer that ends
with a publish still in flight (no ``close()``, or Ctrl-C inside it) waited for that publish's uploads, hints and
readiness polls, minutes against an unreachable fleet. Daemon workers let the process exit at once; what was in
flight is dropped, the fleet keeps its last snapshot, and the next run starts with a full one.

Example::

    pool = DaemonPool(4, "hotload-upload-0")
    futures = [pool.submit(upload, name) for name in files]
    wait(futures)
    pool.shutdown()
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger("fsdp_hotload")
_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonPool:
    def __init__(self, workers: int, name: str) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._closed:
            raise RuntimeError("pool is shut down")
        future: Future[T] = Future()
        self._tasks.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever holds the future
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Run what was submitted, then stop the workers and wait for them."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._tasks.put(None)
        for t in self._threads:
            t.join()


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
