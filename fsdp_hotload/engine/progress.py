"""What a long publish is doing, logged while it runs.

Why: a full snapshot of a large model takes minutes to upload and minutes more to load on every replica, and the
per-publish summary only comes at the end. Without a word in between, a slow bucket, a stuck replica and a
healthy large upload look the same. So while a publish runs longer than ``progress_log_s``, rank 0 logs one line
per interval: the stage, its own files and bytes written (and their rate), each deployment's replicas ready with
the first one still loading, and how far the trainer has moved on. Nothing is logged for publishes shorter than
the interval, which is every delta of a healthy job. The other ranks report their own copy, encode and uploads
only, at four times the interval, so a rank whose part is stuck names itself while rank 0 waits for its files.

The publisher thread only sets fields (a lock and a few integers per call); a separate daemon thread wakes once
per interval while a publish is in flight, so a stage that blocks (an upload of one large file, a collective,
a readiness poll) is still reported.

Example::

    reporter = ProgressLog(30.0, trainer_step=lambda: pub.latest_step)
    p = reporter.begin("step-000040-ab12cd34", "full", step=40, t0=time.perf_counter())
    p.stage("uploading", files=7)
    p.file_written(4_000_000_000)
    reporter.end()
    reporter.close()
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("fsdp_hotload")
#: Ranks other than 0 report their own part of a publish at this many times ``progress_log_s``.
OTHER_RANKS_SLOWER = 4


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover - the loop returns


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


class PublishProgress:
    """The state of one publish on this rank, written by the publisher's threads and read by the reporter."""

    def __init__(self, identity: str, kind: str, step: int, t0: float) -> None:
        self.identity, self.kind, self.step, self.t0 = identity, kind, step, t0
        self._lock = threading.Lock()
        self._stage = "starting"
        self._stage_t0 = t0
        self._waits = False  # the stage waits for the other ranks (a collective), not for this rank's own work
        self._files_total = 0
        self._files_done = 0
        self._bytes_done = 0
        self._upload_t0 = self._upload_t1 = t0  # this rank's uploads: start, and its newest file written
        self._replicas: dict[str, tuple[int, int, str]] = {}  # deployment -> (ready, replicas, first not ready)

    def stage(self, name: str, *, files: int | None = None, waits_for_others: bool = False) -> None:
        """Enter a stage; ``files``: this rank's files to write in it (starts the byte count and rate);
        ``waits_for_others``: a collective, which only rank 0 reports (see :class:`ProgressLog`)."""
        now = time.perf_counter()
        with self._lock:
            self._stage, self._stage_t0, self._waits = name, now, waits_for_others
            if files is not None:
                self._files_total, self._files_done, self._bytes_done = files, 0, 0
                self._upload_t0 = self._upload_t1 = now

    def file_written(self, nbytes: int) -> None:
        """One file is durable (called from the upload threads)."""
        now = time.perf_counter()
        with self._lock:
            self._files_done += 1
            self._bytes_done += nbytes
            self._upload_t1 = now

    def polled(self, deployment: str, status: Any, redact: Callable[[str], str] = str) -> None:
        """A readiness poll of ``deployment`` answered ``status`` (a ``HotLoadStatus``); ``redact`` removes
        secrets from the server's text (a replica's load error may quote a request, header and all)."""
        replicas = list(status.replicas)
        waiting = [(i, r) for i, r in enumerate(replicas) if not r.serves(self.identity)]
        first = redact(f"replica {waiting[0][0]}: {waiting[0][1].describe()}") if waiting else ""
        with self._lock:
            self._replicas[deployment] = (len(replicas) - len(waiting), len(replicas), first)

    def own_stage_for(self, now: float) -> float:
        """How long this rank's own work has run in the current stage (0 in a stage that waits for others)."""
        with self._lock:
            return 0.0 if self._waits else now - self._stage_t0

    def describe(self, now: float, trainer_step: int | None = None) -> str:
        """One line: what the publish does now, for how long, and how far it got."""
        with self._lock:
            parts = [f"{self.identity} ({self.kind} snapshot of step {self.step}) still publishing after "
                     f"{_secs(now - self.t0)}: {self._stage} for {_secs(now - self._stage_t0)}"]
            if self._files_total:
                done = self._files_done == self._files_total  # then the rate is the uploads', not diluted later
                took = max((self._upload_t1 if done else now) - self._upload_t0, 1e-9)
                parts.append(f"this rank wrote {self._files_done}/{self._files_total} files, "
                             f"{_size(self._bytes_done)} " + (f"in {_secs(took)}" if done else
                                                              f"({_size(self._bytes_done / took)}/s)"))
            for dep, (ready, total, first) in sorted(self._replicas.items()):
                parts.append(f"{dep}: {ready}/{total} replicas serve it" + (f" ({first})" if first else ""))
        if trainer_step is not None and trainer_step > self.step:
            parts.append(f"the trainer is at step {trainer_step}")
        return "; ".join(parts)


class ProgressLog:
    """Logs the publish in flight every ``interval_s`` once it has run that long (``None``: never; the
    :class:`PublishProgress` objects are still made, so the publisher's calls need no checks).

    ``own_work_only`` (ranks other than 0): report only a stage of this rank's own work (copy, encode, uploads)
    that has itself run the interval, each line starting with ``prefix`` ("rank 3: "). Why: rank 0 reports the
    publish as a whole, but while it waits for every rank's files it cannot tell whose are late; the late rank
    says so itself. The stages that wait for other ranks are left to rank 0, so a slow rank does not make every
    other rank log that it waits; and a publish that waited for a slot behind a slow rank 0 is old when its
    quick encode starts, which is not this rank being late."""

    def __init__(self, interval_s: float | None, *, trainer_step: Callable[[], int] | None = None,
                 name: str = "hotload-progress", own_work_only: bool = False, prefix: str = "") -> None:
        self.interval_s = interval_s
        self._trainer_step = trainer_step
        self._name = name
        self._own_work_only, self._prefix = own_work_only, prefix
        self._cond = threading.Condition()
        self._current: PublishProgress | None = None
        self._due = 0.0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.lines = 0  # logged so far

    def begin(self, identity: str, kind: str, step: int, t0: float) -> PublishProgress:
        """A publish starts (``t0``: its hook, on ``time.perf_counter``); it is reported until :meth:`end`."""
        p = PublishProgress(identity, kind, step, t0)
        if self.interval_s is None:
            return p
        with self._cond:
            self._current, self._due = p, t0 + self.interval_s
            if self._thread is None and not self._stop:  # started by the publisher's thread: inherits its nice
                thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                try:
                    thread.start()
                except RuntimeError as exc:  # no threads left: the publish goes on, unreported
                    log.warning("hotload: no progress reports (cannot start their thread: %s)", exc)
                    self.interval_s, self._current = None, None
                    return p
                self._thread = thread
            self._cond.notify()
        return p

    def end(self) -> None:
        with self._cond:
            self._current = None

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        assert self.interval_s is not None
        while True:
            with self._cond:
                while not self._stop and (self._current is None or time.perf_counter() < self._due):
                    self._cond.wait(None if self._current is None else self._due - time.perf_counter())
                if self._stop:
                    return
                p = self._current
                now = time.perf_counter()
                self._due = max(self._due + self.interval_s, now + self.interval_s / 2)
            try:  # a reporting problem is told and ignored: it must not end the reports, nor touch the publish
                step = self._trainer_step() if self._trainer_step is not None else None  # unlocked: the trainer's
                with self._cond:
                    # Under the lock end() takes, and with the time read now: a publish that ended meanwhile is
                    # not reported after its wait() returned, and the age is not the one from before the read.
                    now = time.perf_counter()
                    if self._current is not p or (self._own_work_only and p.own_stage_for(now) < self.interval_s):
                        continue
                    log.info("hotload: %s%s", self._prefix, p.describe(now, step))
                    self.lines += 1
            except Exception:  # noqa: BLE001
                log.warning("hotload: could not report a publish's progress", exc_info=True)
