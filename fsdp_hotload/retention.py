"""Retention: which committed snapshots may go, and deleting them (and what crashed writers left) safely.

A snapshot is complete once its commit marker is written (:mod:`fsdp_hotload.markers`, whose names are re-exported
here). The marker records the lineage (kind and parent identity) that retention needs: a delta is useless without
its parent, so deleting a base that a kept delta chain still leads back to would break every replica that follows
that chain.

Example::

    write_commit_marker(st, CommitInfo("step-8-a1b2", "delta", "step-4-a1b2", {"model-00000.safetensors":
                                                                                {"size": 1234}}))
    [c.identity for c in list_committed(st)]          # oldest first
    apply_retention(st, keep_last=3, protected={"step-4-a1b2"})   # deletes what no kept chain needs
"""
from __future__ import annotations

import logging
import math
import re
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

from .hf_config import AUX_SUBFOLDERS, is_aux_file
from .identity import validate_identity
from .layout import INDEX_FILENAME, SPEC_FILENAME
from .markers import (COMMIT_FORMAT, COMMIT_MARKER, COMMIT_VERSION, CommitInfo, CommitMarkerError, MarkerCache,
                      _is_identity, _marker_path, _snapshot_dirs, list_committed, read_commit_marker, session_of,
                      write_commit_marker)
from .storage_errors import StorageError
from .storage_local import TMP_PREFIX

if TYPE_CHECKING:
    from .storage import Storage
    from .storage_s3 import OpenUpload

__all__ = [
    "COMMIT_MARKER",
    "COMMIT_FORMAT",
    "COMMIT_VERSION",
    "CommitInfo",
    "CommitMarkerError",
    "validate_identity",
    "write_commit_marker",
    "retain_after",
    "read_commit_marker",
    "list_committed",
    "plan_retention",
    "apply_retention",
    "live_sessions",
    "session_of",
    "MarkerCache",
]

logger = logging.getLogger(__name__)


def _is_shard(relpath: str) -> bool:
    return SHARD_FILE.fullmatch(_final_name(relpath.rsplit("/", 1)[-1])) is not None


def _delete_files(storage: Storage, identity: str) -> None:
    """Delete a snapshot's folder, its shards last: a delete that stops part way then leaves a folder that
    still holds one, which the sweep of unmarked folders recognises as a publisher's (see :func:`_looks_like_ours`)
    whatever became of its run, where config and tokenizer files alone stayed once that run had no commit left."""
    storage.delete_prefix(identity, last=_is_shard)


def _delete_committed(storage: Storage, identity: str) -> None:
    """A committed snapshot's marker, then its files: a delete that stops part way leaves no marker vouching for
    files that are gone, and a later pass sweeps the unmarked folder."""
    storage.delete_prefix(_marker_path(identity))
    _delete_files(storage, identity)


def discard_snapshot(storage: Storage, identity: str) -> None:
    """Delete an uncommitted snapshot's files, best effort. Why: retention skips folders without a commit marker,
    so each failed publish would otherwise leave most of a snapshot in the bucket for good."""
    try:
        _delete_files(storage, identity)
    except Exception as exc:  # noqa: BLE001 - a later run's retention (keep_last) sweeps it
        logger.warning("hotload: could not delete the files of failed snapshot %s: %s", identity, exc)


def retract_snapshot(storage: Storage, identity: str, why: str = "no deployment took its signal") -> None:
    """Delete a committed snapshot no reader holds or can load, best effort: ``why`` says why (its signal was
    taken by no deployment, or every replica failed to load it)."""
    try:
        _delete_committed(storage, identity)
        logger.info("hotload: deleted snapshot %s: %s (keep_last)", storage.uri(identity), why)
    except Exception as exc:  # noqa: BLE001 - a later pass deletes it (it is not spared)
        logger.warning("hotload: could not delete snapshot %s (%s): %s", identity, why, exc)


def _ancestors_closure(roots: Iterable[str], by_id: dict[str, CommitInfo]) -> set[str]:
    """The roots plus every snapshot reachable through parent links (cycles and gaps tolerated)."""
    keep: set[str] = set()
    for start in roots:
        node: str | None = start
        while node is not None and node in by_id and node not in keep:
            keep.add(node)
            node = by_id[node].parent_identity
    return keep


#: How much older than a publisher's start every file of a finished run's unmarked folder must be before that
#: publisher's retention deletes it: an upload of a run still alive writes a file at least this often. Not so on
#: S3, where a file being sent in parts shows in no listing until it completes (a 5 GB shard over a slow link
#: takes longer): a folder with an open multipart upload is left alone (:func:`_uploading`).
INCOMPLETE_GRACE_S = 600.0
_warned_sessions: set[tuple[str, bool]] = set()  # (session, committed before this start) logged (once per process)
SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: The session part of a publisher's names: what a publisher picks (``secrets.token_hex(4)``).
SESSION = re.compile(r"[0-9a-f]{8}")
#: The names :func:`~fsdp_hotload.identity.new_identity` makes (prefix, six-digit step, 8-hex-digit session).
PUBLISHED_NAME = re.compile(r".+-\d{6,}-[0-9a-f]{8}")


def _looks_like_ours(identity: str, files: dict[str, Any], *, remnant: bool = False) -> bool:
    """Whether a directory without a marker could be a publisher's unfinished snapshot: flat but for the
    sub-folders a snapshot carries from the base model (``hf_config.AUX_SUBFOLDERS``, written before the marker,
    so a writer killed then leaves them), and holding at least one HF shard file, or the temp file of one (a
    writer killed mid-upload leaves only those on a local root). With ``remnant`` (its session committed snapshots
    here), only files a snapshot holds are enough: a delete that stopped part way can leave just the small ones
    (config, tokenizer, index). Anything else is left alone."""
    names = [_final_name(path[len(identity) + 1:]) for path in files]
    nested = [n.split("/") for n in names if "/" in n]
    if not names or not all(len(p) == 2 and p[0] in AUX_SUBFOLDERS for p in nested):
        return False
    if any(SHARD_FILE.fullmatch(n) for n in names):
        return True
    return remnant and all("/" in n or n in (INDEX_FILENAME, SPEC_FILENAME) or is_aux_file(n) for n in names)


def _final_name(name: str) -> str:
    """The name a local write's temp file (``<TMP_PREFIX><name>.<12 hex>``) would have been renamed to."""
    if name.startswith(TMP_PREFIX) and "." in name[len(TMP_PREFIX):]:
        return name[len(TMP_PREFIX):].rsplit(".", 1)[0]
    return name


def plan_retention(snapshots: list[CommitInfo], keep_last: int, protected: set[str] | frozenset[str],
                   present: set[str] | frozenset[str] = frozenset(),
                   uncounted: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Identities to delete (oldest first), given the committed snapshots. Pure; nothing is touched.

    Kept: the ``keep_last`` newest snapshots but the ``uncounted`` ones, every ``protected`` one (a deployment
    serves it, and the next delta will name it as parent), and all ancestors of any kept snapshot back to its full
    base. ``uncounted`` names snapshots kept for another reason (another live publisher's, protected too): counted,
    they would take the places of the caller's own, and with two publishers under one root ``keep_last=2`` would
    keep one snapshot of each, deleting the previous one a reader may still be downloading. A kept snapshot
    whose parent is not committed but ``present`` (its folder is listed: its marker was not read, say a store that
    answered "not found" once) also keeps every snapshot of the parent's session committed before it: the chain
    beyond the unread link is unknown, and its full base must not go. A ``protected`` snapshot that is ``present``
    but not committed (its own marker unread) keeps every committed snapshot of its session, for the same reason.
    """
    if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    by_id: dict[str, CommitInfo] = {}
    for snap in snapshots:
        if snap.identity in by_id:
            raise ValueError(f"snapshot {snap.identity!r} listed twice")
        by_id[snap.identity] = snap
    ordered = sorted(snapshots, key=lambda s: (s.created_at, s.identity))
    counted = [s for s in ordered if s.identity not in uncounted]
    roots = [s.identity for s in counted[-keep_last:]] + [p for p in protected if p in by_id]
    keep = _ancestors_closure(roots, by_id)
    # A protected snapshot whose marker was not read (a store that answered "not found" once) names no parent
    # here: its chain is unknown, so every snapshot of its run stays for this pass.
    for p in sorted(protected):
        if p not in by_id and p in present:
            older = [s.identity for s in ordered if session_of(s.identity) == session_of(p)]
            keep |= _ancestors_closure(older, by_id)
            if older:
                logger.warning("protected snapshot %s has no readable commit marker; retention keeps the %d "
                               "snapshot(s) of its run until it has one", p, len(older))
    unread = [s for s in ordered if s.identity in keep and s.parent_identity is not None
              and s.parent_identity not in by_id]
    for snap in unread:
        parent = snap.parent_identity
        assert parent is not None
        if parent in present:
            older = [s.identity for s in ordered if s.created_at <= snap.created_at
                     and session_of(s.identity) == session_of(parent)]
            keep |= _ancestors_closure(older, by_id)
            logger.warning("kept snapshot %s depends on %s, whose folder has no readable commit marker; retention "
                           "keeps the %d older snapshot(s) of its run until it has one or is not needed",
                           snap.identity, parent, len(older))
        else:
            logger.warning("kept snapshot %s depends on %s, which is not committed (chain broken)",
                           snap.identity, parent)
    return [s.identity for s in ordered if s.identity not in keep]


def _step_of(identity: str) -> int:
    """The step field of a name that matches ``PUBLISHED_NAME`` (``<prefix>-<step>-<session>``)."""
    return int(identity.rsplit("-", 2)[1])


#: A session whose newest commit is younger than this is live (the default of ``retention_grace_s``): a trainer
#: that publishes every few minutes may have committed a while ago and nothing since, and the snapshot its
#: deployment serves must not go (its clock may also run behind this one's). Older, it is a finished run (a
#: trainer restarted into the same bucket leaves one).
LIVE_GRACE_S = 3600.0


def live_sessions(snapshots: Iterable[CommitInfo], session: str, since: float, now: float | None = None, *,
                  grace_s: float = LIVE_GRACE_S) -> dict[str, list[str]]:
    """Other publishers' sessions that committed a snapshot since this one started (``since``), or less than
    ``grace_s`` before ``now`` (default: ``since``), with all their snapshots. Why: a bucket shared by two
    trainers (by mistake, or two experiments under one root) must not lose one trainer's served snapshots to the
    other's retention; a session silent for longer is a finished run, whose snapshots retention may delete as
    usual. Judged at ``now`` for the runs before this one: a run that crashed just before its restart stays live
    for an hour, not for the whole new run."""
    cutoff = min(since, (since if now is None else now) - grace_s)
    by_session: dict[str, list[CommitInfo]] = {}
    for snap in snapshots:
        if session_of(snap.identity) != session:
            by_session.setdefault(session_of(snap.identity), []).append(snap)
    return {k: [s.identity for s in v] for k, v in by_session.items() if max(s.created_at for s in v) >= cutoff}


def _store_time_of_newest(storage: Storage, committed: list[CommitInfo], session: str) -> float:
    """The store's clock at this session's newest commit (its files' newest time), or +inf without one.

    Why: file times come from the store's clock and ``since`` from the trainer's; with the trainer's clock
    ahead by more than the grace period, a fresh upload of another run would look abandoned. Comparing with
    the earlier of the two keeps the test conservative whichever clock runs ahead."""
    ours = [c.identity for c in committed if session_of(c.identity) == session]
    if not ours:
        return math.inf
    times = [f.mtime for f in storage.list_info(ours[-1]).values() if f.mtime is not None]
    return max(times) if times else math.inf


#: How long ago an upload of a session that is not live (see :func:`live_sessions`) must have begun, by the
#: store's clock, before retention aborts it: far longer than one file's upload takes under Storage's deadlines.
ABANDONED_UPLOAD_AGE_S = 3 * 3600.0
_uploads_unlisted: set[str] = set()  # roots whose open uploads could not be listed (warned once per process)


def _open_uploads(storage: Storage) -> list[OpenUpload] | None:
    """:meth:`Storage.open_uploads`, or None (said once per root) where they cannot be listed."""
    try:
        return storage.open_uploads()
    except StorageError as exc:  # e.g. a policy without s3:ListBucketMultipartUploads: retention goes on
        if storage.uri("") not in _uploads_unlisted:
            _uploads_unlisted.add(storage.uri(""))
            logger.warning("hotload: retention cannot list the open multipart uploads under %s, so those a killed "
                           "writer left are not aborted (a bucket lifecycle rule can), nor are the folders other "
                           "runs left without a marker deleted (any may hold a live upload): %s", storage.uri(""), exc)
        return None


def _unmarked_grace(storage: Storage) -> float:
    """How old every file of an unmarked folder must be before it is swept. Where an upload in flight shows in no
    listing and cannot be listed (GCS's resumable uploads), its folder's finished files say nothing of a shard still
    being sent there, however old they are: such a folder goes only at the age an open S3 upload is aborted."""
    return ABANDONED_UPLOAD_AGE_S if storage.hidden_uploads else INCOMPLETE_GRACE_S


def _uploading(uploads: list[OpenUpload] | None, now: float) -> set[str]:
    """The folders with an open multipart upload begun less than ``ABANDONED_UPLOAD_AGE_S`` before ``now`` (or at
    a time the store does not give): a live writer may be sending a shard there, which no listing shows until it
    completes, so the folder's finished files, however old, do not tell an abandoned folder. The uploads must be
    listed before any folder judged, so that an upload completing in between shows as a fresh file there instead;
    where they could not be listed (None), no folder can be told apart from a live upload."""
    return {u.relpath.partition("/")[0] for u in uploads or ()
            if u.initiated is None or u.initiated >= now - ABANDONED_UPLOAD_AGE_S}


def _abort_abandoned_uploads(storage: Storage, uploads: list[OpenUpload] | None, committed: list[CommitInfo],
                             session: str, live: set[str], newest_own: int) -> None:
    """Abort the open multipart uploads (S3) that no writer will finish.

    Why: a writer killed mid-upload leaves its uploads open; the store keeps (and bills) their parts for good,
    and no listing, so no other pass here, sees them. Only shard uploads, flat under a name a publisher makes,
    are judged: this session's up to its newest commit go (every write up to there has ended; later ones are
    in flight), and a session's that is not live once begun ``ABANDONED_UPLOAD_AGE_S`` ago. Live sessions'
    uploads stay.
    """
    now: float | None = None  # the store's time, read only when an upload of another session is there to judge
    for upload in uploads or ():
        identity, _, name = upload.relpath.partition("/")
        if not (PUBLISHED_NAME.fullmatch(identity) and _is_identity(identity) and SHARD_FILE.fullmatch(name)):
            continue
        owner = session_of(identity)
        if owner == session:
            if _step_of(identity) > newest_own:
                continue
        else:
            if owner in live or upload.initiated is None:
                continue
            if now is None:
                now = min(time.time(), _store_time_of_newest(storage, committed, session))
            if upload.initiated >= now - ABANDONED_UPLOAD_AGE_S:
                continue
        try:
            storage.abort_upload(upload)
        except StorageError as exc:
            logger.warning("hotload: could not abort the open upload of %s: %s", storage.uri(upload.relpath), exc)
            return  # the next pass tries again
        logger.info("retention: aborted the open upload of %s, left by a %s", storage.uri(upload.relpath),
                    "failed upload of this run" if owner == session else "finished run")


def _reread_kept(storage: Storage, committed: list[CommitInfo], keep_last: int, protected: frozenset[str],
                 markers: MarkerCache) -> list[CommitInfo]:
    """``committed`` with the markers taken from ``markers`` that the pass may keep by count or protects read
    again, and those now gone left out. Why: a cached marker someone else removed (an operator retracting a
    snapshot) took a ``keep_last`` place, and the snapshot an operator rolls back to went instead. Only this
    session's markers are cached, and those kept by count are among its ``keep_last`` newest (another live
    session's hold no place, so this run's may be older than the newest of all): about ``keep_last`` GETs per pass;
    an older cached marker only adds parents to what is kept, or goes anyway."""
    checked: set[str] = set()
    while True:
        by_id = {c.identity: c for c in committed}
        own = [c.identity for c in committed if session_of(c.identity) == markers.session]
        suspects = (set(own[-keep_last:]) | (protected & by_id.keys())) & markers.reused
        suspects -= checked
        if not suspects:
            return committed
        checked |= suspects
        again = {c.identity: c for c in list_committed(storage, dirs=sorted(suspects))}
        for identity in suspects - again.keys():
            markers.forget(identity)
            logger.info("retention: %s lost its commit marker since it was read", storage.uri(identity))
        committed = [again.get(c.identity, c) for c in committed if c.identity in again or c.identity not in suspects]


def retain_after(storage: Storage, keep_last: int, identity: str, *, session: str, since: float,
                 grace_s: float = LIVE_GRACE_S, keep: Iterable[str] = (), markers: MarkerCache | None = None,
                 spare: Callable[[], Iterable[str]] | None = None) -> None:
    """:func:`apply_retention` once ``identity`` is served, protecting it, ``keep`` (snapshots the run reads
    from) and what ``spare`` returns: a problem is logged, not raised, since the snapshot is served already and
    the next publish tries again."""
    try:
        apply_retention(storage, keep_last, protected={identity, *keep}, session=session, since=since,
                        grace_s=grace_s, markers=markers, spare=spare)
    except Exception as exc:  # noqa: BLE001
        logger.warning("hotload: retention after %s failed (retried at the next publish): %s", identity, exc)


def apply_retention(storage: Storage, keep_last: int, protected: Iterable[str] = frozenset(), *,
                    delete_incomplete: bool = False, session: str | None = None, since: float = 0.0,
                    now: float | None = None, grace_s: float = LIVE_GRACE_S,
                    markers: MarkerCache | None = None, spare: Callable[[], Iterable[str]] | None = None) -> list[str]:
    """Delete the snapshots :func:`plan_retention` gives up, and return their identities (in deletion order).

    With ``session`` (the caller's identity suffix) and ``since`` (when the caller started, ``time.time()``),
    snapshots of another session that committed since then, or within ``grace_s`` of ``now`` (default:
    ``time.time()``), are kept with their chains, and hold no ``keep_last`` place; a warning names a session that
    committed since this one started: another publisher is live under this root. Folders without a marker that a
    session left (a crash mid-upload, a delete that stopped part way) go too, only under names a publisher makes
    (``PUBLISHED_NAME``) and never a committed snapshot's parent: a finished session's (it committed here, and is
    not live) once every file in them is ``INCOMPLETE_GRACE_S`` old, by the store's time of this session's newest
    commit (or ``now``, when earlier); a session's that never committed once every file is that much older than
    ``since`` (or than that store time). On S3, the multipart uploads such a folder's writer left open go too (see
    :func:`_abort_abandoned_uploads`); where uploads in flight cannot be listed (GCS:
    :attr:`~fsdp_hotload.storage.Storage.hidden_uploads`), ``ABANDONED_UPLOAD_AGE_S`` replaces
    ``INCOMPLETE_GRACE_S``, since a shard still being sent there shows in no listing until it completes.

    Children go before parents, and each snapshot loses its commit marker before its files, so a crash half way
    leaves no committed snapshot whose chain or files are gone; its shards go last, so what such a crash leaves
    is still recognised as a publisher's folder, and swept by a later pass.

    ``spare`` is called once the commit markers are read, and those of the identities it returns that are
    committed are protected too: a publisher's snapshots committed since the one its pass runs for, known only
    once the listing is done (a pass over many markers takes seconds, and a snapshot committed meanwhile may be
    served by some replica).

    ``delete_incomplete`` (off by default) also removes directories without a marker whose files are all older
    than the newest committed snapshot. It is off because an upload in flight looks exactly like an abandoned
    one: at a full-snapshot step a delta may be committed while the full one is still uploading, and another
    trainer or rank may be mid-publish. Only turn it on when no publisher can be writing under this root. Its
    age test compares the store's file times with the trainer's ``created_at`` clock. Directories whose names
    are not identities are never touched, nor are those that do not look like a publisher's: a snapshot is flat
    but for its chat templates' folder and holds HF shard files (``model-00001-of-00004.safetensors``), so another
    nested tree or a folder of other files stays.
    """
    protected = frozenset(protected)
    dirs = _snapshot_dirs(storage)
    committed = list_committed(storage, dirs=dirs, markers=markers)
    if spare is not None:  # asked once the markers are read: a commit that landed while they were is spared too;
        # one whose marker the listing missed is not deleted anyway (nor named protected: it would keep its run's)
        protected |= frozenset(spare()) & {c.identity for c in committed}
    if markers is not None:
        committed = _reread_kept(storage, committed, keep_last, protected, markers)
    by_id = {c.identity: c for c in committed}
    now = time.time() if now is None else now
    live = live_sessions(committed, session, since, now, grace_s=grace_s) if session is not None else {}
    if session is not None:
        for other, identities in live.items():
            protected |= frozenset(identities)
            before = max(by_id[i].created_at for i in identities) < since  # a run before this one (a restart)
            if (other, before) in _warned_sessions:
                continue
            _warned_sessions.add((other, before))
            if before:
                logger.info("hotload: keeping the snapshots of session %s (newest %s, committed before this "
                            "publisher started) until it has been silent for %g s: a deployment may still serve "
                            "them (retention_grace_s)", other, identities[-1], grace_s)
            else:
                logger.warning("hotload: another publisher (session %s, newest snapshot %s) commits snapshots under "
                               "%s too; retention keeps them. Give each trainer its own bucket_url: two trainers "
                               "signalling one deployment replace each other's weights and break each other's "
                               "delta chains", other, identities[-1], storage.uri(""))
    # another live publisher's snapshots are kept anyway (protected): they hold no keep_last place
    doomed = plan_retention(committed, keep_last, protected, frozenset(dirs),
                            frozenset(i for identities in live.values() for i in identities))
    deleted: list[str] = []
    for identity in sorted(doomed, key=lambda i: (by_id[i].created_at, i), reverse=True):
        if markers is not None:
            markers.forget(identity)
        _delete_committed(storage, identity)
        deleted.append(identity)
        logger.info("retention: deleted snapshot %s", storage.uri(identity))
    foreign: dict[str, list[str]] = {}
    for identity in deleted if session is not None else ():
        if session_of(identity) != session:
            foreign.setdefault(session_of(identity), []).append(identity)
    for other, gone in foreign.items():  # a trainer still running that commits less often than grace_s looks so
        newest = max(c.created_at for c in committed if session_of(c.identity) == other)
        logger.warning("hotload: retention deleted %d snapshot(s) of session %s (e.g. %s), a run taken for finished: "
                       "its newest commit is %.0f s old, more than retention_grace_s=%g; if that run still publishes "
                       "(less often than that), raise retention_grace_s above its interval", len(gone), other,
                       gone[0], now - newest, grace_s)
    # A committed snapshot's parent is never swept, also where its marker was not read (see plan_retention).
    parents = {c.parent_identity for c in committed if c.parent_identity is not None}
    # before any folder is listed (see _uploading); None where they cannot be listed
    uploads = _open_uploads(storage) if session is not None or delete_incomplete else None
    if session is not None:
        store_time: float | None = None  # read from the store only when an unmarked folder is there to judge
        uploading: set[str] = set()  # the folders a live writer may be sending to (with store_time)
        sessions = {session_of(c.identity) for c in committed}
        # This session's snapshots commit in step order, and those in flight are newer than its newest commit:
        # an unmarked folder of its own below that step lost its marker to a delete that then failed, or is a
        # failed snapshot whose discard failed. Skipped like a live upload, it stayed for the rest of the run.
        own_steps = [_step_of(c.identity) for c in committed
                     if session_of(c.identity) == session and PUBLISHED_NAME.fullmatch(c.identity)]
        newest_own = max(own_steps) if own_steps else -1
        for identity in dirs:
            if identity in by_id or identity in protected or identity in parents:
                continue
            if (session_of(identity) == session and PUBLISHED_NAME.fullmatch(identity)
                    and _step_of(identity) < newest_own):
                _delete_files(storage, identity)
                deleted.append(identity)
                logger.info("retention: deleted %s, left by a failed delete or upload of this run",
                            storage.uri(identity))
                continue
            # Only names a publisher makes: a model folder kept under the root ("qwen3-8b", its shards a day
            # old) is also flat, unmarked and old, and is not a crashed upload. Tested before the listing, which
            # would otherwise read such a folder whole on every publish.
            if session_of(identity) in {session, *live} or not PUBLISHED_NAME.fullmatch(identity):
                continue
            # A run that committed here and is not live has ended (its snapshots go too): its folders are judged at
            # the store's time now, also one it left a minute before this publisher started. One that never
            # committed could be a new run's first upload, so only its folders older than this publisher's start go.
            finished = session_of(identity) in sessions
            if store_time is None:
                store_time = _store_time_of_newest(storage, committed, session)
                uploading = _uploading(uploads, min(time.time(), store_time))
            if uploads is None or identity in uploading:
                continue
            limit = min(now if finished else since, store_time) - _unmarked_grace(storage)
            infos = storage.list_info(identity, include_temp=True)
            times = [f.mtime for f in infos.values()]
            if (_looks_like_ours(identity, infos, remnant=finished) and times
                    and all(t is not None and t < limit for t in times)):
                _delete_files(storage, identity)
                deleted.append(identity)
                logger.info("retention: deleted %s, left incomplete by a finished run", storage.uri(identity))
        _abort_abandoned_uploads(storage, uploads, committed, session, set(live), newest_own)
    if delete_incomplete and committed:
        newest = committed[-1].created_at
        uploading = _uploading(uploads, time.time())
        for identity in dirs:
            if identity in by_id or identity in protected or identity in deleted or identity in parents:
                continue
            if uploads is None or identity in uploading:
                continue
            infos = storage.list_info(identity, include_temp=True)
            if not _looks_like_ours(identity, infos):
                continue  # a name that could be an identity, but contents no publisher writes: not ours
            times = [f.mtime for f in infos.values()]
            if any(t is None for t in times):
                continue  # empty, or the backend gives no times: its age is unknown, keep it
            newest_file = max(t for t in times if t is not None)
            if storage.hidden_uploads and newest_file >= now - ABANDONED_UPLOAD_AGE_S:
                continue  # a shard of it may still be in flight, which no listing shows
            if newest_file < newest:
                _delete_files(storage, identity)
                deleted.append(identity)
                logger.info("retention: deleted incomplete snapshot %s", storage.uri(identity))
    return deleted
