"""Per-publish metrics: one record per snapshot, logged and appended as a JSON line on rank 0."""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field

log = logging.getLogger("fsdp_hotload")

#: The attribute of the log record of each publish's summary line that holds its :class:`PublishMetrics`, so that a
#: program that reports outcomes its own way (``hotload demo``'s table) can leave those lines out with a filter.
METRICS_ATTR = "hotload_metrics"


@dataclass
class PublishMetrics:
    step: int
    identity: str
    kind: str
    ok: bool = False
    error: str | None = None
    changed_fraction: float | None = None  # of all elements (delta only)
    raw_bytes: int = 0  # bytes of the snapshot as a full one
    bytes_written: int = 0  # weight files only
    ratio: float | None = None
    files: int = 0
    blocking_ms: float = 0.0  # trainer main thread, max over ranks
    diff_s: float = 0.0  # max over ranks: the diff before encoding (device, or arc_sparse_v1); 0 where fused
    # into encode_s (arc_v2 on the host: one pass per chunk)
    encode_s: float = 0.0
    route_s: float = 0.0
    upload_s: float = 0.0
    signal_s: float = 0.0  # a failed signal or readiness wait: all the time it took until it failed
    ready_s: float = 0.0
    total_s: float = 0.0  # hook to all replicas ready
    # steps the fleet's policy trails the trainer's: the trainer's step when the fleet served this snapshot, minus
    # this step; on a failure, minus the step the fleet still serves (None if it serves none of this job's)
    staleness_steps: int | None = 0
    upload_mb_s: float | None = None
    throttled: int = 0  # throttle answers (SlowDown, 503, 429) from the store; on S3 botocore's retry's included
    retries: int = 0  # storage calls retried by hotload (botocore's one retry per S3 request is not counted)
    skipped_before: int = 0  # steps skipped because the publisher was busy
    slowest_rank: int | None = None  # the rank whose diff+encode+upload took longest (several ranks only)
    # deployments signalled for it (or whose turn it was) that do not serve it: with deployments_required="any",
    # those left behind while the snapshot counts as served; on a failed signal, those that did not take it
    deployments_behind: list[str] = field(default_factory=list)
    # of those left behind, the ones whose catch-up was under way (loading the snapshots they missed, in order)
    deployments_catching_up: list[str] = field(default_factory=list)

    def line(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def summary(self) -> str:
        lag = ((f" (fleet {_steps(self.staleness_steps)} behind)" if self.staleness_steps else "")
               + (f" ({_steps(self.skipped_before)} skipped before it)" if self.skipped_before else ""))
        if not self.ok:
            return f"step {self.step} {self.kind} {self.identity}: FAILED{lag}: {self.error}"
        ratio = f"{self.ratio:.1f}x" if self.ratio else "-"
        changed = f" changed {100 * self.changed_fraction:.2f}%" if self.changed_fraction is not None else ""
        return (f"step {self.step} {self.kind} {self.identity}: {self.bytes_written / 1e6:.2f} MB ({ratio}){changed}"
                f" blocking {self.blocking_ms:.1f} ms, upload {self.upload_s:.2f}s"
                + (f" (slowest rank {self.slowest_rank})" if self.slowest_rank is not None else "")
                + f", ready {self.ready_s:.2f}s"
                + (f" (not served by {', '.join(self.deployments_behind)})" if self.deployments_behind else "")
                + (f" ({', '.join(self.deployments_catching_up)} catching up)" if self.deployments_catching_up
                   else "") + lag)


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def staleness(latest_step: int, served_step: int) -> int | None:
    """Steps from the policy the fleet serves (``served_step``; -1: none of this job's) to the trainer's newest."""
    return max(latest_step - served_step, 0) if served_step >= 0 else None


class MetricsSink:
    """Appends JSON lines to ``path`` (if given) and keeps the last ``keep`` in memory (a job that publishes for
    weeks must not grow without bound); thread-safe."""

    def __init__(self, path: str | None, keep: int = 4096) -> None:
        self.path = os.path.abspath(path) if path else path  # as the bucket: a later chdir must not split the file
        self.keep = keep
        self.records: list[PublishMetrics] = []
        self._lock = threading.Lock()
        self._failing = False  # the file's last write failed (warned once until one succeeds)
        if path:
            check_appendable(path)

    def emit(self, m: PublishMetrics) -> None:
        """Log the summary, then append the line; raises the file's OSError (after logging, so that a full disk
        does not hide what the publish did)."""
        (log.info if m.ok else log.warning)("hotload: %s", m.summary(), extra={METRICS_ATTR: m})
        with self._lock:
            self.records.append(m)
            if len(self.records) > self.keep:
                del self.records[0]
            if self.path:
                with open(self.path, "ab+") as f:
                    # A line cut short (a trainer killed mid-write, a full disk) is ended first: appended to, it
                    # would make this record unreadable too, and JSON-lines readers refuse the whole file.
                    torn = f.seek(0, os.SEEK_END) > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
                    f.write((("\n" if torn else "") + m.line() + "\n").encode())

    def record(self, m: PublishMetrics) -> None:
        """:meth:`emit` for the publisher: a file problem is warned about once (until a write succeeds again)
        and never raised, since it must not fail a snapshot the fleet serves."""
        try:
            self.emit(m)
        except Exception as exc:  # noqa: BLE001
            if not self._failing:
                log.warning("hotload: could not append the metrics of %s to %s (%s); the summaries are still "
                            "logged, and this is not repeated until a write succeeds", m.identity, self.path, exc)
            self._failing = True
        else:
            self._failing = False


def check_appendable(path: str) -> None:
    """OSError naming ``metrics_path`` unless ``path`` can be appended to (its folder is made, the file created
    empty). Why here: a folder given as the path, or one under a file, lost every publish's record later, each
    with a warning, or failed with an error that named neither the field nor the path."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"metrics_path {path!r} is a folder: name a file in it (metrics.jsonl, say)")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise OSError(f"metrics_path {path!r} cannot be written ({exc}): name a file in a writable folder") \
            from None
