"""What the publisher's threads hand each other about one snapshot: the staged job, each rank's status report, the
agreed outcome, and the error a failed snapshot raises on the trainer's thread.

Example::

    job = Job(step, buf, event, blocking_ms=0.4, skipped_before=0, t_hook=time.perf_counter(), seq=0)
    status = RankStatus(rank, kind="delta", identity=identity)   # gathered on rank 0
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .metrics import PublishMetrics


class PublishError(RuntimeError):
    """A snapshot could not be published; the next publish will be a full snapshot."""


@dataclass
class Job:
    step: int
    buf: torch.Tensor
    event: Any
    blocking_ms: float
    skipped_before: int
    t_hook: float
    seq: int = 0  # this rank's count of jobs staged before it; equal on every rank for the same snapshot
    settled: bool = False  # the outcome was applied to the stager and cadence (the slot is no longer ours)
    identity: str = ""  # set once the publisher thread takes the job
    kind: str = ""


@dataclass
class Outcome:
    ok: bool
    error: str | None = None
    metrics: PublishMetrics | None = None


@dataclass
class RankStatus:
    rank: int
    kind: str = ""
    identity: str = ""  # ranks pair snapshots by queue order: a rank that staged another step must not mix in
    parent: str | None = None  # the snapshot this rank's delta is against
    error: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    changed: int = 0
    elements: int = 0
    diff_s: float = 0.0
    encode_s: float = 0.0
    route_s: float = 0.0
    upload_s: float = 0.0
    blocking_ms: float = 0.0
    throttled: int = 0
    retries: int = 0


def summarize(job: Job, identity: str, kind: str, statuses: list[RankStatus], raw_bytes: int
              ) -> tuple[PublishMetrics, dict[str, int], list[str]]:
    """Rank 0's view of a snapshot from every rank's status: its metrics (times are the slowest rank's, counts
    are sums), the files written (name: bytes), and every reason it must not be committed."""
    m = PublishMetrics(step=job.step, identity=identity, kind=kind, raw_bytes=raw_bytes,
                       skipped_before=job.skipped_before)
    files = {f: n for s in statuses for f, n in s.files.items()}
    m.files = len(files)
    m.bytes_written = sum(files.values())
    m.ratio = raw_bytes / m.bytes_written if m.bytes_written else None
    m.blocking_ms = max(s.blocking_ms for s in statuses)
    for k in ("diff_s", "encode_s", "route_s", "upload_s"):
        setattr(m, k, max(getattr(s, k) for s in statuses))
    if len(statuses) > 1:  # rank 0's wait for every rank's files cannot say whose they were: this does, after
        m.slowest_rank = max(statuses, key=lambda s: s.diff_s + s.encode_s + s.upload_s).rank
    m.throttled = sum(s.throttled for s in statuses)
    m.retries = sum(s.retries for s in statuses)
    elements = sum(s.elements for s in statuses)
    if kind == "delta" and elements:
        m.changed_fraction = sum(s.changed for s in statuses) / elements
    if m.upload_s > 0:
        m.upload_mb_s = m.bytes_written / 1e6 / m.upload_s
    errors = [s.error for s in statuses if s.error]
    kinds = {s.kind for s in statuses}
    if len(kinds) > 1:  # cannot happen while every rank saw every outcome; never publish a mixed snapshot
        errors.append(f"ranks disagree on the snapshot kind: {sorted(kinds)}")
    parents = {s.parent for s in statuses if s.kind == "delta"}
    if len(parents) > 1:  # likewise: pieces against different bases must never be committed as one delta
        errors.append(f"ranks' deltas have different parents: {sorted(map(str, parents))}")
    identities = {s.identity for s in statuses}
    if len(identities) > 1:  # a rank staged a different step (an error raised and caught on one rank only)
        errors.append(f"ranks staged different steps ({', '.join(sorted(identities))}); a snapshot must hold "
                      "one step: call publish/step with the same steps on every rank")
    return m, files, errors
