"""Rank 0's end of a snapshot: manifests and commit marker, the signal and the wait for readiness, retention.

Why apart from the publisher: this step sees only the shard plan, the storage, the signaller and what every rank
reported, never chunks, buffers or threads, so it stays a narrow interface between storage and signalling.

Example::

    committer = Committer(plan, storage, config, aux_files, signaller, session="a1b2c3d4", started=time.time())
    outcome = committer.finish(job, "step-000040-a1b2c3d4", "delta", parent, statuses, progress)
    if outcome.ok:
        committer.retain("step-000040-a1b2c3d4")   # once every rank knows the outcome; on its own thread
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..config import HotloadConfig
from ..layout import ShardPlan
from ..storage import Storage
from .jobs import Job, Outcome, PublishError, RankStatus, summarize
from .signal import LoadedNowhere, NotSignalled, Signaller

if TYPE_CHECKING:
    from ..markers import MarkerCache

logger = logging.getLogger("fsdp_hotload")
GAVE_UP = "close() gave up on it (close_timeout_s)"


class Committer:
    """Commits, signals and retains the snapshots of one publisher (on rank 0). ``aux``: the non-weight files
    every snapshot carries (config, tokenizer); ``started``: the publisher's start, for retention."""

    def __init__(self, plan: ShardPlan, storage: Storage, config: HotloadConfig, aux: dict[str, bytes],
                 signaller: Signaller | None, *, session: str, started: float) -> None:
        self.plan, self.storage, self.config, self.aux = plan, storage, config, aux
        self.signaller, self.session, self.started = signaller, session, started
        self._manifests: dict[str, bytes] = {}
        self._retention = threading.Condition()
        self._retaining = False  # a retention pass runs (on its own thread)
        self._retain_next: str | None = None  # the newest served identity it has yet to run for
        # with keep_last: the identities committed here (or being committed), oldest first, from the one the last
        # pass ran for on. A pass spares those after its own: one that failed part way may be served by a replica.
        self._commits: list[str] = []
        self._markers: MarkerCache | None = None  # made at the first retention pass
        # hf_config_dir inside a local root (an earlier run's full snapshot this one continues from): read again at
        # every full (carry_base_tensors), so retention keeps it
        held = storage.folder_holding(config.hf_config_dir) if config.hf_config_dir else None
        self.inputs = frozenset([held] if held else [])
        if held and config.keep_last:
            logger.info("hotload: retention keeps %s: hf_config_dir reads from it", storage.uri(held))

    def prepare(self) -> None:
        """Serialise the manifests now (the plan never changes). Why not at the first commit: they are made from a
        dict per tensor, and at tens of thousands of tensors those set off a full garbage collection (~0.25 s
        holding the GIL at 40k) on the publisher's thread while the trainer runs; at construction it runs before
        training starts."""
        if not self._manifests:
            self._manifests = {"model.safetensors.index.json": self.plan.to_index_json(),
                               "model.weight.spec.json": self.plan.to_spec_json()}

    def finish(self, job: Job, identity: str, kind: str, parent: str | None, statuses: list[RankStatus],
               prog: Any, *, abandoned: Callable[[], bool] = lambda: False) -> Outcome:
        """Manifests, commit marker, signal, wait. Nothing is signalled unless every file is durable; a snapshot
        not committed is deleted (every rank's writes have ended: the statuses were gathered). ``abandoned``:
        close() gave up on it (asked again before the marker), so a stuck call that returned late must not commit
        it."""
        m, files, errors = summarize(job, identity, kind, statuses, self.plan.total_size)
        before = self.storage.stats.snapshot()  # the ranks' weight files are counted; the small files here too
        if not errors and set(files) != set(self.plan.files):
            errors.append(f"files missing after upload: {sorted(set(self.plan.files) - set(files))}")
        if abandoned():
            errors.append(GAVE_UP)
        committed = False
        t_signal: float | None = None
        try:
            if errors:
                raise PublishError("; ".join(errors))
            prog.stage("writing the manifests and the commit marker")
            if self.config.keep_last:  # before its marker: a pass that reads the marker spares it
                with self._retention:
                    self._commits.append(identity)
            self._write_manifests(identity, kind, parent, files, abandoned)
            committed = True
            if self.signaller is not None:
                t_signal = time.perf_counter()
                prog.stage("signalling and waiting until every replica serves it")
                ready_s = self.signaller.signal_and_wait(identity, parent if kind == "delta" else None,
                                                         on_poll=prog.polled)
                m.signal_s = time.perf_counter() - t_signal - ready_s
                m.ready_s = ready_s
                m.deployments_behind = sorted(self.signaller.behind)
                m.deployments_catching_up = sorted(self.signaller.catching_up)
            m.ok = True
        except Exception as exc:  # noqa: BLE001 - any failure ends this chain; the next publish is full
            m.error = str(exc)  # served identities only change on success
            if t_signal is not None:  # a signal or readiness wait that failed: its time, both parts together
                m.signal_s = time.perf_counter() - t_signal
                m.deployments_behind = self.signaller.not_serving(identity) if self.signaller else []
            if not committed:
                from ..retention import discard_snapshot

                discard_snapshot(self.storage, identity)
            elif isinstance(exc, (NotSignalled, LoadedNowhere)) and self.config.keep_last:
                self._retract(identity, "no deployment took its signal" if isinstance(exc, NotSignalled) else
                              "every replica failed to load it")
        m.total_s = time.perf_counter() - job.t_hook  # hook to every replica ready: retention comes after
        after = self.storage.stats.snapshot()  # a throttled commit marker is this publish's, not nobody's
        m.throttled += int(after.get("throttled", 0) - before.get("throttled", 0))
        m.retries += int(after.get("retries", 0) - before.get("retries", 0))
        return Outcome(m.ok, m.error, m)

    def retain(self, identity: str) -> None:
        """Retention once ``identity`` is served (``keep_last``), on a thread of its own. Why: deletes on an object
        store take a list, a read per marker and a delete per file; run in the snapshot's outcome they held its
        slot (the skip policy skipped those steps, the wait policy blocked the trainer) and counted in its times
        and staleness, and run after it on the publisher's thread they delayed the next snapshot, staged and
        waiting meanwhile. One pass at a time: identities served while one runs are left to the next pass, for
        the newest. Problems are logged: the next pass tries again. It is safe beside uploads: an unmarked
        folder of this session newer than its newest commit (one in flight) is never swept.

        What a pass spares is decided when it runs, not when it was asked for: every snapshot committed here after
        ``identity`` too. Why: a pass can start late (another still running, a bucket of many markers), and a
        publish committed meanwhile that failed part way (one replica loaded it, another did not, or one
        deployment of several) is served by some replica; as it was not the newest commit any more, the pass
        deleted it, and that replica could not rebuild its weights on a restart. Once a later snapshot is served
        everywhere, its pass lets them go."""
        if not self.config.keep_last:
            return
        with self._retention:
            self._retain_next = identity
            if self._retaining:
                return
            self._retaining = True
        try:  # at the publisher thread's nice, which the thread inherits
            threading.Thread(target=self._retain_passes, name="hotload-retention", daemon=True).start()
        except RuntimeError as exc:  # no threads left: here, then
            logger.warning("hotload: retention runs on the publisher's thread (cannot start its own: %s)", exc)
            self._retain_passes()

    def _retain_passes(self) -> None:
        from ..markers import MarkerCache
        from ..retention import retain_after

        if self._markers is None:
            self._markers = MarkerCache(self.session)
        while True:
            with self._retention:
                identity, self._retain_next = self._retain_next, None
                if identity is None:
                    self._retaining = False
                    self._retention.notify_all()
                    return
                if identity in self._commits:  # those before it are never spared again
                    self._commits = self._commits[self._commits.index(identity):]
            retain_after(self.storage, self.config.keep_last, identity, session=self.session, since=self.started,
                         grace_s=self.config.retention_grace_s, keep=self.inputs, markers=self._markers,
                         spare=lambda: self._spared(identity))  # logs, never raises

    def _retract(self, identity: str, why: str) -> None:
        """Delete a committed snapshot whose signal no deployment took (:class:`.signal.NotSignalled`), or that
        every replica failed to load (:class:`.signal.LoadedNowhere`): no replica holds it or can load it, and
        while the fleet is down, refuses every signal or fails every load no retention pass runs, so each publish
        left a full snapshot in the bucket. Nothing depends on it: after a failure the next publish is full.
        Its marker goes first, as in a retention pass."""
        from ..retention import retract_snapshot

        with self._retention:
            if identity in self._commits:
                self._commits.remove(identity)
        retract_snapshot(self.storage, identity, why)

    def _spared(self, identity: str) -> list[str]:
        """What a pass for ``identity`` spares besides it, when it asks: the identities committed here since (the
        ones being committed too), and every snapshot a deployment serves or may load (one left behind with
        ``deployments_required="any"`` serves an older one)."""
        with self._retention:
            after = [i for i in self._commits if i != identity]
        return after + sorted(self.signaller.may_serve() if self.signaller is not None else ())

    def wait_retention(self, timeout: float | None = None) -> bool:
        """Wait for the retention pass in flight (close); False if it still runs after ``timeout`` seconds (it
        goes on, a daemon thread: its deletes are ordered so that stopping anywhere leaves a consistent bucket)."""
        with self._retention:
            return self._retention.wait_for(lambda: not self._retaining, timeout)

    def _write_manifests(self, identity: str, kind: str, parent: str | None, files: dict[str, int],
                         abandoned: Callable[[], bool]) -> None:
        from ..markers import commit_snapshot

        def check() -> None:  # a write of the small files that hung past close()'s deadline
            if abandoned():
                raise PublishError(GAVE_UP)

        self.prepare()  # done at construction on the rank that commits; once in any case
        commit_snapshot(self.storage, identity, kind, parent, files, {**self.aux, **self._manifests},
                        before_marker=check)
