"""Commit markers: which snapshots in the bucket are complete, and what chain each one sits in.

Object stores have no rename, so a snapshot cannot appear atomically. Instead the publisher uploads every file
first and then writes ``<identity>/hotload.commit.json`` last; readers treat a snapshot directory without it as
incomplete. The marker also records the lineage (kind and parent identity) that retention
(:mod:`fsdp_hotload.retention`, which re-exports these names) needs.

Example::

    write_commit_marker(st, CommitInfo("step-8-a1b2", "delta", "step-4-a1b2", {"model-00000.safetensors":
                                                                                {"size": 1234}}))
    [c.identity for c in list_committed(st)]          # oldest first
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .daemon_pool import DaemonPool
from .identity import validate_identity

if TYPE_CHECKING:
    from .storage import Storage

logger = logging.getLogger("fsdp_hotload.retention")  # one logger for markers and retention, as before

COMMIT_MARKER = "hotload.commit.json"
COMMIT_FORMAT = "hotload-commit"
COMMIT_VERSION = 1
_KINDS = ("full", "delta")


class CommitMarkerError(ValueError):
    """A commit marker is malformed, or does not match the files it claims; the message names its URI."""



@dataclass
class CommitInfo:
    """The content of a commit marker: one complete snapshot and where it sits in its chain.

    Example::

        CommitInfo("step-8-a1b2", "delta", parent_identity="step-4-a1b2",
                   files={"model-00000.safetensors": {"size": 1234}})
    """

    identity: str
    kind: str
    parent_identity: str | None = None
    files: dict[str, dict[str, int]] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        validate_identity(self.identity)
        if self.kind not in _KINDS:
            raise ValueError(f"snapshot {self.identity}: kind must be 'full' or 'delta', got {self.kind!r}")
        if self.kind == "delta":
            validate_identity(self.parent_identity, what=f"snapshot {self.identity}: parent_identity")
            if self.parent_identity == self.identity:
                raise ValueError(f"snapshot {self.identity}: a delta cannot be its own parent")
        elif self.parent_identity is not None:
            raise ValueError(f"snapshot {self.identity}: a full snapshot has no parent_identity, "
                             f"got {self.parent_identity!r}")
        if not isinstance(self.files, dict):
            raise ValueError(f"snapshot {self.identity}: files must be an object, got {type(self.files).__name__}")
        for rel, meta in self.files.items():
            parts = rel.split("/") if isinstance(rel, str) else [""]
            if any(p in ("", ".", "..") for p in parts) or rel == COMMIT_MARKER:
                raise ValueError(f"snapshot {self.identity}: bad file name {rel!r}")
            size = meta.get("size") if isinstance(meta, dict) else None
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"snapshot {self.identity}: file {rel!r} needs a non-negative int 'size', "
                                 f"got {meta!r}")
        if (not isinstance(self.created_at, (int, float)) or isinstance(self.created_at, bool)
                or not math.isfinite(self.created_at)):
            raise ValueError(f"snapshot {self.identity}: created_at must be a finite number, "
                             f"got {self.created_at!r}")
        self.created_at = float(self.created_at)

    @property
    def total_bytes(self) -> int:
        return sum(meta["size"] for meta in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "identity": self.identity, "kind": self.kind,
                "parent_identity": self.parent_identity,
                "files": {rel: {"size": meta["size"]} for rel, meta in sorted(self.files.items())},
                "created_at": self.created_at}

    @classmethod
    def from_json(cls, obj: Any, *, source: str = "<commit marker>") -> CommitInfo:
        """Parse and validate a marker's JSON object; errors name ``source`` (the marker's URI)."""
        if not isinstance(obj, dict):
            raise CommitMarkerError(f"{source}: expected a JSON object, got {type(obj).__name__}")
        if obj.get("format") != COMMIT_FORMAT:
            raise CommitMarkerError(f"{source}: format is {obj.get('format')!r}, expected {COMMIT_FORMAT!r}")
        version = obj.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CommitMarkerError(f"{source}: bad version {version!r}")
        if version > COMMIT_VERSION:
            raise CommitMarkerError(f"{source}: version {version} is newer than this reader "
                                    f"(supports {COMMIT_VERSION}); upgrade hotload")
        missing = [k for k in ("identity", "kind", "files", "created_at") if k not in obj]
        if missing:
            raise CommitMarkerError(f"{source}: missing field(s) {', '.join(missing)}")
        try:
            return cls(identity=obj["identity"], kind=obj["kind"], parent_identity=obj.get("parent_identity"),
                       files=obj["files"], created_at=obj["created_at"])
        except (ValueError, TypeError, AttributeError) as exc:
            raise CommitMarkerError(f"{source}: {exc}") from exc


def _marker_path(identity: str) -> str:
    return f"{validate_identity(identity)}/{COMMIT_MARKER}"


def write_commit_marker(storage: Storage, info: CommitInfo, *, verify: bool = True) -> None:
    """Mark a snapshot complete. Call it only after every file is durable: readers take it as the signal.

    With ``verify`` (default) the snapshot's listing is checked first, so a marker never vouches for a file that
    is missing or has the wrong size (one listing call, not one request per file).
    """
    path = _marker_path(info.identity)
    if verify:
        listing = storage.list_info(info.identity)
        for rel, meta in sorted(info.files.items()):
            found = listing.get(f"{info.identity}/{rel}")
            if found is None:
                raise CommitMarkerError(f"cannot commit {storage.uri(path)}: {storage.uri(info.identity + '/' + rel)}"
                                        f" is missing")
            if found.size != meta["size"]:
                raise CommitMarkerError(f"cannot commit {storage.uri(path)}: {rel} has {found.size} bytes, "
                                        f"the marker says {meta['size']}")
    storage.put_bytes(path, json.dumps(info.to_json(), indent=1, sort_keys=True).encode())


def commit_snapshot(storage: Storage, identity: str, kind: str, parent: str | None, weight_files: dict[str, int],
                    small_files: dict[str, bytes], before_marker: Callable[[], None] | None = None) -> None:
    """Write a snapshot's small files (configs, tokenizer, index and spec), then its commit marker over them and
    the weight files already uploaded (name: bytes). Why in this order: the marker is what readers wait for.
    ``before_marker`` may raise to leave the snapshot uncommitted (its writer was given up on meanwhile)."""
    storage.put_many({f"{identity}/{k}": v for k, v in small_files.items()})
    if before_marker is not None:
        before_marker()
    sizes = {**weight_files, **{k: len(v) for k, v in small_files.items()}}
    write_commit_marker(storage, CommitInfo(identity=identity, kind=kind,
                                            parent_identity=parent if kind == "delta" else None,
                                            files={k: {"size": n} for k, n in sizes.items()},
                                            created_at=time.time()))


#: A bound on a commit marker's size for its read's deadline (a marker of 10,000 files is about 1 MB).
_MARKER_READ_BOUND = 16 * 2**20


def read_commit_marker(storage: Storage, identity: str) -> CommitInfo | None:
    """The snapshot's marker, or None when it has none (incomplete, or still uploading)."""
    path = _marker_path(identity)
    uri = storage.uri(path)
    try:
        raw = storage.get_bytes(path, size_hint=_MARKER_READ_BOUND)  # no size request first: a pass reads many
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CommitMarkerError(f"{uri}: not valid JSON ({exc})") from exc
    info = CommitInfo.from_json(obj, source=uri)
    if info.identity != identity:
        raise CommitMarkerError(f"{uri}: names identity {info.identity!r} but lives in directory {identity!r}")
    return info


def _is_identity(name: str) -> bool:
    try:
        validate_identity(name)
    except ValueError:
        return False
    return True


_foreign_lock = threading.Lock()
_foreign_logged: set[str] = set()


def _snapshot_dirs(storage: Storage) -> list[str]:
    """The directories under the root whose names could be snapshot identities.

    The root may be shared with other tools (``my logs``, ``.trash``, ``date=2024``); a name no publisher could
    have written is not ours, so it is skipped (never read, never deleted) instead of failing every retention
    pass. Each such name is logged once per process.
    """
    ours: list[str] = []
    for name in storage.list_dirs():
        if _is_identity(name):
            ours.append(name)
            continue
        uri = storage.uri(name)
        with _foreign_lock:
            if uri in _foreign_logged:
                continue
            _foreign_logged.add(uri)
        logger.info("ignoring %s: its name is not a snapshot identity, so it is not a snapshot", uri)
    return ours


def list_committed(storage: Storage, *, strict: bool = True, dirs: list[str] | None = None,
                   markers: MarkerCache | None = None) -> list[CommitInfo]:
    """Every committed snapshot under the root, oldest first (by ``created_at``, then identity).

    A malformed marker raises (``strict``, the default: retention must not act on a bucket it cannot read), or
    is logged and skipped. Directories whose names are not identities are not snapshots and are skipped.
    ``dirs``: the root's snapshot directories, when the caller has just listed them. ``markers``: the markers of
    earlier passes, reused where it may (see :class:`MarkerCache`) and updated.
    """
    dirs = _snapshot_dirs(storage) if dirs is None else dirs
    if markers is not None:
        known = markers.reusable(dirs)
        infos = [*known.values(), *list_committed(storage, strict=strict, dirs=[d for d in dirs if d not in known])]
        markers.update(infos)
        return sorted(infos, key=lambda i: (i.created_at, i.identity))
    if not dirs:
        return []

    def read(identity: str) -> CommitInfo | None:
        try:
            return read_commit_marker(storage, identity)
        except CommitMarkerError:
            if strict:
                raise
            logger.warning("skipping snapshot %s: bad commit marker", storage.uri(identity), exc_info=True)
            return None

    pool = DaemonPool(max(1, min(getattr(storage, "max_concurrency", 8), len(dirs))), "hotload-markers")
    futures = [pool.submit(read, d) for d in dirs]  # daemons: an exit is not held by a hung read
    try:
        infos = [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()
        pool.shutdown(wait=False)
    return sorted((i for i in infos if i is not None), key=lambda i: (i.created_at, i.identity))


class MarkerCache:
    """The commit markers one publisher's retention passes have read, so that a pass reads only the new ones.

    Why: retention keeps the newest full snapshot's whole delta chain, and read every marker on each pass: with
    ``full_every=1000`` that is a GET per snapshot of the chain on every publish. Only the caller's own session's
    markers are reused (its snapshots are deleted by its own passes, which :meth:`forget` them first), and only
    while their folder is still listed; other sessions' are read again each pass, since another publisher (or an
    operator) may delete them. A marker of this session someone else removed (an operator retracting a snapshot)
    would still count: :func:`~fsdp_hotload.retention.apply_retention` reads again those a pass keeps by count or
    protects. Bounded by the folders listed in the newest pass.

    Example::

        markers = MarkerCache(session="a1b2c3d4")
        apply_retention(st, 3, {"step-8-a1b2c3d4"}, session="a1b2c3d4", markers=markers)   # reads every marker
        apply_retention(st, 3, {"step-9-a1b2c3d4"}, session="a1b2c3d4", markers=markers)   # reads step 9's
    """

    def __init__(self, session: str) -> None:
        self.session = session
        self._known: dict[str, CommitInfo] = {}
        self._lock = threading.Lock()
        self.reused: frozenset[str] = frozenset()  # the identities the newest pass took from here, not the store

    def reusable(self, dirs: list[str]) -> dict[str, CommitInfo]:
        """The markers known for ``dirs`` (the folders listed now); those of other folders are let go."""
        listed = set(dirs)
        with self._lock:
            self._known = {i: c for i, c in self._known.items() if i in listed}
            self.reused = frozenset(self._known)
            return dict(self._known)

    def update(self, infos: Iterable[CommitInfo]) -> None:
        with self._lock:
            self._known.update((c.identity, c) for c in infos if session_of(c.identity) == self.session)

    def forget(self, identity: str) -> None:
        with self._lock:
            self._known.pop(identity, None)


def session_of(identity: str) -> str:
    """The session part of an identity made by :func:`~fsdp_hotload.identity.new_identity` (its last field)."""
    return identity.rsplit("-", 1)[-1]
