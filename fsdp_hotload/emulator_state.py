"""Deployment, replica and ledger state of the hot-load emulator.

Kept apart from the HTTP layer (``emulator.py``) so the rules a real deployment applies — which signals are
accepted, what survives a failed load, how a restarted replica gets its weights back — read as plain code.

A replica's load is real work (``emulator_load.py``): it reads the whole snapshot from the bucket and verifies
it, and only then swaps. A failure leaves the replica on its previous weights with ``stage == "error"`` and the
error text in the ledger. A restarted replica (:meth:`Deployment.restart_replica`) has lost its weights and
rebuilds the snapshot it served from the bucket: the full snapshot its chain starts from, then every delta.

Example::

    settings = EmulatorSettings(get_bytes=Storage(bucket).get_bytes)
    dep = Deployment("accounts/a/deployments/d", "accounts/a/models/m", replicas=2, settings=settings)
    dep.signal(HotLoadRequest(identity="step-1"))  # {'status': 'ok'}; raises SignalRejected(status, message)
    while dep.status()["replicas"][0]["loading_state"]["stage"] not in ("done", "error"):
        time.sleep(0.01)
    dep.cancel()
    dep.join(time.monotonic() + 10)  # the names of the replica threads still running by then
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .arc import ArcError, RawTensor
from .emulator_load import load_snapshot, summarize
from .emulator_rules import LORA_MARKER, BaseModelSpec, LoadError, carries_lora_marker, check_config
from .fireworks_models import HotLoadRequest
from .storage_errors import classify_error

log = logging.getLogger(__name__)

CHECKSUM_FORMAT = "alder32"


class SignalRejected(Exception):
    """A signal fails validation against the deployment's state; carries the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


@dataclass
class EmulatorSettings:
    """Knobs shared by every deployment of one emulator (read at use time, so tests can change them live)."""

    get_bytes: Callable[[str], bytes]
    # The files under an identity's folder with their (size, mtime), listed when a signal arrives and again once a
    # replica has read the snapshot: a file written, changed or removed in between fails the load. Why: the
    # loads read lazily (after load_delay_s), so a publisher that signals before every file is durable would
    # otherwise be served the files that appear later. None: not checked.
    list_files: Callable[[str], dict[str, tuple[int, float | None]]] | None = None
    # Whether a file exists (relpath from the bucket root): each hint records whether its file was there when the
    # hint came. Not refused (the service's answer is not documented), counted in state() as hints_before_file.
    file_exists: Callable[[str], bool] | None = None
    load_delay_s: float = 0.0
    load_delays: dict[str, float] = field(default_factory=dict)  # deployment key -> its own load_delay_s
    managers_down: set[str] = field(default_factory=set)  # deployment keys whose manager is taken down
    # Seconds after a deployment's first request before its hot-load manager is up: until then GET reports no
    # replicas and a signal is refused (on the real service a signal that early can crash the serving container).
    manager_delay_s: float = 0.0
    compression_formats: tuple[str, ...] = ("arc_v2",)
    base: BaseModelSpec = field(default_factory=BaseModelSpec)  # what full snapshots are checked against (§6.2)
    # (deployment key, replica index) -> loads left to fail; key "" holds what a deployment that no request has
    # named yet takes when one does (see HotLoadEmulator.fail_next_loads)
    fail_counts: dict[tuple[str, int], int] = field(default_factory=dict)
    record_error: Callable[[BaseException], None] = lambda exc: None
    # Rows and hints kept per deployment for reading (oldest dropped first), so a long-running emulator's memory
    # stays bounded; identity reuse and delta parents are still checked against every identity ever signalled.
    history_limit: int = 10_000
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_failure(self, deployment: str, replica: int) -> bool:
        with self.lock:
            left = self.fail_counts.get((deployment, replica), 0)
            if left <= 0:
                return False
            self.fail_counts[(deployment, replica)] = left - 1
            return True

    def new_deployment(self, deployment: str) -> None:
        """Give a deployment named for the first time the failures set for every deployment."""
        with self.lock:
            for (key, i), n in list(self.fail_counts.items()):
                if key == "" and n > 0:
                    self.fail_counts[(deployment, i)] = self.fail_counts.get((deployment, i), 0) + n


# ---------------------------------------------------------------------------------------------------- state


@dataclass
class LedgerRow:
    identity: str
    kind: str  # "full" | "delta"
    previous: str | None
    compression_format: str | None
    reset_prompt_cache: Any
    ignore: list[str]
    signalled_at: float
    per_replica: list[dict[str, Any]]
    metadata: dict[str, Any] | None = None  # incremental_snapshot_metadata as signalled, all of it
    files: dict[str, tuple[int, float | None]] | None = None  # the identity's files when signalled (list_files)

    def to_dict(self) -> dict[str, Any]:
        return {"identity": self.identity, "kind": self.kind, "previous": self.previous,
                "compression_format": self.compression_format, "reset_prompt_cache": self.reset_prompt_cache,
                "incremental_snapshot_metadata": self.metadata,
                "signalled_at": self.signalled_at, "per_replica": [dict(r) for r in self.per_replica]}

    def differences(self, req: HotLoadRequest) -> list[str]:
        """The fields in which a re-signal of this row's identity asks for something else than this row."""
        meta = req.incremental_snapshot_metadata
        ignore = req.validation.extra_fields_ignore if req.validation is not None else []
        pairs = (("incremental_snapshot_metadata", self.metadata, meta.model_dump() if meta is not None else None),
                 ("reset_prompt_cache", cache_policy(self.reset_prompt_cache), cache_policy(req.reset_prompt_cache)),
                 ("validation.extra_fields_ignore", sorted(set(self.ignore)), sorted(set(ignore))))
        return [name for name, had, asked in pairs if had != asked]


def check_unchanged_since_signal(list_files: Callable[[str], dict[str, tuple[int, float | None]]] | None,
                                 row: LedgerRow) -> None:
    """Raise LoadError when the snapshot's files are not those its folder held when it was signalled."""
    if list_files is None or row.files is None:
        return
    now = list_files(row.identity)
    if now == row.files:
        return
    changed = sorted(k for k in set(now) | set(row.files) if now.get(k) != row.files.get(k))
    raise LoadError(f"the files of {row.identity!r} changed after it was signalled ({len(changed)}: "
                    f"{', '.join(changed[:3])}): a publisher must signal a snapshot only once every file is durable")


def cache_policy(value: Any) -> str:
    """``reset_prompt_cache`` as the policy it names: unset is the default ``all``, and the SDK's bools map
    ``true`` to ``all`` and ``false`` to ``none`` (inferred; the docs define only the strings)."""
    if value is None or value is True:
        return "all"
    if value is False:
        return "none"
    return str(value)


class _Cancelled(Exception):
    """The load's generation ended (a ledger reset or a shutdown) while it read the bucket: it stops at its next
    file rather than reading and decoding the rest of a snapshot whose result would be dropped."""


@dataclass
class _Job:
    row: LedgerRow
    generation: int


@dataclass
class _Restart:
    generation: int


class Replica:
    """One serving replica: its weights, its load stage, and the worker thread that loads snapshots in order.

    Created by :class:`Deployment`; one thread per replica so replicas finish at different times, as real ones do.
    Example::

        rep = dep.replicas[0]
        rep.inspect()["identity"], rep.status()["readiness"]
    """

    def __init__(self, index: int, deployment: "Deployment") -> None:
        self.index = index
        self.dep = deployment
        self.current: str | None = None
        self.readiness = True  # serving the base model until a snapshot is loaded
        self.stage = "idle"
        self.target: str | None = None
        self.error: str | None = None
        self.busy = False  # loads queued or running (a restart is not one: it leaves what the replica will serve)
        self.restoring: str | None = None  # the identity a restart is rebuilding
        self.tensors: dict[str, RawTensor] = {}
        self.weight_map: dict[str, str] | None = None
        self.summary: dict[str, dict[str, Any]] = {}
        self.restarts = 0
        self.jobs: queue.Queue[_Job | _Restart | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"hotload-emulator-{deployment.key}-r{index}",
                                       daemon=True)
        self.thread.start()

    def status(self) -> dict[str, Any]:
        state: dict[str, Any] = {"stage": self.stage, "target_snapshot_identity": self.target}
        if self.error is not None:
            state["error"] = self.error
        return {"current_snapshot_identity": self.current, "readiness": self.readiness, "loading_state": state,
                "loaded_adapters": [], "supports_rdma_weight_sync": False, "rdma_weight_sync_enabled": None}

    def inspect(self) -> dict[str, Any]:
        return {"identity": self.current, "readiness": self.readiness, "stage": self.stage, "target": self.target,
                "error": self.error, "restarts": self.restarts,
                "tensors": {k: dict(v) for k, v in self.summary.items()}}

    def _loads_queued(self) -> bool:
        """Whether a load waits in the queue (caller holds the deployment lock, on this replica's thread: puts
        happen under the lock, gets on this thread only)."""
        return any(isinstance(job, _Job) for job in list(self.jobs.queue))

    def forget(self) -> None:
        """Ledger reset: back to the base model (caller holds the deployment lock)."""
        self.current, self.tensors, self.weight_map, self.summary = None, {}, None, {}
        self.restoring = None
        self.readiness, self.error, self.target = True, None, None
        self.stage = "idle"

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if isinstance(job, _Restart):
                    self._restore(job)
                else:
                    self._load(job)
            except BaseException as exc:  # a bug in the emulator itself: keep it visible
                self.dep.settings.record_error(exc)
                with self.dep.lock:
                    self.stage, self.error, self.readiness, self.busy = "error", f"internal error: {exc!r}", True, False
                    self.restoring = None

    def _set_stage(self, job: _Job | _Restart, stage: str) -> None:
        """Called before and after each file a load reads; raises _Cancelled once the load's generation ended, so
        a shutdown or ledger reset waits for one file at most, not for the whole snapshot."""
        with self.dep.lock:
            if job.generation != self.dep.generation:
                raise _Cancelled
            self.stage = stage

    def _load(self, job: _Job) -> None:
        row, dep = job.row, self.dep
        with dep.lock:
            if job.generation != dep.generation:  # cancelled by a ledger reset
                self.busy = self._loads_queued()
                return
            self.busy, self.stage, self.target, self.error = True, "downloading", row.identity, None
            parent, parent_map, current = self.tensors, self.weight_map, self.current
        try:
            if dep.settings.take_failure(dep.key, self.index):
                raise LoadError(f"injected fault: replica {self.index} fails this load (fail_next_loads)")
            started = time.monotonic()  # re-read each tick: set_load_delay(0) releases loads already waiting
            while time.monotonic() - started < dep.settings.load_delays.get(dep.key, dep.settings.load_delay_s) \
                    and job.generation == dep.generation:
                time.sleep(0.01)
            if job.generation != dep.generation:  # ledger reset or shutdown while waiting
                with dep.lock:
                    self.busy = self._loads_queued()
                return
            if row.previous is not None and current != row.previous:
                raise LoadError(f"delta {row.identity!r} applies to {row.previous!r}, but replica {self.index} "
                                f"serves {current!r}")
            tensors, weight_map = self._read(job, row, parent, parent_map)
        except _Cancelled:
            with dep.lock:
                self.busy = self._loads_queued()
            return
        except (LoadError, ArcError) as exc:
            self._fail(job, f"{type(exc).__name__}: {exc}")
            return
        except Exception as exc:  # anything else a corrupt input can trigger is still a load error
            self._fail(job, f"unexpected {type(exc).__name__} while loading: {exc}")
            return
        with dep.lock:
            if job.generation != dep.generation:
                self.busy = self._loads_queued()
                return
            self.readiness, self.stage = False, "swapping"  # the only window in which the replica is not ready
        summary = summarize(tensors)
        with dep.lock:
            if job.generation == dep.generation:
                self.tensors, self.weight_map, self.summary, self.current = tensors, weight_map, summary, row.identity
                self.stage = "done"
                row.per_replica[self.index].update(stage="done", ready_at=time.time())
            self.readiness = True
            self.busy = self._loads_queued()
        log.info("emulator %s replica %d serves %r", dep.key, self.index, row.identity)

    def _read(self, job: _Job | _Restart, row: LedgerRow, parent: dict[str, RawTensor],
              parent_map: dict[str, str] | None) -> tuple[dict[str, RawTensor], dict[str, str]]:
        """``row``'s snapshot rebuilt from the bucket on top of ``parent`` and checked as the service checks it;
        raises LoadError/ArcError."""
        settings = self.dep.settings
        tensors, weight_map, config = load_snapshot(
            settings.get_bytes, row.identity, previous=row.previous, compression_format=row.compression_format,
            parent=parent, parent_weight_map=parent_map, base_shapes=settings.base.shapes,
            on_stage=lambda s: self._set_stage(job, s))
        dep = self.dep
        check_config(config, settings.base.config if settings.base.config is not None else dep.config_seen,
                     row.ignore, row.identity)
        check_unchanged_since_signal(settings.list_files, row)
        if settings.base.config is None:
            with dep.lock:
                dep.config_seen = config if dep.config_seen is None else dep.config_seen
        return tensors, weight_map

    def _restore(self, job: _Restart) -> None:
        """A restart: the weights are gone; rebuild the snapshot served before it from the bucket, as a new
        container would (the full snapshot its chain starts from, then every delta, each verified as when it was
        first loaded). Why: the files a deployment serves must stay readable as long as it serves them, so
        retention that deleted a link of the chain, or a rewritten file, fails here as it would fail a replica
        that is rescheduled or scaled up. On failure the replica serves the base model, with stage "error"."""
        dep = self.dep
        with dep.lock:
            if job.generation != dep.generation:
                self.busy = self._loads_queued()
                return
            identity, self.restarts = self.current, self.restarts + 1
            self.current, self.tensors, self.weight_map, self.summary = None, {}, None, {}
            if identity is None:  # it served the base model: nothing to rebuild
                self.readiness, self.stage, self.target, self.error = True, "idle", None, None
                self.busy = self._loads_queued()
                return
            self.readiness, self.stage, self.target, self.error = False, "downloading", identity, None
            self.restoring = identity
            try:
                chain, problem = dep.chain_to(identity), None
            except LoadError as exc:
                chain, problem = [], str(exc)
        tensors: dict[str, RawTensor] = {}
        weight_map: dict[str, str] | None = None
        try:
            if problem is not None:
                raise LoadError(problem)
            for row in chain:
                if job.generation != dep.generation:  # a ledger reset or shutdown: the result would be dropped
                    break
                tensors, weight_map = self._read(job, row, tensors, weight_map)
            failure = None
        except _Cancelled:  # the generation ended: what follows drops the result
            failure = "cancelled"
        except (LoadError, ArcError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # anything else a corrupt input can trigger is still a load error
            failure = f"unexpected {type(exc).__name__} while loading: {exc}"
        summary = summarize(tensors) if failure is None and job.generation == dep.generation else {}
        with dep.lock:
            if job.generation == dep.generation:
                self.restoring = None
                if failure is None:
                    self.tensors, self.weight_map, self.summary, self.current = tensors, weight_map, summary, identity
                    self.stage = "done"
                else:
                    self.stage, self.error = "error", f"after a restart, rebuilding {identity!r} failed: {failure}"
                    log.warning("emulator %s replica %d: %s", dep.key, self.index, self.error)
                self.readiness = True
            self.busy = self._loads_queued()

    def _fail(self, job: _Job, message: str) -> None:
        log.warning("emulator %s replica %d failed to load %r: %s", self.dep.key, self.index, job.row.identity,
                    message)
        with self.dep.lock:
            if job.generation == self.dep.generation:
                self.stage, self.target, self.error = "error", job.row.identity, message
                job.row.per_replica[self.index].update(stage="error", error=message, failed_at=time.time())
            self.busy = self._loads_queued()


class Deployment:
    """One emulated deployment: replicas, ledger, hints, and the signal rules of the protocol.

    Signals are validated synchronously (what a server can know at POST time: identity reuse, delta parent,
    formats); everything that needs the bucket is found by the replicas while loading and reported as
    ``stage == "error"``, because that is how the real service surfaces load failures.

    Example::

        dep = Deployment("accounts/a/deployments/d", None, replicas=2, settings=settings)
        dep.signal(HotLoadRequest(identity="step-1"))      # raises SignalRejected(status, message) if refused
        dep.status()["replicas"][0]["loading_state"]["stage"]
    """

    def __init__(self, key: str, model: str | None, *, replicas: int, settings: EmulatorSettings) -> None:
        self.key = key
        self.model = model
        self.settings = settings
        self.lock = threading.RLock()
        self.generation = 0
        self.ledger: deque[LedgerRow] = deque(maxlen=settings.history_limit)
        self.hints: deque[dict[str, Any]] = deque(maxlen=settings.history_limit)
        self.signalled: set[str] = set()  # every identity since the last reset (a few bytes each)
        # Without a base model's config, the first snapshot served stands in for it: on Fireworks that one passing
        # means the base's config equals it, so a later snapshot whose config differs would be refused
        self.config_seen: dict[str, Any] | None = None
        self.replicas = [Replica(i, self) for i in range(replicas)]
        self.created = time.monotonic()
        self.premature_signals = 0  # signals sent before the manager was up (each would risk a crash)
        self.premature_hints = 0  # hints sent before the manager was up (inferred to carry the same risk)
        self.hints_before_file = 0  # hints for a file not (yet) in the bucket: a publisher must hint durable files

    def manager_up(self) -> bool:
        return self.key not in self.settings.managers_down and \
            time.monotonic() - self.created >= self.settings.manager_delay_s

    def check_model(self, model: str) -> None:
        with self.lock:
            if self.model is None:
                self.model = model
            elif model != self.model:
                raise SignalRejected(400, f"fireworks-model {model!r} does not match {self.model!r}, the model "
                                          f"deployment {self.key!r} serves")

    def signal(self, req: HotLoadRequest) -> dict[str, Any]:
        """Validate a signal against the ledger and the replicas, then queue the load on every replica."""
        identity = req.identity
        meta = req.incremental_snapshot_metadata
        previous = meta.previous_snapshot_identity if meta is not None else None
        try:  # unlocked: a listing may take a while
            files = self.settings.list_files(identity) if self.settings.list_files is not None else None
        except Exception as exc:  # the bucket, not the emulator, failed
            # A 503 the client retries for an outage; 424 (not retried) for what retrying cannot fix, such as
            # missing credentials, which a 503 would turn into minutes of retries per publish.
            retry = classify_error(exc).retryable
            raise SignalRejected(503 if retry else 424, f"cannot list {identity!r} in the bucket: "
                                 f"{type(exc).__name__}: {exc}" + ("" if retry else " (not retried)")) from exc
        if meta is not None and carries_lora_marker(self.settings.get_bytes, identity):  # read outside the lock
            raise SignalRejected(400, f"{identity!r} holds {LORA_MARKER}, so it is a LoRA snapshot, which never "
                                      "carries incremental_snapshot_metadata (LoRA snapshots are always complete)")
        with self.lock:
            if not self.manager_up():
                self.premature_signals += 1
                raise SignalRejected(503, "the hot-load manager is not initialised yet (GET reports no replicas); "
                                          "a signal this early can crash the serving container")
            if meta is not None:  # what the body alone says comes first, a re-signal included
                if meta.compression_format not in self.settings.compression_formats:
                    raise SignalRejected(400, f"compression_format {meta.compression_format!r} is not supported "
                                              f"(supported: {', '.join(self.settings.compression_formats)})")
                if meta.checksum_format != CHECKSUM_FORMAT:
                    raise SignalRejected(400, f"checksum_format {meta.checksum_format!r} is not supported "
                                              f"(supported: {CHECKSUM_FORMAT})")
            if self.ledger and self.ledger[-1].identity == identity:
                # A retried signal is accepted only as the very same request: one that asks for another codec,
                # cache policy or validation would otherwise be answered 200 and silently not applied.
                differs = self.ledger[-1].differences(req)
                if not differs:
                    return {"status": "ok"}  # a retried signal: the load is already under way or done
                raise SignalRejected(409, f"identity {identity!r} was just signalled with a different "
                                          f"{' and '.join(differs)}; use a new identity")
            if identity in self.signalled:
                raise SignalRejected(409, f"identity {identity!r} was already used on deployment {self.key!r}; "
                                          "every snapshot needs a new identity")
            if meta is not None:
                if not self.signalled:
                    raise SignalRejected(400, f"delta snapshot {identity!r} names previous_snapshot_identity "
                                              f"{previous!r}, but the ledger is empty (new deployment or ledger "
                                              "reset): signal a full snapshot first")
                if previous not in self.signalled:
                    raise SignalRejected(400, f"previous_snapshot_identity {previous!r} is not in the ledger of "
                                              f"{self.key!r}")
                # "must match the snapshot currently served" (Fireworks' delta docs): a parent still loading is
                # not served yet, and a delta queued behind another load would apply to that load's snapshot
                served = [r.current if r.restoring is None else r.restoring for r in self.replicas]
                if any(s != previous for s in served):
                    raise SignalRejected(400, f"previous_snapshot_identity {previous!r} is not the snapshot the "
                                              f"replicas serve ({served}); wait until it is served everywhere, or "
                                              "signal a full snapshot")
                if any(r.busy for r in self.replicas) and previous != self.ledger[-1].identity:
                    raise SignalRejected(400, f"previous_snapshot_identity {previous!r} is not the snapshot "
                                              f"loaded just before this one ({self.ledger[-1].identity!r}, "
                                              "still loading); signal a full snapshot")
            row = LedgerRow(
                identity=identity, kind="delta" if meta is not None else "full", previous=previous,
                compression_format=meta.compression_format if meta is not None else None,
                metadata=meta.model_dump() if meta is not None else None,
                reset_prompt_cache=req.reset_prompt_cache if req.reset_prompt_cache is not None else "all",
                ignore=list(req.validation.extra_fields_ignore) if req.validation is not None else [],
                signalled_at=time.time(), files=files,
                per_replica=[{"replica": i, "stage": "pending", "ready_at": None, "error": None}
                             for i in range(len(self.replicas))])
            self.ledger.append(row)
            self.signalled.add(identity)
            for rep in self.replicas:
                if not rep.busy and rep.restoring is None:
                    rep.stage, rep.target, rep.error = "pending", identity, None
                rep.busy = True
                rep.jobs.put(_Job(row, self.generation))
        return {"status": "ok"}

    def hint(self, identity: str, filename: str, previous: str | None) -> None:
        present: bool | None = None
        if self.settings.file_exists is not None:  # read outside the lock
            try:
                present = self.settings.file_exists(f"{identity}/{filename}")
            except Exception:  # noqa: BLE001 - a name no file can have (".."): not there
                present = False
        with self.lock:
            if not self.manager_up():
                self.premature_hints += 1
                raise SignalRejected(503, "the hot-load manager is not initialised yet (GET reports no replicas); "
                                          "a hint this early could reach a serving container that is not ready")
            self.hints.append({"identity": identity, "filename": filename, "previous": previous, "at": time.time(),
                               "file_present": present})
            self.hints_before_file += present is False

    def restart_replica(self, index: int) -> None:
        """Restart replica ``index`` once the loads queued on it are done (see :meth:`Replica._restore`)."""
        with self.lock:
            self.replicas[index].jobs.put(_Restart(self.generation))

    def chain_to(self, identity: str) -> list[LedgerRow]:
        """The ledger rows that rebuild ``identity``: a full snapshot, then each delta up to it (caller holds the
        lock). Raises LoadError when a link is older than the rows kept (``history_limit``)."""
        rows = {r.identity: r for r in self.ledger}
        chain: list[LedgerRow] = []
        at: str | None = identity
        while at is not None:
            row = rows.get(at)
            if row is None:
                raise LoadError(f"{at!r}, a link of the chain to {identity!r}, is older than the ledger rows the "
                                f"emulator keeps (history_limit={self.settings.history_limit})")
            chain.append(row)
            at = row.previous
        return chain[::-1]

    def reset_ledger(self) -> None:
        with self.lock:
            self.generation += 1
            self.ledger.clear()
            self.hints.clear()
            self.signalled.clear()
            for rep in self.replicas:
                rep.forget()

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {"replicas": [r.status() for r in self.replicas] if self.manager_up() else []}

    def ledger_rows(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r.to_dict() for r in self.ledger]

    def inspect(self) -> dict[str, Any]:
        with self.lock:
            return {"model": self.model, "premature_signals": self.premature_signals,
                    "premature_hints": self.premature_hints, "hints_before_file": self.hints_before_file,
                    "replicas": [r.inspect() for r in self.replicas],
                    "ledger": [r.to_dict() for r in self.ledger], "hints": [dict(h) for h in self.hints]}

    def cancel(self) -> None:
        """Drop the queued loads, stop a running one at its next file, and end the replica threads (without
        waiting: :meth:`join` does, so that an emulator stopping many deployments cancels them all first)."""
        with self.lock:
            self.generation += 1
        for rep in self.replicas:
            rep.jobs.put(None)

    def join(self, deadline: float) -> list[str]:
        """Wait until :func:`time.monotonic` reaches ``deadline`` at most for the replica threads to end (after
        :meth:`cancel`); returns the names of those still running (a file read that hangs in the storage layer)."""
        for rep in self.replicas:
            rep.thread.join(max(0.0, deadline - time.monotonic()))
        return [rep.thread.name for rep in self.replicas if rep.thread.is_alive()]
