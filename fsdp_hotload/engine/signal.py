"""Signalling: tell every deployment about a snapshot and wait until all their replicas serve it.

One snapshot can feed several deployments (rollout pools in several regions reading one bucket). Each keeps its own
chain state: the identity it serves, which is the ``previous_snapshot_identity`` of its next delta. With
``deployments_required="all"`` (the default) the publisher advances its cache only when every deployment accepted,
so after any failure the chains agree again at the next (full) snapshot. With ``"any"`` a deployment that fails is
left behind: the others take the deltas, so one region that is down does not stop the rest of the fleet. It catches
up on a thread of its own (a *catch-up*), which signals it the snapshots it missed, in order, each once the one
before is served: the deltas since the one it serves, or the newest full snapshot and the deltas after it. A publish
signals it again once its catch-up ends, where that loads the new snapshot's parent (or, for a full snapshot,
anything: the catch-up stops after its load in flight). A snapshot whose signal it accepted and then did not serve
(a load error, a readiness timeout) is never signalled to it again (a reused identity is refused): its catch-up asks
whether every replica serves it by now (a load that outlasted the readiness wait), else it waits for the next full
snapshot; a signal that failed (refused, a 5xx, no connection), but for a 409, may be sent again: at worst it is
refused again. While another deployment takes the snapshots, one whose last load timed out is waited for only by its
catch-up (hanging replicas would otherwise cost each full snapshot ``ready_timeout_s``; if the others fail, the next
publish signals it too), and one whose hot-load manager was down is asked again by its catch-up at each publish.
A load error for a snapshot that another replica still loads is waited out a little (``settle_s``, with
``keep_last``), so that a snapshot every replica failed to load is told (:class:`LoadedNowhere`) and deleted.
With ``straggler_wait_s``, a publish waits for a deployment still loading only that long after another one served the
snapshot (checked at each of its status polls, and between a poll's retries); its catch-up (:mod:`.catch_up`) waits
out that load. Nor does a publish wait for a catch-up's load in flight while another deployment is signalled.

Example::

    sig = Signaller.from_config(cfg)            # None when cfg.hotload_api_url is unset
    ready_s = sig.signal_and_wait("step-000012-ab12cd34", previous="step-000011-ab12cd34")
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, Sequence

from ..config import HotloadConfig
from ..fireworks_models import (HotLoadCancelled, HotLoadError, HotLoadTimeout, holds_it, manager_may_be_down,
                               never_taken)
from .catch_up import CatchUps
from .hints import Hints
from .pool import DaemonPool
from .signal_limits import (HINT_DEADLINE_S, LOAD_ERROR_SETTLE_S, MANAGER_WAIT_S, SIGNAL_RETRY_BUDGET_S, found_in,
                            join_wait_s, longest_signal_s, say_behind, say_left_behind, say_what_is_served,
                            warn_at_start)

__all__ = ["HINT_DEADLINE_S", "MANAGER_WAIT_S", "SIGNAL_RETRY_BUDGET_S", "LoadedNowhere", "NotSignalled",
           "Signaller", "longest_signal_s", "warn_at_start"]

log = logging.getLogger("fsdp_hotload")

class NotSignalled(RuntimeError):
    """No deployment can have taken the snapshot's signal: it failed before any was sent (a hot-load manager not
    up, a chain that does not match), or every deployment refused it (:func:`.fireworks_models.never_taken`).
    Why a class of its own: no replica loads such a snapshot, so with ``keep_last`` it is deleted at once; each
    publish of a job whose fleet is down or refuses it otherwise kept a full snapshot until one was served."""


class LoadedNowhere(RuntimeError):
    """Every replica of every deployment that may have taken the snapshot's signal reported an error of its load
    of it, and none serves it: no replica holds it, and none can load it later (the API refuses a reused
    identity). Why a class of its own: with ``keep_last`` it is deleted at once, as a :class:`NotSignalled` one;
    a fleet that kept failing its loads otherwise kept one full snapshot per publish until one was served."""


class Signaller(Hints, CatchUps):
    def __init__(self, clients: Sequence[Any], *, ready_timeout_s: float = 600.0,
                 reset_prompt_cache: str | None = None, compression_format: str = "arc_v2",
                 require_all: bool = True, straggler_wait_s: float | None = None, settle_s: float = 0.0) -> None:
        self.clients = list(clients)
        # after a replica's load error, how long the publish asks on while another replica still loads that
        # snapshot (within ready_timeout_s): only then can it tell one no replica loaded (LoadedNowhere)
        self.settle_s = settle_s
        self._cancelled = threading.Event()  # cancel(): ends those waits at once
        self.require_all = require_all  # False: deployments_required="any"
        self.straggler_wait_s = None if require_all else straggler_wait_s
        self.compression_format = compression_format  # the codec of the deltas; Fireworks accepts arc_v2
        self.ready_timeout_s = ready_timeout_s
        self.reset_prompt_cache = reset_prompt_cache
        self.served: dict[str, str | None] = {c.deployment_name: None for c in self.clients}
        # deployment -> why it does not serve the newest snapshot that counted as served ("any" only)
        self.behind: dict[str, str] = {}
        # deployment -> the snapshots its replicas may serve besides the one it serves everywhere (``served``):
        # signalled and not confirmed, or reported by a replica when a wait failed
        self._signalled: dict[str, set[str]] = {}
        # deployments left behind (the last outcome's deployments_behind), which get no hints
        self.hint_skip: frozenset[str] = frozenset()
        self._state = threading.Lock()  # served and _signalled: retention reads them on its own thread
        self._managers_waited = False  # a signal waited for every manager ("any": later ones only ask once)
        self._pool = DaemonPool(max(1, len(self.clients)), "hotload-signal")
        self._hints_failed: dict[str, str] = {}  # deployment -> the identity whose hints stopped after a failure
        self._hints_asked: dict[str, str] = {}  # deployment -> the identity whose hints its status let go out
        self._managers_up: set[str] = set()  # deployments that reported a replica (safe to signal)
        self._downs: dict[str, int] = {}  # deployment -> times it was found down (see _mark_down)
        self._down_why: dict[str, str] = {}  # deployment -> how it was last found down (read while it is not up)
        self._lane_loads = 0  # snapshots the catch-ups brought a deployment to (close() waits while they go on)
        self._first_seen: dict[str, Any] = {}  # deployment -> the status that first reported a replica, until logged
        # deployment -> what its replicas served or loaded when first seen (an earlier run's snapshots, after a
        # restart), until it serves one of this run's: a deployment left behind keeps serving them (may_serve)
        self._found: dict[str, set[str]] = {}
        self._hint_lock = threading.Lock()
        # "any" only: the snapshots served since the newest full one, in order (what a catch-up signals), each
        # deployment's catch-up in flight, and the snapshots of that chain whose signal each accepted
        self._chain: list[str] = []
        self._lanes: dict[str, threading.Thread] = {}
        self._lanes_done = threading.Condition(self._state)
        self._lane_at: dict[str, str] = {}  # deployment -> the snapshot its catch-up loads now
        self._lane_stop: set[str] = set()  # catch-ups to end after the load in flight (the publish takes over)
        self._taken: dict[str, set[str]] = {}
        self._lane_warned: set[str] = set()  # deployments whose catch-up failure was logged as a warning
        # deployments whose last wait for a load timed out, serving nothing newer since: their replicas may hang,
        # so while another deployment takes the snapshots, only their catch-up (on its own thread) waits for them
        self._timed_out: set[str] = set()
        # deployment -> the snapshot a publish left to its catch-up after straggler_wait_s, and when its wait ends
        self._released: dict[str, tuple[str, float]] = {}
        self._spared = False  # this publish left such a deployment to its catch-up
        self._spare = True  # False after a publish that did failed: the next one signals them too
        self._settling: set[str] = set()  # catch-ups asking after a snapshot whose signal was taken before
        # deployments behind at the last snapshot served whose catch-up was under way then: the next snapshot
        # reaches them through it, so close() need not publish a full snapshot for them
        self.catching_up: frozenset[str] = frozenset()
        # Top-level base config keys the snapshots leave out (a quantization_config without quantized weights):
        # sent with every signal, since the server rejects a key present in only one of the two configs.
        self.extra_fields_ignore: list[str] = []

    @classmethod
    def from_config(cls, cfg: HotloadConfig) -> "Signaller | None":
        if not cfg.hotload_api_url:
            return None
        from ..fireworks import HotLoadClient

        if not (cfg.account_id and cfg.model_id):  # a config that skipped validation (model_construct)
            raise ValueError("hotload_api_url is set, so account_id and model_id must be set too")
        if not cfg.resolved_api_key():  # the client's own message names only its argument and FIREWORKS_API_KEY
            raise ValueError("no Fireworks API key to signal hotload_api_url with: set FIREWORKS_API_KEY, or the "
                             "config's api_key (HOTLOAD_API_KEY, which wins over FIREWORKS_API_KEY)")
        clients = [HotLoadClient(cfg.hotload_api_url, account_id=cfg.account_id, model_id=cfg.model_id,
                                 deployment_id=d, api_key=cfg.resolved_api_key(),
                                 additional_headers=cfg.hotload_api_headers, allow_insecure=cfg.hotload_api_allow_http,
                                 poll_interval_s=cfg.poll_interval_s,
                                 retry_budget_s=min(SIGNAL_RETRY_BUDGET_S, cfg.ready_timeout_s))
                   for d in cfg.deployments]
        return cls(clients, ready_timeout_s=cfg.ready_timeout_s, reset_prompt_cache=cfg.reset_prompt_cache,
                   compression_format=cfg.codec, require_all=cfg.deployments_required == "all",
                   straggler_wait_s=cfg.straggler_wait_s, settle_s=LOAD_ERROR_SETTLE_S if cfg.keep_last else 0.0)

    def may_serve(self) -> set[str]:
        """Every snapshot a deployment serves, or was signalled and may load yet, or served when this run first saw
        it (until it serves one of this run's). Retention spares them and their chains. Why: a deployment left behind
        (``deployments_required="any"``) serves an older snapshot than the others (after a restart, the earlier
        run's, once past ``retention_grace_s``), and a replica of it that restarts rebuilds that snapshot from the
        bucket."""
        with self._state:
            return {i for i in self.served.values() if i}.union(*self._signalled.values(), *self._found.values())

    def not_serving(self, identity: str) -> list[str]:
        """The deployments not known to serve ``identity`` (for the metrics)."""
        with self._state:
            return sorted(name for name, served in self.served.items() if served != identity)

    def signal_and_wait(self, identity: str, previous: str | None,
                        on_poll: Callable[[str, Any, Callable[[str], str]], None] | None = None) -> float:
        """:meth:`_signal_and_wait`. A publish that failed after leaving a deployment whose last load timed out to
        its catch-up makes the next one signal it too: the others failing, it may be the one that serves."""
        self._spared = False
        try:
            ready_s = self._signal_and_wait(identity, previous, on_poll)
        except Exception:
            self._spare = not self._spared
            raise
        self._spare = True
        return ready_s

    def _signal_and_wait(self, identity: str, previous: str | None,
                         on_poll: Callable[[str, Any, Callable[[str], str]], None] | None = None) -> float:
        """Signal every deployment, then wait for all; returns seconds spent waiting for readiness. Before the
        first signal to a deployment, wait until it reports a replica (a signal before that can crash it).
        ``on_poll(deployment, status, redact)`` sees every readiness poll's answer (progress reports); ``redact``
        removes the deployment's secrets from text the server sent, before it is logged.

        Each phase runs on every deployment at once: a signal may retry for minutes, and one deployment after
        another, stalled signals could outlast the side group's timeout the other ranks wait under.

        With ``require_all`` False, a deployment that fails a phase is left out of the next ones (and named in
        :attr:`behind`); only when every deployment fails does this raise as it does otherwise. A delta goes only
        to the deployments that serve its parent."""
        left: dict[str, str] = {}  # deployment -> why it is not signalled this snapshot (require_all False)
        self._recheck_managers()
        clients = self._up_managers(previous, left)
        busy, joining = self._busy(clients, previous)
        for c in [c for c in clients if c.deployment_name in busy]:
            left[c.deployment_name] = busy[c.deployment_name]
            clients.remove(c)
        if busy and not clients:
            raise NotSignalled("; ".join(f"{name}: {why}" for name, why in left.items()))
        for name in [c.deployment_name for c in clients]:  # once, by the rank that signals (or a catch-up)
            if (first := self._first_seen.pop(name, None)) is not None:
                say_what_is_served(name, first, identity)
        if previous is not None:  # every chain is checked before any deployment is signalled
            for c in list(clients):  # those joining from a catch-up are checked once it ends (_joined)
                if c.deployment_name not in joining and self.served[c.deployment_name] != previous:
                    why = (f"deployment {c.deployment_name} serves {self.served[c.deployment_name]!r}, not the "
                           f"delta's parent {previous!r}; a full snapshot is needed")
                    if self.require_all or len(clients) == 1:
                        raise NotSignalled(why)
                    left[c.deployment_name] = why
                    clients.remove(c)
        validation = {"extra_fields_ignore": self.extra_fields_ignore} if self.extra_fields_ignore else None
        lagging = set(self.behind)  # already behind before this snapshot: its signal gets a short retry budget
        failed = self._on_each(clients, lambda c: self._joined(c, previous, joining, len(clients) > 1) and c.signal(
            identity, previous_identity=previous, reset_prompt_cache=self.reset_prompt_cache,
            compression_format=self.compression_format, validation=validation,
            deadline=time.monotonic() + HINT_DEADLINE_S if c.deployment_name in lagging else None))
        with self._state:
            for c in clients:  # it may load these; those that accepted it are never signalled it again
                if c.deployment_name in failed and manager_may_be_down(failed[c.deployment_name]):
                    self._mark_down(c.deployment_name, f"its signal failed: {failed[c.deployment_name]}")
                if c.deployment_name not in failed or not _unsent(failed[c.deployment_name]):
                    self._signalled.setdefault(c.deployment_name, set()).add(identity)
                if not self.require_all and (c.deployment_name not in failed or holds_it(failed[c.deployment_name])):
                    self._taken.setdefault(c.deployment_name, set()).add(identity)
        taken = len(failed) < len(clients) or not all(map(_unsent, failed.values()))
        clients = self._go_on(clients, failed, left, "its signal failed", RuntimeError if taken else NotSignalled)
        t0 = time.perf_counter()
        last: dict[str, Any] = {}  # deployment -> its last status polled
        most: dict[str, int] = {}  # deployment -> the most replicas one of its statuses listed

        def polled(c: Any, st: Any) -> None:
            last[c.deployment_name] = st
            most[c.deployment_name] = max(most.get(c.deployment_name, 0), len(st.replicas))
            if on_poll is not None:
                on_poll(c.deployment_name, st, c.redact)

        start, release = time.monotonic(), [float("inf")]  # straggler_wait_s after the first one served it
        cut = self.straggler_wait_s is not None and len(clients) > 1

        moot = threading.Event()  # another deployment serves it or failed otherwise: it cannot be LoadedNowhere

        def wait(c: Any) -> None:
            settling = False  # only a load error, with a status to go on, may end in LoadedNowhere
            try:
                c.wait_ready(identity, timeout_s=self.ready_timeout_s, on_poll=lambda st: polled(c, st),
                             until=(lambda: release[0]) if cut else None)
            except HotLoadError as exc:
                settling = _load_error(exc) and c.deployment_name in last
                if settling:
                    self._settle(c, identity, lambda st: polled(c, st), last[c.deployment_name],
                                 min(start + self.ready_timeout_s, time.monotonic() + self.settle_s),
                                 lambda: moot.is_set() or time.monotonic() >= release[0])
                raise
            finally:
                if not settling:
                    moot.set()
            if cut:
                release[0] = min(release[0], time.monotonic() + self.straggler_wait_s)

        failed = self._on_each(clients, wait)
        # every replica failed it, and as many as were ever listed: one that left the list mid-load (evicted,
        # rescheduled) may come back to the newest snapshot signalled, which must then still be there
        nowhere = bool(failed) and all(
            c.deployment_name in failed and _load_error(failed[c.deployment_name]) and c.deployment_name in last
            and last[c.deployment_name].failed_everywhere(identity)
            and len(last[c.deployment_name].replicas) >= most[c.deployment_name] for c in clients)
        with self._state:
            for c in clients:
                name = c.deployment_name
                if name not in failed:
                    self._serve(name, identity)
                    continue
                if isinstance(failed[name], HotLoadTimeout) and release[0] < start + self.ready_timeout_s:
                    self._released[name] = (identity, start + self.ready_timeout_s)  # its catch-up waits on
                    failed[name] = HotLoadTimeout(f"not served by every replica {self.straggler_wait_s:g} s after "
                                                  "another deployment served it (straggler_wait_s): its catch-up waits")
                if not self.require_all and isinstance(failed[name], HotLoadTimeout):
                    self._timed_out.add(name)
                if name in last and not last[name].replicas:  # its manager went down (a container restarts)
                    self._mark_down(name, "it reported no replica while its load was waited for")
                # what its replicas serve or load now, and this snapshot, which a load may end in; one left to its
                # catch-up (straggler_wait_s) loads on, and may still hold earlier signals in its queue
                if name in last:
                    self._signalled[name] = {i for r in last[name].replicas for i in (
                        r.current_snapshot_identity, r.target if r.stage != "error" else None) if i} | {identity} | (
                        self._signalled.get(name, set()) if self._release_of(name, identity) is not None else set())
            # no other deployment may hold it either (a signal that failed after it may have been taken)
            nowhere = nowhere and not any(identity in ids for n, ids in self._signalled.items() if n not in failed)
            if nowhere:  # no replica loads it: retention need not spare it
                for name in failed:
                    self._signalled.get(name, set()).discard(identity)
        self._go_on(clients, failed, left, "it did not serve it", LoadedNowhere if nowhere else RuntimeError)
        self._left_behind(identity, left)
        if not self.require_all:
            self._extend_chain(identity, previous)
            lanes = self._catch_up()  # not those alive now: one refused at once may have ended already
            with self._state:
                self.catching_up = frozenset(n for n in self.behind.keys() & lanes if self._loads(n))
        return time.perf_counter() - t0

    def _settle(self, c: Any, identity: str, polled: Callable[[Any], None], st: Any, end: float,
                moot: Callable[[], bool]) -> None:
        """After a load error of ``identity`` on some replica of ``c``: poll (``poll_interval_s`` apart, until
        ``end``) while another replica neither failed that load nor serves it; ``polled`` records each answer.
        Why: the wait ends at the first replica's error, when the others may still be loading; a snapshot is
        told loaded by no replica (:class:`LoadedNowhere`) only from a status in which every replica failed it.
        A poll that fails ends it, and so does ``moot()`` (another deployment serves it or failed otherwise, or
        ``straggler_wait_s`` released the waits): the snapshot is then kept."""
        while not (st.failed_everywhere(identity) or any(r.serves(identity) for r in st.replicas)):
            if moot() or time.monotonic() >= end or self._cancelled.wait(
                    min(c.poll_interval_s, end - time.monotonic())) or moot():
                return
            try:
                st = c.status(deadline=end)
            except Exception:  # noqa: BLE001 - its state is unknown: the snapshot stays
                return
            polled(st)

    def _busy(self, clients: list[Any], previous: str | None) -> tuple[dict[str, str], set[str]]:
        """The deployments this snapshot leaves out (-> why), and those it signals once their catch-up ends.

        Left out: one whose last load timed out (:attr:`_timed_out`), while another deployment is signalled (and
        the last publish that left one out did not fail), so that replicas hanging in a load cost the publisher
        no ``ready_timeout_s`` at each full snapshot (its catch-up signals it after the publish); one whose
        catch-up has more than the delta's parent to load; and, with ``straggler_wait_s`` while another one is
        signalled, one whose catch-up loads a snapshot (it goes on to this one after that load, which a publish
        that joined it waited for: up to a whole load, what the option bounds).
        Joining: every other one catching up for a full snapshot (its catch-up stops after the load in flight),
        and for a delta those whose catch-up loads its parent. Why: a catch-up ends at the chain's end, the
        parent, while the snapshot after it is being signalled; left out again, a deployment whose loads take
        longer than an upload never rejoined the publishes."""
        busy: dict[str, str] = {}
        joining: set[str] = set()

        def lane(name: str) -> None:
            if previous is None or previous in (self._lane_at.get(name), self.served[name]):
                self._lane_stop.add(name)
                joining.add(name)
            else:  # what is left: the snapshot it loads now (if any) and those after it
                at = self._lane_at.get(name)
                i = self._chain.index(at) if at in self._chain else (
                    self._chain.index(self.served[name]) + 1 if self.served[name] in self._chain else 0)
                busy[name] = f"catching up ({len(self._chain) - i} earlier snapshot(s) to load first)"

        def takes(name: str) -> bool:  # signalled, unless a delta's chain check leaves it out (it must take one)
            return previous is None or self.served[name] == previous

        with self._state:
            names = [c.deployment_name for c in clients]
            hung = set(names) & self._timed_out
            # straggler_wait_s, and another deployment is signalled: a catch-up's load in flight is not waited for
            free = self._spare and self.straggler_wait_s is not None and any(
                n not in self._lanes and n not in hung and takes(n) for n in names)
            freed = False
            for name in [n for n in names if n in self._lanes and n not in hung]:
                if free and self._loading(name):
                    busy[name] = f"catching up (loads {self._lane_at[name]}; not waited for: straggler_wait_s)"
                    freed = True
                else:
                    lane(name)
            self._spared = freed  # the first to set it in this publish (_joined runs later)
            if self._spare and any(n not in busy and n not in hung and (n in joining or takes(n)) for n in names):
                busy.update((n, HUNG) for n in hung)
                self._spared = freed or bool(hung)
            else:
                for name in [n for n in hung if n in self._lanes]:
                    lane(name)
        return busy, joining

    def _loading(self, name: str) -> bool:
        """Whether ``name``'s catch-up signals a snapshot or waits for its load (not one asking, with one status
        request, whether a load ended). Called under ``_state``."""
        target = self._lane_at.get(name)
        if target is None or self.served[name] == target:  # none, or served: it moves on or ends now
            return False
        return name not in self._settling or self._release_of(name, target) is not None

    def _joined(self, c: Any, previous: str | None, joining: set[str], others: bool) -> bool:
        """For a deployment catching up (``joining``): wait for its catch-up to end (its load in flight, at most
        about ``ready_timeout_s``), and fail its signal of a delta if it does not serve the delta's parent then,
        or, where ``others`` are signalled, if that load timed out (a second wait would double the cost). One whose
        catch-up found its manager down (no replica listed, a 5xx to its signal) or timed out (its polls may have
        failed) is asked again first. Each failure here sends nothing (:class:`NotSignalled`)."""
        name = c.deployment_name
        if name not in joining:
            return True
        with self._state:
            if not self._lanes_done.wait_for(lambda: name not in self._lanes,
                                             join_wait_s(self.ready_timeout_s)):
                raise NotSignalled("its catch-up did not end in time")
            if previous is not None and self.served[name] != previous:
                raise NotSignalled(f"its catch-up ended before {previous!r}, the delta's parent "
                                   f"(it serves {self.served[name]!r})")
            if name in self._timed_out and self._spare and others:  # its catch-up takes it from here
                self._spared = True
                raise NotSignalled(HUNG)
            up = name in self._managers_up and name not in self._timed_out
        if not up:
            try:
                listed = c.status(deadline=self._short_deadline()).replicas
            except HotLoadCancelled:
                raise
            except Exception as exc:  # noqa: BLE001 - no signal was sent: never_taken must not decide (retention)
                if manager_may_be_down(exc):
                    with self._state:
                        self._mark_down(name, f"its status request failed: {exc}")
                raise NotSignalled(f"its status after its catch-up failed: {exc}") from exc
            if not listed:
                raise NotSignalled("its hot-load manager went down during its catch-up (it reports no replica)")
            with self._state:
                self._managers_up.add(name)
        return True

    def _up_managers(self, previous: str | None, left: dict[str, str]) -> list[Any]:
        """The clients whose hot-load manager reported a replica, safe to signal. The first signal waits for
        every manager, at most ``MANAGER_WAIT_S``; with ``require_all`` every later one that finds a manager
        still down waits again. A wait is followed by a status read of every deployment not asked during its last
        poll interval (one may have gone down meanwhile), and one found down is waited for too, within the same
        bound. Without it, a later full snapshot asks such a deployment once and signals it if
        it is up, and a delta leaves it out (it serves none of this chain): a region that stays down costs the
        others no wait."""
        new = [c for c in self.clients if c.deployment_name not in self._managers_up]
        failed: dict[str, Exception] = {}
        if new and (self.require_all or not self._managers_waited):
            start = time.monotonic()
            deadline = start + min(MANAGER_WAIT_S, self.ready_timeout_s)
            asked: dict[str, float] = {}  # deployment -> when its wait found a replica

            def wait(c: Any) -> None:
                self._first_seen[c.deployment_name] = c.wait_manager(timeout_s=max(0.0, deadline - time.monotonic()))
                self._note_found(c.deployment_name, self._first_seen[c.deployment_name])
                asked[c.deployment_name] = time.monotonic()

            for rounds in itertools.count(1):
                failed.update(self._on_each(new, wait))
                self._managers_up.update(c.deployment_name for c in new if c.deployment_name not in failed)
                if failed and self.require_all:
                    break
                # one may have gone down while another was waited for (up to minutes): a status older than a poll
                # interval is read again, and a manager found down is waited for within the same bound; a round
                # per deployment at most (answers that flip between up and down would have it spin)
                ended = time.monotonic()
                stale = [c for c in self.clients if ended - asked.get(c.deployment_name, start) > c.poll_interval_s]
                self._recheck_managers(stale)
                asked.update((c.deployment_name, ended) for c in stale)
                new = [c for c in self.clients if c.deployment_name not in self._managers_up | failed.keys()]
                if not new:
                    break
                if time.monotonic() >= deadline or rounds > len(self.clients):
                    failed.update((c.deployment_name, RuntimeError(
                        "its hot-load manager stopped reporting a replica while another was waited for")) for c in new)
                    break
            self._managers_waited = True
        elif new and previous is None:
            failed = self._on_each(new, self._ask_manager)
        elif new:  # why each was found down, where one was: a region that stopped answering is no manager not up
            failed = {c.deployment_name: RuntimeError(self._down_why.get(
                c.deployment_name, "its hot-load manager has not reported a replica yet")) for c in new}
        self._managers_up.update(c.deployment_name for c in new if c.deployment_name not in failed)
        return self._go_on(self.clients, failed, left, "not signalled", NotSignalled)

    def _recheck_managers(self, clients: list[Any] | None = None) -> None:
        """Ask each deployment whose hot-load manager reported a replica whether it still does (one status request
        each, at once), before a snapshot's signal. Why: its container may have restarted since, and a signal sent
        before the manager is up again can crash it. One found down (no replica listed, no answer, a 5xx) is then
        waited for or left out as before its first signal, with what was found (no replica, or the request's error)
        as the reason; any other failure is the signal's to report."""
        down: dict[str, str] = {}  # deployment -> how it was found down

        def ask(c: Any) -> None:
            try:
                if not c.status(deadline=self._short_deadline()).replicas:
                    down[c.deployment_name] = "it reports no replica now (its hot-load manager may be restarting)"
            except Exception as exc:  # noqa: BLE001 - see above
                if manager_may_be_down(exc):
                    down[c.deployment_name] = f"its status request failed: {exc}"

        self._on_each([c for c in (self.clients if clients is None else clients)
                       if c.deployment_name in self._managers_up], ask)
        with self._state:
            for name, why in down.items():
                self._mark_down(name, why)

    def _mark_down(self, name: str, why: str) -> None:
        """Called under ``_state``. Counted: a catch-up's older answer "up" must not undo it (see :meth:`_lane`).
        ``why`` is what a delta that leaves it out says (a hung API is told apart from a manager never up)."""
        self._managers_up.discard(name)
        self._downs[name] = self._downs.get(name, 0) + 1
        self._down_why[name] = why

    def _ask_manager(self, c: Any) -> None:
        st = c.status(deadline=self._short_deadline())
        if not st.replicas:
            raise RuntimeError("it reports no replica yet (its hot-load manager is not up)")
        if c.deployment_name not in self._managers_up:  # logged before its next signal
            self._first_seen[c.deployment_name] = st
            self._note_found(c.deployment_name, st)

    def _note_found(self, name: str, st: Any) -> None:
        """Record what ``name``'s replicas serve or load in its first status (:attr:`_found`)."""
        with self._state:
            if self.served[name] is None and name not in self._found:
                self._found[name] = found_in(st)

    def _go_on(self, clients: list[Any], failed: dict[str, Exception], left: dict[str, str], what: str,
               kind: type[RuntimeError]) -> list[Any]:
        """The clients that did not fail, to carry on with; raises ``kind`` instead where every deployment must
        take part (``require_all``) or none is left, or where close() cancelled a wait (given up on, the snapshot
        must not count as served by the deployments that were quicker)."""
        if failed and (self.require_all or len(failed) == len(clients)
                       or any(isinstance(exc, HotLoadCancelled) for exc in failed.values())):
            raise kind("; ".join(f"{name}: {error}" for name, error in failed.items()))
        left.update((name, f"{what}: {exc}") for name, exc in failed.items())
        return [c for c in clients if c.deployment_name not in failed]

    def _left_behind(self, identity: str, left: dict[str, str]) -> None:
        """Record the deployments that do not serve ``identity``, and log what changed (:func:`say_behind`)."""
        before, self.behind = self.behind, dict(left)
        say_behind(identity, before, left)
        self._lane_warned -= before.keys() - left.keys()

    def _extend_chain(self, identity: str, previous: str | None) -> None:
        """``identity`` counted as served: the chain catch-ups follow ends with it."""
        with self._state:
            if previous is None:
                self._chain = [identity]
            elif self._chain and self._chain[-1] == previous:
                self._chain.append(identity)
            else:  # not known from its full snapshot on: nothing to catch up on until the next one
                self._chain = []
            chain = set(self._chain)
            self._taken = {name: ids & chain for name, ids in self._taken.items()}

    def _serve(self, name: str, identity: str) -> None:
        """Every replica of ``name`` serves ``identity``. Called under ``_state``."""
        self.served[name] = identity
        self._signalled.pop(name, None)
        self._found.pop(name, None)
        self._timed_out.discard(name)
        self._released.pop(name, None)

    def _on_each(self, clients: list[Any], fn: Callable[[Any], Any]) -> dict[str, Exception]:
        """Run ``fn`` on every client at once in the pool; returns {deployment: error} of those that failed."""
        futures = [(c, self._pool.submit(fn, c)) for c in clients]
        failed: dict[str, Exception] = {}
        for c, f in futures:
            try:
                f.result()
            except Exception as exc:  # noqa: BLE001 - collected: every deployment is waited for
                failed[c.deployment_name] = exc
        return failed

    def cancel(self) -> None:
        """End the signals, hints and readiness waits in flight now (from any thread), and every later one: for
        a publisher that gave up on its snapshots, whose thread would otherwise poll for up to
        ``ready_timeout_s``. A deployment already signalled may still load that snapshot."""
        self._cancelled.set()
        for c in self.clients:
            c.cancel()

    def close(self, timeout: float | None = 0.0) -> None:
        """Cancel what is in flight, after waiting up to ``timeout`` seconds for the deployments catching up (None:
        while their loads end, each within ``ready_timeout_s``: :meth:`drain_loading`); then name each deployment
        left behind, and what it serves, where the job's end is seen last. Why a bound without a timeout: the other
        ranks have returned from close() meanwhile, and a script's next collective waits for this one."""
        if not (self.drain_loading() if timeout is None else self.drain(timeout)):
            log.warning("hotload: closing while %s still catch(es) up: cancelled", ", ".join(sorted(self._lanes)))
        self.cancel()
        self._pool.shutdown()
        with self._state:
            newest = self._chain[-1] if self._chain and not self.require_all else None
            behind = {name: ident for name, ident in self.served.items() if newest is not None and ident != newest}
        say_left_behind(newest, behind)


HUNG = "its last load timed out: its catch-up signals it, on a thread of its own"


def _unsent(exc: BaseException) -> bool:
    """Whether a deployment's failed signal reached no replica: never sent (:class:`NotSignalled`, from
    ``_joined``), or refused as :func:`never_taken` says; the snapshot is then no deployment's to load."""
    return isinstance(exc, NotSignalled) or never_taken(exc)


def _load_error(exc: BaseException) -> bool:
    """Whether a readiness wait ended at a replica's load error (not at its timeout, a cancel or a poll that
    failed): only then may every replica have ended its load."""
    return type(exc) is HotLoadError and exc.status_code is None
