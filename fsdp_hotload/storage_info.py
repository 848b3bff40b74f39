"""What :class:`~fsdp_hotload.storage.Storage` reports: its counters, and the size and time of a listed file.

Kept apart from :mod:`fsdp_hotload.storage` so the storage layer itself stays about operations and retries.

Example::

    before = st.stats.snapshot()
    st.put_bytes("snap/config.json", b"{}")
    st.stats.snapshot()["puts"] - before["puts"]      # 1
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

__all__ = ["StorageStats", "FileInfo", "mtime_of"]


@dataclass
class StorageStats:
    """Counters for one Storage, safe to update from many threads. ``seconds`` sums the time spent inside put
    calls (retries and backoff included), so under ``put_many`` it can exceed wall time."""

    puts: int = 0
    bytes_put: int = 0
    gets: int = 0
    bytes_got: int = 0
    retries: int = 0
    throttled: int = 0
    failures: int = 0
    seconds: float = 0.0
    backoff_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def snapshot(self) -> dict[str, float]:
        """A consistent copy of the counters (for per-publish metrics: take one before and one after)."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass(frozen=True)
class FileInfo:
    """Size and modification time (seconds since the epoch; None when the backend does not say) of one file."""

    size: int
    mtime: float | None


def mtime_of(info: dict[str, Any]) -> float | None:
    """The modification time in a listing entry of any backend (its key and type differ), or None."""
    for key in ("mtime", "LastModified", "updated", "modified", "created"):
        value = info.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return None
