"""At start, with several ranks: is ``bucket_url`` one place for every rank?

Why: each rank uploads the files it owns under the root, and rank 0 checks them, writes the manifests and the
commit marker. A root that is not the same place for every rank (``memory://``, which is each process's own; a
local folder on each node's own disk; a path that resolves differently per rank) left every publish failing with
"cannot commit ...: <file> is missing", for the whole run, while the other ranks filled their own disks with files
no reader sees. Now the publisher fails at construction, on every rank, with one error that says what to give.

How, and what it costs: ``memory://`` is refused outright. Otherwise rank 0 writes one small object under the root
(:data:`PROBE_PREFIX` and the publisher's agreed key: a hidden name, never a folder, so no listing of snapshots,
commit check or retention pass takes it for a snapshot), the other ranks read it back with the storage's retries
and deadlines, and say over the trainer's side group, in one gather and one broadcast (bounded by its timeout, as
the start's agreement is), whether they saw it; rank 0 deletes it. The root's snapshots are not listed.

Example::

    refuse_process_local_root(storage, world=2)      # ValueError for memory://
    probe = RootProbe.write(storage, key) if rank == 0 else None
    check_shared_root(ctrl, storage, key)             # every rank; ValueError naming the ranks that saw nothing
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .comm import Comm

if TYPE_CHECKING:
    from ..storage import Storage

log = logging.getLogger("fsdp_hotload")

#: The probe's name under the root: a file (never a folder), starting with "." as no snapshot identity may.
PROBE_PREFIX = ".hotload-root-probe-"
PROBE_WAIT_S = 5.0  # how long a rank looks again for a probe not found (a network filesystem's caches)
#: Each probe call's budget: a store that is down or silent at start holds construction this long, not for a
#: publish's whole retry budget; the first publish then reports it with that budget.
PROBE_ATTEMPTS, PROBE_CALL_TIMEOUT_S = 2, 30.0
_FIRST_LOOK_S = 0.1  # the first pause between two looks; doubled up to 1 s
_SHARED = ("give every rank one shared root: an object store (s3://, gs://) or a filesystem that every node "
           "mounts at that same path (NFS, Lustre, ...)")


def probe_name(key: str) -> str:
    """The probe's relpath under the root for the publisher whose agreed key is ``key``."""
    return f"{PROBE_PREFIX}{key}"


def _content(key: str) -> bytes:
    return f"hotload root probe {key}\n".encode()


def refuse_process_local_root(storage: Storage, world: int) -> None:
    """ValueError where ``storage`` is this process's memory and ``world`` ranks (processes) must share it."""
    proto = getattr(storage.fs, "protocol", ())
    if world > 1 and "memory" in ([proto] if isinstance(proto, str) else proto):
        raise ValueError(
            f"bucket_url {storage.uri('')!r} is this process's memory, which the job's other {world - 1} rank(s) "
            "cannot see: each rank writes the files it owns there, so rank 0 could never commit a snapshot. "
            f"memory:// is for single-process use; with {world} ranks, {_SHARED}")


def _bounded(storage: Storage) -> Storage:
    """``storage`` with the probe's budget (a storage given by a caller without ``limited`` as it is)."""
    limited = getattr(storage, "limited", None)
    return storage if limited is None else limited(max_attempts=PROBE_ATTEMPTS, call_timeout_s=PROBE_CALL_TIMEOUT_S)


class RootProbe:
    """The object rank 0 wrote under the root; :meth:`close` deletes it (best effort, once)."""

    def __init__(self, storage: Storage, key: str) -> None:
        self.storage, self.name = storage, probe_name(key)
        self._deleted = False

    @classmethod
    def write(cls, storage: Storage, key: str) -> "RootProbe | None":
        """Rank 0: write the probe, under the probe's budget. A refusal for good (no permission, no such bucket)
        raises, naming ``bucket_url``: no snapshot could be written either. A store that did not answer in time
        (down, throttling) is warned about and None returned: the check is skipped, and the first publish, with
        the full retry budget, reports what is wrong, as it did before this check."""
        from ..storage_errors import classify_error

        probe = cls(_bounded(storage), key)
        try:
            probe.storage.put_bytes(probe.name, _content(key))
        except Exception as exc:
            if classify_error(getattr(exc, "cause", None) or exc.__cause__ or exc).retryable:
                log.warning("hotload: could not check at start that every rank sees bucket_url %r: rank 0 could not "
                            "write a small file there (%s); the check is skipped: %s", storage.uri(""), probe.name,
                            exc)
                return None
            raise RuntimeError(f"bucket_url {storage.uri('')!r}: rank 0 could not write a small file there at start "
                               f"({probe.name}), so no snapshot could be written either: {exc}") from exc
        return probe

    def close(self) -> None:
        if self._deleted:
            return
        self._deleted = True
        try:
            self.storage.delete_prefix(self.name)
        except Exception as exc:  # noqa: BLE001 - a few bytes, under a name nothing else reads
            log.warning("hotload: could not delete %s, written at start to check that every rank sees bucket_url "
                        "(safe to delete): %s", self.storage.uri(self.name), exc)


def _look(storage: Storage, key: str, wait_s: float) -> tuple[str, str]:
    """This rank's view of the probe: ("seen", ""), ("missing", why) or ("unreadable", the error)."""
    name, pause = probe_name(key), _FIRST_LOOK_S
    until = time.monotonic() + wait_s
    while True:
        try:
            held = storage.get_bytes(name, size_hint=256)
            if held == _content(key):
                return "seen", ""
            why = f"{storage.uri(name)} holds other bytes than rank 0 wrote"
        except FileNotFoundError:
            why = f"{storage.uri(name)} is not there"
        except Exception as exc:  # noqa: BLE001 - e.g. no read permission: this rank may still write
            return "unreadable", f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= until:
            return "missing", why
        time.sleep(min(pause, max(0.0, until - time.monotonic())))
        pause = min(pause * 2, 1.0)


def check_shared_root(ctrl: Comm, storage: Storage, key: str, probe: RootProbe | None, *,
                      wait_s: float = PROBE_WAIT_S) -> None:
    """Collective at construction, after the ranks agreed on ``key`` (rank 0 wrote ``probe`` before): returns on
    every rank, or raises the same ValueError on every rank, naming the ranks that could not see the probe. A rank
    that could not read it for another reason (no read permission: only rank 0 reads the bucket) is logged by rank
    0, not refused. Every rank takes part in each collective whatever its own look raised."""
    # Whether rank 0 wrote it: where it could not in time (warned), the others need not look for it, each look
    # waiting out the same budget against a store that is down.
    if not ctrl.broadcast(probe is not None if ctrl.rank == 0 else None):
        return
    try:
        seen = ("seen", "") if ctrl.rank == 0 else _look(_bounded(storage), key, wait_s)
    except Exception as exc:  # noqa: BLE001 - told to rank 0 like any other view
        seen = ("unreadable", f"{type(exc).__name__}: {exc}")
    gathered = ctrl.gather(seen)
    verdict: list[tuple[int, str]] | None = None
    if gathered is not None:
        if probe is not None:
            probe.close()
        verdict = [(r, why) for r, (kind, why) in enumerate(gathered) if kind == "missing"]
        for r, (kind, why) in enumerate(gathered):
            if kind == "unreadable":
                log.warning("hotload: rank %d could not read back the file rank 0 wrote under bucket_url %r at "
                            "start, so whether it writes to the same place is unknown (if it does not, every "
                            "publish fails; %s): %s", r, storage.uri(""), _SHARED, why)
    missing = ctrl.broadcast(verdict)
    if missing:
        ranks = ", ".join(str(r) for r, _ in missing)
        raise ValueError(
            f"bucket_url {storage.uri('')!r} is not the same place on every rank: rank(s) {ranks} of {ctrl.world} "
            f"could not see the file rank 0 wrote there at start (rank {missing[0][0]}: {missing[0][1]}). Each rank "
            "writes the files it owns under bucket_url and rank 0 checks them and commits the snapshot, so every "
            f"publish would fail. A local folder on each node's own disk is not shared: {_SHARED}")
