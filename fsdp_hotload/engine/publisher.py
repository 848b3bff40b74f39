"""The publisher: a cheap hook on the trainer's main thread, and a background pipeline per rank.

``publish(step)`` decides whether to publish (every ``publish_every`` steps, and only if an in-flight slot is
free on every rank, else skip or wait per ``busy_policy``), copies the local chunks into a staging slot and
returns. A background thread then runs one snapshot at a time:

1. kind (full/delta, from the Cadence) and identity;
2. diff against the cache and encode (delta: on the host one pass per chunk for arc_v2, on a device the diff
   first) or take the raw bytes (full), per chunk;
3. route pieces to file owners over the side group, assemble and upload each owned file, hint it;
4. rank 0 writes the manifests and the commit marker, signals every deployment and waits until all replicas
   serve the snapshot;
5. the outcome is broadcast: on success the staged bytes become the cache, on any failure the next publish is
   full.

Every rank runs every collective of a publish even when its own part failed, so one rank's error ends that
snapshot (nobody signals it) instead of hanging the others. Errors are stored and raised on the next
``publish`` call (or logged, with ``keep_training_on_error``); with several ranks, on the first one that would
take the failed snapshot's slot, the same step on every rank (a rank's own failure after an outcome fails the
next snapshot on every rank). A collective that itself fails (a side-group timeout, a dead peer) leaves the
group unusable: that error is raised once, and publishing stops for the rest of the job while the rank keeps
answering the skip policy's agreement (always "busy"), so no rank waits on it.
``close()`` first publishes the newest step if it was skipped (``publish_final``), so the fleet ends on it.

Example::

    pub = Publisher(chunks, specs, HotloadConfig(bucket_url="/tmp/bucket"))
    for step in range(100):
        train_step(); pub.publish(step)
    pub.close()
"""
from __future__ import annotations

import hashlib
import logging
import queue
import secrets
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Sequence

import torch

from ..arc.codecs import get_codec
from ..config import HotloadConfig
from ..identity import new_identity
from ..hf_config import carried_files, hf_aux_files, ignored_config_keys, weight_elements
from ..layout import ShardPlan, TensorSpec, plan_shards
from ..retention import SESSION, discard_snapshot
from ..storage import Storage
from .agreement import Agreements
from .assemble import RawPiece, assign_owners
from .cadence import Cadence, next_step
from .carry import Carrier, agree_on_carried
from .commit import Committer
from .comm import Comm, LocalComm, agree_on_start, exchange_objects
from .encode import ChunkEncoder, auto_workers
from .exits import close_publisher, deadline_after, left, track
from .final import publish_newest
from .jobs import Job, Outcome, PublishError, RankStatus
from .metrics import MetricsSink, PublishMetrics, staleness
from .pool import StoredError, serve_weakly, start_warm_up, stop_dropped, weak_getter
from .progress import OTHER_RANKS_SLOWER, ProgressLog, PublishProgress
from .root_check import RootProbe, check_shared_root, refuse_process_local_root
from .signal import Signaller, warn_at_start
from .staging import ChunkLike, Stager
from .writer import FileWriter

log = logging.getLogger("fsdp_hotload")


class _CopyFailed(Exception):
    """A staged copy failed (on the helper thread, or on one rank of several as it started): see Publisher._run."""

Sources = Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]]  # in chunk order, or a function of them


class Publisher:
    """Framework-neutral engine: it sees chunks (name, box, source tensor), never modules."""

    def __init__(self, chunks: Sequence[ChunkLike], specs: Sequence[TensorSpec], config: HotloadConfig, *,
                 comm: Comm | None = None, ctrl: Comm | None = None, storage: Storage | None = None,
                 signaller: Signaller | None = None, session: str | None = None, owner: str = "Publisher",
                 retake_failed_steps: bool = False) -> None:
        self.config = config
        self.owner = owner  # the class the caller made (HotloadCallback, TensorPublisher), named in its advice
        # A step whose copy failed on one rank is not taken: for callers that name the steps (TensorPublisher), who
        # give the same step again once its tensors are fixed. Else it stays the newest, and close() publishes it
        # again, as with several ranks (where a failed copy fails that step on every rank).
        self.retake_failed_steps = retake_failed_steps
        self.comm: Comm = comm or LocalComm()
        if self.comm.world > 1 and ctrl is None:  # the trainer's agreement and the publisher's thread would
            raise ValueError("Publisher: with several ranks, pass ctrl=, a second group for the trainer thread's "
                             "collectives (two threads must never share one group)")
        self.ctrl: Comm = ctrl or self.comm
        self._close_called = False  # close() was entered (the exit warning tells a blocked close from none)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.chunks = list(chunks)
        self.signaller: Signaller | None = None
        made: list[Any] = []  # closed if the set-up fails on any rank
        self.carried, problem = agree_on_carried(self.ctrl, config.carry_base_tensors, config.hf_config_dir,
                                                 {s.name: s.dtype for s in specs})
        specs = [*specs, *(TensorSpec(t.name, t.shape, t.dtype) for t in self.carried)]
        # The session and the agreements' key in the job's store (rank 0's are taken: a session may be given again)
        start = (session or secrets.token_hex(4), secrets.token_hex(8))
        probe: RootProbe | None = None
        try:  # set-up that can fail on some ranks only (rank 0 alone reads hf_config_dir and writes the metrics)
            if problem is not None:
                raise problem
            self.plan: ShardPlan = plan_shards(specs, max_file_bytes=config.max_file_bytes,
                                                 warn=self.rank == 0)
            # rank 0 reads the carried tensors, so it writes their files: they never cross to another rank
            self.owners = assign_owners(self.plan, self.world, {self.plan.file_of(t.name) for t in self.carried})
            self.plan.check_chunks(self.chunks)
            self.storage = storage or Storage(config.bucket_url, config.storage_options,
                                              max_concurrency=config.upload_concurrency,
                                              max_attempts=config.storage_attempts)
            if self.world > 1:  # every rank must write where rank 0 commits (see root_check)
                refuse_process_local_root(self.storage, self.world)
                if self.rank == 0:
                    probe = RootProbe.write(self.storage, start[1])  # None: the store did not answer in time
                    made.extend([probe] if probe is not None else [])
            self.stager = Stager(self.chunks, slots=config.max_inflight, cache_on=config.cache_on)
            made.append(self.stager)
            self.chunks = self.stager.chunks  # without their sources, which only the stager holds (see ChunkInfo)
            self.codec = get_codec(config.codec)
            self._carrier = Carrier(self.carried, self.codec) if self.rank == 0 and self.carried else None
            self.metrics = MetricsSink(config.metrics_path if self.rank == 0 else None)
            base_files = hf_aux_files(config.hf_config_dir) if self.rank == 0 else {}  # read once: tokenizers are big
            dtypes = weight_elements((s.name, s.dtype, s.shape) for s in specs)  # masks left out: see weight_dtypes
            self._aux = carried_files(base_files, dtypes)
            self.signaller = signaller if signaller is not None else (  # last of what may fail: it starts a thread
                Signaller.from_config(config) if (self.rank == 0 or config.send_hints) else None)
            if signaller is None and self.signaller is not None:
                made.append(self.signaller)
        except Exception as exc:  # noqa: BLE001 - raised by agree_on_start, on every rank
            problem = exc
        try:
            # Identities must agree on every rank (rank 0 picks the suffix) and never repeat across publisher
            # instances, even within one process (a restarted publisher must not reuse an identity).
            shared = None if problem is not None else {  # the tensors too, for callers that did not compare them
                **config.shared_settings(), "tensor specs": hashlib.sha256(self.plan.to_spec_json()).hexdigest()[:16]}
            # The agreements' key in the job's store: unique to this publisher (a session may be given again).
            self.session, self._store_key = agree_on_start(self.ctrl, problem, start, shared)
            if not SESSION.fullmatch(self.session):  # retention only sweeps, and aborts uploads in, folders named so
                raise ValueError(f"session {self.session!r}: must be 8 lowercase hex digits, as a publisher makes")
            new_identity(0, prefix=config.identity_prefix, session=self.session)  # a bad prefix fails here
            if self.world > 1:  # the same on every rank: each raises the same error, or none does
                check_shared_root(self.ctrl, self.storage, self._store_key, probe)
        except BaseException:
            for part in made:
                part.close()
            raise
        if self.rank == 0:
            warn_at_start(config, self.codec)
        # The codec's kernels load (or compile) now, beside the trainer's set-up: in the first delta they would
        # make it seconds longer than the rest (and, with the skip policy, skip steps).
        warm = getattr(self.codec, "warm_up", None)
        self._warm_up = None if warm is None else start_warm_up(
            warm, name=f"hotload-warmup-{self.rank}", nice=config.background_nice, what=f"the {self.codec.name} codec")
        self.cadence = Cadence(config.full_every, config.max_chain_length)
        if self.rank == 0 and self.signaller is not None:
            self.signaller.extra_fields_ignore = ignored_config_keys(base_files, self._aux, dtypes,
                                                                     config.extra_fields_ignore)
        self.committer = Committer(self.plan, self.storage, config, self._aux, self.signaller, session=self.session,
                                   started=time.time())  # snapshots others commit after this are a live run's
        if self.rank == 0:
            self.committer.prepare()
        self.writer = FileWriter(self.plan, self.owners, self.rank, self.storage, codec=self.codec.name,
                                 signaller=self.signaller, send_hints=config.send_hints,
                                 concurrency=config.upload_concurrency)
        self._cache_parts: list[tuple[int, int]] = [(0, 0)] * len(self.chunks)
        workers = config.encode_workers or auto_workers(self.stager.device)
        self.encoder = ChunkEncoder(self.chunks, self.stager, self.codec, workers=workers,
                                    name=f"hotload-encode-{self.rank}", verbose=self.rank == 0)
        # A job is queued only once it holds a staging slot, so the slots bound the queue (+1: the stop sentinel).
        self._queue: queue.Queue[tuple[Publisher, Job] | None] = queue.Queue(maxsize=config.max_inflight + 1)
        self._thread: threading.Thread | None = None
        self._errors = StoredError()
        self._staged = 0  # jobs staged so far (the next job's seq)
        self._broken: BaseException | None = None  # a collective failed: the side group is unusable
        self._halted: BaseException | None = None  # stop() was called: nothing more is staged
        self._carried: BaseException | None = None  # a rank-local error after an outcome, for the next snapshot
        self._pending = 0
        self._idle = threading.Condition()
        self._skipped = 0
        self._skipped_newest = False  # the newest step counted in _skipped (busy): not once close() publishes it
        self.agreements = Agreements(self.ctrl, self._store_key, wait_s=config.side_group_timeout_s)
        self.early_agreement = False  # set while a caller starts each agreement with agree() (see there)
        self._copying: Job | None = None  # the job whose host copy runs on the stager's helper thread
        every = config.progress_log_s
        self._progress = ProgressLog(every if self.rank == 0 or every is None else every * OTHER_RANKS_SLOWER,
                                     trainer_step=weak_getter(self, "latest_step"),
                                     name=f"hotload-progress-{self.rank}", own_work_only=self.rank != 0,
                                     prefix=f"rank {self.rank}: " if self.rank else "")
        self._prog = PublishProgress("", "", -1, 0.0)  # the snapshot in flight, for the progress reports
        self.latest_step = -1
        self._last_staged = -1  # the newest step staged (publish_final publishes latest_step when it is newer)
        self._last_accepted = -1  # the newest step the fleet accepted (every rank knows each outcome)
        self._stepping_thread: int | None = None  # the thread of the newest publish(): the one training
        self._stepper: threading.Thread | None = None  # the same, as an object (close() names a foreign one)
        self._given_sources = False  # the newest publish() brought its own tensors (close must be given them)
        self._sources_fn: Callable[[], Sequence[torch.Tensor]] | None = None  # or a function, which close reuses
        self.closed = False
        self.abandoned = False  # close() timed out with snapshots in flight (see exits.abandon)
        # publish() and close() may run on different threads: a publish that had passed the closed check could
        # queue its snapshot behind close()'s stop marker, where nothing ever runs it (and its slot stays taken).
        self._api_lock = threading.RLock()
        self._closing = False
        # Dropped without close(), the publisher is collected (its thread holds it weakly) and this ends the rest.
        self._helpers: list[Any] = [self.writer, self.encoder, self.stager, self._progress]
        if self.signaller is not None:
            self._helpers.append(self.signaller)
        # public: a finalizer of the owner's that frees what these threads use calls it first (it runs once)
        self.drop_finalizer = weakref.finalize(self, stop_dropped, self._queue, self._helpers)
        self.drop_finalizer.atexit = False  # at exit the daemon threads just stop (see pool.py)
        track(self)

    # ================================================================== main thread
    def publish(self, step: int, sources: Sources | None = None, *, background_copy: bool = False) -> bool:
        """Stage the current weights for publishing; returns True if a snapshot was started.

        ``sources`` (or a function returning them, called only on steps that publish) replaces the chunks'
        own source tensors. With ``background_copy`` a host copy runs on a helper thread and the caller must
        call :meth:`fence` before it next changes the sources (the callback does so before the next optimizer
        step). With several ranks and the skip policy, ranks agree on "every rank has a free slot" with an
        asynchronous reduction, so the trainer never waits on the other ranks here. By default it starts at the
        end of one publish step and is read at the next, when the snapshot just staged is certainly still busy:
        back-to-back publishes are then two steps apart. A caller that can run code on every rank earlier in the
        step starts it there with :meth:`agree` (``early_agreement``), and publishes can follow every step."""
        with self._api_lock:
            return self._publish(step, sources, background_copy)

    def _publish(self, step: int, sources: Sources | None, background_copy: bool) -> bool:
        if self._closing:
            raise RuntimeError("publisher is closed")
        self.fence()  # its wait is the previous snapshot's blocking time, counted there
        t0 = time.perf_counter()
        # put back where staging fails on one rank (see below)
        taken = self.latest_step, self._given_sources, self._sources_fn, self._skipped_newest
        self.latest_step = step = self.checked_step(step)
        self._stepping_thread, self._stepper = threading.get_ident(), threading.current_thread()
        self._given_sources = sources is not None and not callable(sources)
        self._sources_fn = sources if callable(sources) else None
        self._skipped_newest = False
        if self.world == 1 or self.config.keep_training_on_error:  # with several ranks an error waits, see below
            self.raise_if_failed()  # after the step is recorded: close() then publishes it, as with several ranks
        if step % self.config.publish_every:
            return False
        if self.config.busy_policy == "wait":
            buf = None if self._broken is not None or self._halted is not None else self.stager.acquire(wait=True)
        else:
            if self.world == 1:
                busy = self._busy()
            else:
                if not self.agreements.pending and self.early_agreement:
                    self.agree(step)  # agree() was not called for this step: agree now (waits for the others)
                busy = self.agreements.read(self._agreement_failed)
            # Agreed free means this rank's slot is free too: only this thread takes slots.
            buf = None if busy or self._halted is not None else self.stager.acquire(wait=True)
        raise_now = False
        if buf is not None and self._errors.due(self._staged - self.config.max_inflight):
            # Slots free in job order, so holding one means the job max_inflight places back has ended here; its
            # error (stored before its slot was freed) is known now on every rank, and every rank stages the same
            # jobs. Raised here and never earlier, it ends the same step on every rank: a rank that raised a step
            # before the others would pair different steps in every later snapshot. Only logged (keep training):
            # the step is staged all the same, as on a rank that took the error at the top of this call.
            if not self.config.keep_training_on_error:
                self.stager.release(buf)
                buf = None
            raise_now = True
        if buf is not None:
            try:
                self._start(step, buf, sources, background_copy, t0)
            except BaseException:
                # nothing was staged (the slot went back): the same step given again was refused as a repeat ("does
                # not follow"); several ranks queue a failed copy instead, so no rank raises here (see _start)
                if self.retake_failed_steps and self.world == 1 and self._last_staged != step:
                    self.latest_step, self._given_sources, self._sources_fn, self._skipped_newest = taken
                raise
        elif not raise_now and self.stopped is None:  # busy; a step that raises an error is not a busy skip
            self._skipped, self._skipped_newest = self._skipped + 1, True
        if not self.early_agreement:
            self.agree(step + self.config.publish_every)
        if raise_now or self.stopped is not None:  # after the agreement's turn, which every rank must take
            self.raise_if_failed()
        return buf is not None

    def checked_step(self, given: object, *, attached: bool = False) -> int:
        """``given`` as the next step (see :func:`next_step`; ``attached``: optimizer hooks publish the steps too),
        also refused (ValueError, on the caller's thread) where it would make an identity no storage path can hold:
        on the publisher's thread that failure stopped publishing for the rest of the job, reported as a failed
        collective."""
        step = next_step(given, self.latest_step, attached=attached, owner=self.owner)
        new_identity(step, prefix=self.config.identity_prefix, session=self.session)
        return step

    def _start(self, step: int, buf: torch.Tensor, sources: Sources | None, background_copy: bool, t0: float
               ) -> None:
        """Copy the sources into the slot ``buf`` and queue the snapshot for the background thread."""
        try:
            self._ensure_thread()  # first: a thread that cannot start must not leave the slot taken and pending
            try:
                srcs = sources() if callable(sources) else sources
                event = self.stager.stage(buf, srcs, background=background_copy)
            except Exception as exc:  # noqa: BLE001 - with several ranks the snapshot fails on every rank
                if self.world == 1:
                    raise
                # Raised here, on this rank alone, this rank's next snapshot would pair with the others' this one,
                # and every later one fail ("ranks staged different steps"); the skip policy's agreements would
                # pair off by one. Queued as failed, it fails this snapshot on every rank, raised at one step.
                event = Future()
                event.set_exception(exc)
        except BaseException:
            self.stager.release(buf)  # the slot stays usable; the caller sees the error
            raise
        job = Job(step, buf, event, (time.perf_counter() - t0) * 1e3, self._skipped, t0, self._staged)
        self._staged += 1
        self._last_staged = step
        with self._idle:
            self._pending += 1
        self._queue.put((self, job))  # a queued job keeps the publisher alive until it is published
        self._copying = job if isinstance(event, Future) else None  # a CUDA event needs no fence
        self._skipped = 0

    def publish_final(self, sources: Sources | None = None, *, timeout: float | None = None) -> bool:
        """At the end of training, publish the newest step if it was skipped (while busy, or between
        ``publish_every`` steps), so the fleet ends on the final weights; True if a snapshot started.

        It waits for the snapshots in flight, so every rank knows every outcome; then the ranks vote, and none
        publishes if one objects: after a failure that ``close`` will raise, once publishing has stopped, on
        another thread than the training steps (the weights may be changing), or when the newest ``publish``
        brought its own tensors and they are not given again (a function given there is called again). Every
        rank must call it (``close`` does, with ``config.publish_on_close``, unless it closes on an exception).
        ``timeout`` bounds that wait and the vote: past it this rank still votes (against), so that a rank whose
        wait ended in time is not left waiting for its vote, stops waiting for the others' votes (none publishes
        then), and raises TimeoutError if snapshots are still in flight. A rank that closes on an exception does
        not vote; it tells the others, who stop waiting at once (see agreement.py)."""
        with self._api_lock:
            if self._closing:
                raise RuntimeError("publisher is closed")
            return publish_newest(self, sources, timeout)

    def _agreement_failed(self, exc: PublishError) -> None:
        """The skip policy's agreement failed: publishing stops, training goes on (see agreement.py); the error is
        raised once, or logged."""
        log.error("hotload: publishing stops for the rest of this job, training goes on (%s). If it timed out, "
                  "raise collective_timeout_s (now %.0f s).", exc, self.config.side_group_timeout_s)
        self._errors.store(PublishError(f"publishing stopped: {exc}"), self._staged)

    def agree(self, step: int) -> None:
        """Start the skip policy's cross-rank "every slot free?" reduction for the publish at ``step``.

        Why: the later it starts, the likelier the previous snapshot has finished, so the fewer steps are
        skipped. With ``early_agreement`` set, call it on every rank at the same point of each step before
        :meth:`publish` (the callback does so in the optimizer's pre-step hook, after forward and backward);
        the reduction runs while the optimizer steps and is read by ``publish``. A no-op unless ranks must
        agree, ``step`` publishes, and no reduction is pending.
        """
        if self.config.busy_policy == "skip" and self.world > 1 and step % self.config.publish_every == 0:
            self.agreements.start(self._busy())

    def stop(self, why: BaseException) -> None:
        """Stop publishing for the rest of the job, training going on: every later publish is skipped as busy, and
        close() publishes nothing more. Call it on every rank at the same step, as the trainer's thread (the
        callback does where copies of one tensor drifted apart), so the ranks' agreements stay paired."""
        with self._api_lock:
            self._halted = self._halted or why  # not _broken: the snapshots already queued still run on every rank

    @property
    def stopped(self) -> str | None:
        """Why publishing stopped for good (a collective on a side group failed), or None while it runs."""
        broken = self._broken or self._halted or self.agreements.failed
        return None if broken is None else repr(broken)

    def _busy(self) -> bool:
        """This rank's vote: no free slot, or publishing has stopped for good (see the module docstring)."""
        return self._broken is not None or self._halted is not None or self.stager.free_slots() == 0

    def fence(self) -> float:
        """Wait until the last staged copy has read its sources; returns seconds waited (added to that publish's
        ``blocking_ms``; a copy's error is the next ``publish``'s). Let go only once done: a fence on another thread
        (close() from a watchdog), or one cut short by Ctrl-C, must not let the trainer's next fence pass early."""
        job = self._copying
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        job.event.exception()  # waits without raising
        waited = time.perf_counter() - t0
        if self._copying is job:  # counted by the waiter that lets it go
            self._copying, job.blocking_ms = None, job.blocking_ms + waited * 1e3
        return waited

    def wait(self, timeout: float | None = None) -> None:
        """Block until every started snapshot has finished (accepted or failed), and the retention after them;
        TimeoutError after ``timeout``."""
        self.fence()
        deadline = deadline_after(timeout)
        with self._idle:
            while self._pending:
                if left(deadline) == 0:
                    raise TimeoutError(f"{self._pending} snapshot(s) still publishing after {timeout}s")
                self._idle.wait(left(deadline))
        if not self.committer.wait_retention(left(deadline)):
            raise TimeoutError(f"retention (keep_last) still running after {timeout}s")

    def raise_if_failed(self) -> None:
        err, logged = self._errors.take_logged()
        if err is not None:
            if self.config.keep_training_on_error:  # once at WARNING: rank 0's summary may have told it already
                (log.info if logged else log.warning)(
                    "hotload: publish failed (training goes on, next publish is full): %s", err)
            else:
                raise PublishError(str(err)) from err

    def close(self, *, raise_errors: bool = True, sources: Sources | None = None,
              timeout: float | None = None, propagating: bool | None = None) -> None:
        """Publish a skipped newest step (:meth:`publish_final`), finish in-flight snapshots, stop the thread, and
        raise a stored error. From another thread, it waits for a publish() under way; later ones raise. Closing
        on an exception (``raise_errors=False``, or while one propagates) publishes nothing more and does not
        vote (the weights may be half updated); it tells the other ranks so, without waiting for them.

        ``timeout`` (default ``config.close_timeout_s``; None waits as long as the snapshots take) bounds the waits
        for snapshots in flight: past it, they are abandoned (:func:`.exits.abandon`) and PublishError is raised.
        ``propagating``: whether an exception is on its way out (None: ask ``sys.exc_info()``; ``with`` tells)."""
        close_publisher(self, raise_errors, sources, timeout, propagating)

    def _free(self, deadline: float | None = None, drain: bool = False) -> None:
        """Stop the helper threads and free the buffers; after the publisher thread ended (an abandoned one's
        thread calls it itself, once its stuck call returned)."""
        self.drop_finalizer.detach()
        if not self.committer.wait_retention(left(deadline)):  # rank 0's deletes after the last snapshot
            log.warning("hotload: retention still running at close's deadline: it goes on while the process lives")
        self.writer.shutdown()
        self.encoder.close()
        if self._warm_up is not None:  # a cold numba cache compiles for seconds: within close()'s deadline
            self._warm_up.join(left(deadline))
        self.stager.close()
        if self.signaller is not None:
            self.signaller.close(left(deadline) if drain else 0.0)  # close(): deployments catching up
        self._progress.close()

    def _ensure_thread(self) -> None:
        if self._thread is None:  # at the publisher's nice, which the threads it starts inherit
            thread = threading.Thread(target=serve_weakly, args=(weakref.ref(self), self._queue,
                                                                 self.config.background_nice),
                                      name=f"hotload-publisher-{self.rank}", daemon=True)
            thread.start()  # kept only once started: after "can't start new thread" the next publish tries again
            self._thread = thread

    # ================================================================== background thread
    def _stopped(self) -> None:
        if self.abandoned:  # close() returned without waiting for this thread: free what it left
            self._free()

    def _handle(self, job: Job) -> None:
        try:
            if self._broken is not None:  # queued before the failure was seen (wait policy): drop it
                raise PublishError(f"publishing stopped after a collective failed: {self._broken!r}")
            self._run(job)  # a failed outcome stores its error itself, before freeing the slot
        except BaseException as exc:
            if job.settled:  # only the bookkeeping after the outcome failed (on this rank): the outcome stands
                log.exception("hotload: publisher thread failed after step %d's outcome", job.step)
                self._carried = self._carried or exc  # the next snapshot fails on every rank, and raises it
                self.cadence.on_failure()
            else:  # a collective itself failed: the group is unusable from here on
                why = self.agreements.absent()
                if why is not None and not isinstance(exc, PublishError):  # the cause, not gloo's "a peer hangs"
                    exc = PublishError(f"publishing stopped: {why}, so a collective on the side group failed "
                                       f"({exc!r})")
                if self._broken is None:
                    self._broken = exc
                    # With a known cause (a peer that closed or left), a timeout hint would send the user astray.
                    hint = "" if why is not None else (" If it timed out, raise collective_timeout_s (now "
                                                       f"{self.config.side_group_timeout_s:.0f} s).")
                    log.error("hotload: a collective on the publisher's side group failed (%r); publishing "
                              "stops for the rest of this job, training goes on.%s", exc, hint)
                # before the slot is free (see publish()); logged by the line above, or by rank 0's summary below
                self._errors.store(exc, job.seq, logged=self._broken is exc or self.rank == 0 and bool(job.identity))
                self.cadence.on_failure()
                self.stager.release(job.buf)
                if self.rank == 0 and job.identity:  # one line per publish: this one's files were spent too
                    self.metrics.record(PublishMetrics(
                        job.step, job.identity, job.kind, error=repr(exc), skipped_before=job.skipped_before,
                        total_s=time.perf_counter() - job.t_hook,
                        staleness_steps=staleness(self.latest_step, self._last_accepted)))
        finally:
            self._progress.end()
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _run(self, job: Job) -> Outcome:
        kind = self.cadence.next_kind()
        parent = self.cadence.accepted
        identity = job.identity = new_identity(job.step, prefix=self.config.identity_prefix, session=self.session)
        job.kind = kind
        st = RankStatus(self.rank, kind, identity, parent)
        outgoing: list[list[RawPiece]] = [[] for _ in range(self.world)]
        new_parts: list[tuple[int, int]] = []
        carried, self._carried = self._carried, None
        prog = self._prog = self._progress.begin(identity, kind, job.step, job.t_hook)
        try:
            prog.stage("waiting for the shard's copy")
            try:
                self.stager.wait_event(job.event)
            except Exception as exc:  # noqa: BLE001 - the copy, or on one rank of several its start, failed
                raise _CopyFailed(f"copying the weights of step {job.step} failed: {exc!r}") from exc
            if carried is not None:  # raised here, not on this rank alone, so that every rank raises at one step
                st.error = f"rank {self.rank}: the bookkeeping after the previous snapshot failed: {carried!r}"
            else:
                prog.stage("encoding")
                new_parts = self._encode(job.buf, kind, outgoing, st)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which ends this snapshot
            st.error = f"rank {self.rank}: {exc if isinstance(exc, _CopyFailed) else f'encode failed: {exc!r}'}"
            outgoing = [[] for _ in range(self.world)]
        t0 = time.perf_counter()
        prog.stage("routing pieces to the ranks that write each file", waits_for_others=True)
        incoming = self._route(outgoing, st)
        st.route_s = time.perf_counter() - t0
        if st.error is None:
            try:
                self.writer.write(identity, kind, parent, incoming, st, self._prog)
            except Exception as exc:  # noqa: BLE001
                st.error = f"rank {self.rank}: upload failed: {exc!r}"
        st.blocking_ms = job.blocking_ms  # read late: a background copy's fence adds its wait to it
        prog.stage("waiting for every rank's files", waits_for_others=True)
        statuses = self.comm.gather(st)
        outcome = None if statuses is None else self.committer.finish(  # rank 0: commit, signal, wait
            job, identity, kind, parent, statuses, self._prog, abandoned=lambda: self.abandoned)
        outcome = self.comm.broadcast(outcome)
        # Settle first, and nothing after it may change the slot or the chain: the buffer is now the cache (or
        # free), so a later error must not release it again.
        job.settled = True
        if outcome.ok:
            self._last_accepted = max(self._last_accepted, job.step)
            self.stager.promote(job.buf)
            self._cache_parts = new_parts
            if self._carrier is not None:
                self._carrier.accepted(kind)
            self.cadence.on_success(identity, kind, outcome.metrics)
            if self.signaller is not None:  # every rank hints; rank 0 alone knows who is behind until now
                self.signaller.hint_skip = frozenset(self.cadence.behind)
        else:
            self._errors.store(PublishError(outcome.error or "publish failed"), job.seq,  # before the slot is free
                               logged=self.rank == 0 and outcome.metrics is not None)  # by the summary below
            self.stager.release(job.buf)
            self.cadence.on_failure()
            if st.files and outcome.metrics is not None and outcome.metrics.identity != identity:
                discard_snapshot(self.storage, identity)  # staged another step than rank 0: its discard missed these
        if self.rank == 0 and outcome.metrics is not None:
            outcome.metrics.staleness_steps = staleness(self.latest_step,
                                                        job.step if outcome.ok else self._last_accepted)
            self.metrics.record(outcome.metrics)
            if outcome.ok:
                self.committer.retain(identity)
        return outcome

    def _encode(self, buf: torch.Tensor, kind: str, outgoing: list[list[RawPiece]], st: RankStatus
                ) -> list[tuple[int, int]]:
        t0 = time.perf_counter()
        encoded = self.encoder.encode(buf, kind, self._cache_parts)
        st.diff_s = encoded.diff_s
        st.changed += sum(encoded.changed)
        for c, s, payload, parts in zip(self.chunks, self.stager.slices, encoded.payloads, encoded.parts):
            st.elements += s.numel
            if s.numel:  # a plain tuple until its file's assembly (see Piece)
                owner = self.owners[self.plan.file_of(c.name)]
                outgoing[owner].append((c.name, c.space, tuple(c.box.start), tuple(c.box.length), payload, parts))
        if self._carrier is not None:  # rank 0: the base tensors the trainer does not hold
            for piece in self._carrier.pieces(kind):
                outgoing[self.owners[self.plan.file_of(piece[0])]].append(piece)
            st.elements += self._carrier.elements
        st.encode_s = time.perf_counter() - t0 - st.diff_s
        return encoded.parts

    def _route(self, outgoing: list[list[RawPiece]], st: RankStatus) -> list[list[RawPiece]]:
        """Every rank's pieces of the files this rank owns, from ``outgoing[r]``, this rank's pieces for rank r
        (emptied here). A full snapshot's pieces are the rank's whole shard: see :func:`exchange_objects` for
        how none is copied more than the move needs. This rank's own failure there fails the snapshot."""
        incoming, error = exchange_objects(self.comm, outgoing, failed=st.error is not None)
        st.error = st.error or error
        return [pieces or [] for pieces in incoming]
