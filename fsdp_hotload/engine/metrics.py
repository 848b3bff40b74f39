"""Per-publish metrics: one record per snapshot, logged and appended as a JSON line on rank 0."""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field

log = logging.getLogger("fsdp_hotload")


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
    staleness_steps: int = 0  # trainer step when the fleet served it, minus this step
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
        if not self.ok:
            return f"step {self.step} {self.kind} {self.identity}: FAILED: {self.error}"
        ratio = f"{self.ratio:.1f}x" if self.ratio else "-"
        changed = f" changed {100 * self.changed_fraction:.2f}%" if self.changed_fraction is not None else ""
        return (f"step {self.step} {self.kind} {self.identity}: {self.bytes_written / 1e6:.2f} MB ({ratio}){changed}"
                f" blocking {self.blocking_ms:.1f} ms, upload {self.upload_s:.2f}s"
                + (f" (slowest rank {self.slowest_rank})" if self.slowest_rank is not None else "")
                + f", ready {self.ready_s:.2f}s"
                + (f" (not served by {', '.join(self.deployments_behind)})" if self.deployments_behind else "")
                + (f" ({', '.join(self.deployments_catching_up)} catching up)" if self.deployments_catching_up
                   else ""))


class MetricsSink:
    """Appends JSON lines to ``path`` (if given) and keeps the last ``keep`` in memory (a job that publishes for
    weeks must not grow without bound); thread-safe."""

    def __init__(self, path: str | None, keep: int = 4096) -> None:
        self.path = os.path.abspath(path) if path else path  # as the bucket: a later chdir must not split the file
        self.keep = keep
        self.records: list[PublishMetrics] = []
        self._lock = threading.Lock()
        if path:
            check_appendable(path)

    def emit(self, m: PublishMetrics) -> None:
        with self._lock:
            self.records.append(m)
            if len(self.records) > self.keep:
                del self.records[0]
            if self.path:
                with open(self.path, "a") as f:
                    f.write(m.line() + "\n")
        (log.info if m.ok else log.warning)("hotload: %s", m.summary())


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
