"""Writing the files of a snapshot that this rank owns: assembled from every rank's pieces, uploaded, hinted.

Each file has one owner rank (:func:`~.assemble.assign_owners`), which puts the pieces of its tensors together
(raw bytes for a full snapshot, codec payloads for a delta) and uploads the file. Files are written on a pool of
``concurrency`` threads started at the first snapshot, from the publisher's thread, so that they inherit its nice
value, and each durable file's hint is sent on a second pool of as many threads; every write and hint has ended,
failed or not, before the snapshot's outcome is decided.

Example::

    writer = FileWriter(plan, owners, rank, storage, codec="arc_v2", signaller=None, send_hints=False,
                        concurrency=8)
    writer.write(identity, "full", None, incoming, status, progress)   # incoming: every rank's pieces for us
    writer.shutdown()
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, wait
from typing import Any

from ..layout import ShardPlan
from ..storage import Storage
from .assemble import Piece, RawPiece, assemble_delta_file, assemble_full_file
from .jobs import RankStatus
from .pool import DaemonPool
from .progress import PublishProgress

log = logging.getLogger("fsdp_hotload")


class FileWriter:
    """The owner's side of a snapshot's files (see the module docstring)."""

    def __init__(self, plan: ShardPlan, owners: dict[str, int], rank: int, storage: Storage, *, codec: str,
                 signaller: Any, send_hints: bool, concurrency: int) -> None:
        self.plan, self.owners, self.rank, self.storage = plan, owners, rank, storage
        self.codec, self.signaller, self.send_hints, self.concurrency = codec, signaller, send_hints, concurrency
        self._pool: DaemonPool | None = None
        self._hint_pool: DaemonPool | None = None

    def write(self, identity: str, kind: str, parent: str | None, incoming: list[list[RawPiece]], st: RankStatus,
              prog: PublishProgress) -> None:
        """Assemble, upload and hint every file this rank owns; records files, times, throttles and retries in
        ``st``. Empties ``incoming`` as it goes, so each file's pieces are freed once it is assembled."""
        by_file: dict[str, list[RawPiece]] = {f: [] for f, r in self.owners.items() if r == self.rank}
        for pieces in incoming:
            for p in pieces:
                by_file[self.plan.file_of(p[0])].append(p)
            pieces.clear()  # by_file holds them now, and lets each file's go once it is assembled
        before = self.storage.stats.snapshot()
        t0 = time.perf_counter()

        def write(filename: str) -> tuple[str, int]:
            pieces = by_file.pop(filename)
            if kind == "full":
                blob: bytes | memoryview = assemble_full_file(self.plan, filename, [Piece._make(p) for p in pieces])
            else:
                assert parent is not None
                blob = assemble_delta_file(self.plan, filename, pieces, parent_identity=parent, codec=self.codec)
            del pieces
            self.storage.put_bytes(f"{identity}/{filename}", blob)
            prog.file_written(len(blob))
            if hint_pool is not None:
                hints.append(hint_pool.submit(self._hint, identity, filename, parent if kind == "delta" else None))
            return filename, len(blob)

        if self._pool is None:  # one pool for the publisher's life: no thread start-up per publish
            self._pool = DaemonPool(self.concurrency, f"hotload-upload-{self.rank}")
        hints: list[Future[None]] = []
        hint_pool = self._hints_pool() if self.signaller is not None and self.send_hints else None
        prog.stage("uploading", files=len(by_file))
        futures = [self._pool.submit(write, f) for f in sorted(by_file)]
        wait(futures)  # every write has ended before the snapshot's outcome is decided, failed or not
        # Counted before the first error is raised: a publish that failed for throttling must say so.
        st.files = dict(f.result() for f in futures if f.exception() is None)
        st.upload_s = time.perf_counter() - t0
        if hints:  # a hint is for the replicas' prefetch before the signal: each one ends before the outcome
            prog.stage("sending hints")
            wait(hints)
        after = self.storage.stats.snapshot()
        st.throttled = int(after.get("throttled", 0) - before.get("throttled", 0))
        st.retries = int(after.get("retries", 0) - before.get("retries", 0))
        for f in futures:
            if (exc := f.exception()) is not None:
                raise exc

    def _hints_pool(self) -> DaemonPool | None:
        """Hints run on threads of their own. Why: on the upload worker, each hint's round trip (up to
        ``HINT_DEADLINE_S``) held back that worker's next upload, so a slow hint endpoint slowed every upload.
        As many threads as upload workers send them at least as fast as the upload workers did. None (this
        snapshot goes without hints) where they cannot start: a hint is never worth failing a snapshot for."""
        if self._hint_pool is None:
            try:
                self._hint_pool = DaemonPool(self.concurrency, f"hotload-hint-{self.rank}")
            except RuntimeError as exc:  # "can't start new thread"
                log.warning("hotload: no hints for this snapshot (cannot start their threads: %s)", exc)
        return self._hint_pool

    def _hint(self, identity: str, filename: str, parent: str | None) -> None:
        try:
            self.signaller.hint(identity, filename, parent)
        except Exception:  # noqa: BLE001 - best effort: a hint never fails a snapshot whose files are durable
            log.warning("hotload: hint for %s/%s failed", identity, filename, exc_info=True)

    def shutdown(self) -> None:
        """Finish the writes and hints submitted, then stop the pools' threads."""
        for pool in (self._pool, self._hint_pool):
            if pool is not None:
                pool.shutdown()
