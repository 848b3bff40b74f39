"""Catch-ups (``deployments_required="any"``): a thread per deployment left behind that signals it the snapshots it
missed, in order, each once every replica serves the one before.

Apart from :mod:`.signal` so that the Signaller's module holds the publishes' own signalling;
:class:`.signal.Signaller` inherits :class:`CatchUps`, and its publishes start them (``_catch_up``), stop one at the
load in flight where they take a deployment over (``_lane_stop``), and wait for them (``drain``).

Example::

    sig = Signaller.from_config(cfg)        # deployments_required="any"
    sig.signal_and_wait("step-000012-ab12cd34", previous="step-000011-ab12cd34")   # starts those behind
    sig.drain(60)                           # True once none is catching up
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from ..fireworks_models import HotLoadCancelled, HotLoadTimeout, holds_it, manager_may_be_down, never_taken
from .signal_limits import HINT_DEADLINE_S, say_what_is_served

log = logging.getLogger("fsdp_hotload")


class CatchUps:
    """The catch-ups of :class:`.signal.Signaller`, whose ``__init__`` sets these attributes (documented there)."""

    clients: list[Any]
    served: dict[str, str | None]
    ready_timeout_s: float
    reset_prompt_cache: str | None
    compression_format: str
    extra_fields_ignore: list[str]
    _state: threading.Lock
    _lanes_done: threading.Condition
    _chain: list[str]
    _lanes: dict[str, threading.Thread]
    _lane_at: dict[str, str]
    _lane_stop: set[str]
    _settling: set[str]
    _lane_warned: set[str]
    _taken: dict[str, set[str]]
    _signalled: dict[str, set[str]]
    _released: dict[str, tuple[str, float]]
    _timed_out: set[str]
    _managers_up: set[str]
    _downs: dict[str, int]
    _lane_loads: int
    _first_seen: dict[str, Any]
    _ask_manager: Callable[[Any], None]
    _mark_down: Callable[[str, str], None]
    _serve: Callable[[str, str], None]

    def _next_for(self, name: str) -> tuple[str, str | None, bool] | None:
        """The snapshot a catch-up brings ``name`` to next, its parent there (None: a full one), and whether it
        accepted its signal before (a second one is refused: the catch-up only asks whether every replica serves
        it by now, a load that ended after its readiness wait); None when it serves the newest. Called under
        ``_state``."""
        served, chain = self.served[name], self._chain
        if not chain or served == chain[-1]:
            return None
        i = chain.index(served) + 1 if served in chain else 0
        return chain[i], chain[i - 1] if i else None, chain[i] in self._taken.get(name, ())

    def _loads(self, name: str) -> bool:
        """Whether ``name``'s catch-up loads snapshots: not one that asks after a snapshot whose signal it took
        before (it may not serve it, and stay behind), nor one that asks whether a manager that was down is up.
        Called under ``_state``."""
        if name not in self._managers_up:
            return False
        if name in self._lane_at:  # under way
            target, settle = self._lane_at[name], name in self._settling
        elif (nxt := self._next_for(name)) is None:
            return True
        else:
            target, settle = nxt[0], nxt[2]
        released = self._release_of(name, target)  # straggler_wait_s: it waits out that load, then goes on
        return not settle or (released is not None and released > time.monotonic())

    def _release_of(self, name: str, identity: str) -> float | None:
        """When the wait for ``identity``'s load, which a publish left to ``name``'s catch-up (``straggler_wait_s``),
        ends (``time.monotonic()``); None where no publish did. Called under ``_state``."""
        released = self._released.get(name)
        return released[1] if released is not None and released[0] == identity else None

    def _catch_up(self) -> set[str]:
        """Start a catch-up for each deployment behind the chain; returns those that have one (started or under
        way). Each runs on a thread of its own: a region that stays down costs each snapshot one status request or
        one signal's retries (``HINT_DEADLINE_S``) there, never time on the publisher's thread."""
        with self._state:
            lanes = set(self._lanes)
        for c in self.clients:
            name = c.deployment_name
            with self._state:
                if name in self._lanes or self._next_for(name) is None:
                    continue
                lane = threading.Thread(target=self._lane, args=(c,), name="hotload-catch-up", daemon=True)
                self._lanes[name] = lane
            try:
                lane.start()
            except RuntimeError as exc:  # no threads left: the next snapshot tries again
                log.warning("hotload: cannot start %s's catch-up: %s", name, exc)
                with self._state:
                    self._end_lane(name)
            else:
                lanes.add(name)
        return lanes

    def _lane(self, c: Any) -> None:
        """One catch-up: signal ``c`` the next snapshot of the chain, wait until every replica serves it, repeat
        until it serves the newest. A failure ends it; the next snapshot starts another where it can. First, it
        is asked whether its hot-load manager reports a replica (one status request: it may have come up, or gone
        down, since the publish asked; an answer "up" that arrives after a newer read found it down ends it); and
        a snapshot whose signal it accepted before is not sent again, it is asked whether every replica serves it
        by now (one status request), which a load that outlasted its readiness wait ends in."""
        name, t0, loaded, target, handed = c.deployment_name, time.perf_counter(), 0, None, False
        validation = {"extra_fields_ignore": self.extra_fields_ignore} if self.extra_fields_ignore else None
        try:
            with self._state:
                downs = self._downs.get(name, 0)
            self._ask_manager(c)  # its manager may have gone down since the publish asked
            with self._state:
                if self._downs.get(name, 0) != downs:  # a newer status read found it down: that one counts
                    raise RuntimeError("its hot-load manager was found down while it was asked")
                self._managers_up.add(name)
            while True:
                with self._state:
                    handed = name in self._lane_stop  # a publish signals it next
                    nxt = None if handed else self._next_for(name)
                    if nxt is None:  # ended where the decision is taken: a publish must not see it running
                        self._end_lane(name)
                        break
                    (target, previous, settle), served = nxt, self.served[name]
                    self._lane_at[name] = target
                    (self._settling.add if settle else self._settling.discard)(name)
                    released = self._release_of(name, target)
                    self._signalled.setdefault(name, set()).add(target)  # retention spares it from now on
                    if not loaded and not settle:  # once per fall behind: one that stays down tries each publish
                        log.log(logging.DEBUG if name in self._lane_warned else logging.INFO,
                                "hotload: deployment %s serves %s: catching up, from %s (%d snapshot(s) to load "
                                "in order)", name, served or "no snapshot of this run", target,
                                len(self._chain) - self._chain.index(target))
                if settle and released is not None:  # a publish left its load to it (straggler_wait_s)
                    try:
                        self._wait_lane(c, target, released - time.monotonic())
                    except Exception:  # its load failed or outlasted ready_timeout_s: it no longer loads
                        with self._state:
                            self._released.pop(name, None)
                        raise
                    log.info("hotload: deployment %s serves %s, after straggler_wait_s", name, target)
                elif settle:
                    st = c.status(deadline=time.monotonic() + HINT_DEADLINE_S)
                    if not st.replicas:  # its manager went down: asked again before anything is sent there
                        with self._state:
                            self._mark_down(name, "it reports no replica now (its hot-load manager may be "
                                            "restarting)")
                    if not st.is_ready(target):
                        raise RuntimeError(f"it accepted {target}'s signal before and not every replica serves it "
                                           "(a load that failed or goes on): it is not signalled again")
                    log.info("hotload: deployment %s serves %s after all: its load ended after the readiness wait",
                             name, target)
                else:
                    self._signal_lane(c, target, previous, validation)
                    self._wait_lane(c, target, self.ready_timeout_s)
                with self._state:
                    self._serve(name, target)
                    self._lane_loads += 1
                loaded += 1
        except HotLoadCancelled:
            log.info("hotload: %s's catch-up ended at %s: cancelled (closing)", name, target or "its start")
        except Exception as exc:  # noqa: BLE001 - logged; it stays behind until a later catch-up or full snapshot
            level = logging.DEBUG if name in self._lane_warned else logging.WARNING
            self._lane_warned.add(name)
            log.log(level, "hotload: %s's catch-up stopped at %s (%d snapshot(s) loaded; tried again after each "
                    "publish, logged at DEBUG until it catches up): %s", name, target or "its start", loaded, exc)
        else:
            if loaded:
                self._lane_warned.discard(name)
                log.info("hotload: deployment %s %s: serves %s (%d snapshot(s) loaded in %.1f s)", name,
                         "joins the publish's signal" if handed else "caught up", target, loaded,
                         time.perf_counter() - t0)
        finally:
            with self._state:
                if self._lanes.get(name) is threading.current_thread():
                    self._end_lane(name)

    def _wait_lane(self, c: Any, target: str, timeout_s: float) -> None:
        """A catch-up's wait until every replica serves ``target``."""
        seen: list[Any] = [None]  # the last status polled
        try:
            c.wait_ready(target, timeout_s=max(0.0, timeout_s), on_poll=lambda st: seen.__setitem__(0, st))
        except HotLoadTimeout:
            with self._state:
                self._timed_out.add(c.deployment_name)
                if seen[0] is not None and not seen[0].replicas:
                    self._mark_down(c.deployment_name, "it reported no replica while its catch-up waited for a load")
            raise

    def _signal_lane(self, c: Any, target: str, previous: str | None, validation: dict[str, Any] | None) -> None:
        """A catch-up's signal, with the short retry budget; records whether the deployment may load ``target``
        and whether it accepted it (never to be sent again)."""
        first = self._first_seen.pop(c.deployment_name, None)
        if first is not None:  # its manager came up since the first snapshot
            say_what_is_served(c.deployment_name, first, target)
        try:
            c.signal(target, previous_identity=previous, reset_prompt_cache=self.reset_prompt_cache,
                     compression_format=self.compression_format, validation=validation,
                     deadline=time.monotonic() + HINT_DEADLINE_S)
        except Exception as exc:
            with self._state:
                if manager_may_be_down(exc):
                    self._mark_down(c.deployment_name, f"its catch-up's signal failed: {exc}")
                if never_taken(exc):  # no replica loads it
                    self._signalled.get(c.deployment_name, set()).discard(target)
                if holds_it(exc):
                    self._taken.setdefault(c.deployment_name, set()).add(target)
            raise
        with self._state:
            self._taken.setdefault(c.deployment_name, set()).add(target)

    def _end_lane(self, name: str) -> None:
        """Called under ``_state``."""
        self._lanes.pop(name, None)
        self._lane_at.pop(name, None)
        self._settling.discard(name)
        self._lane_stop.discard(name)
        self._lanes_done.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no deployment is catching up (``deployments_required="any"``); False if one still is after
        ``timeout`` seconds. close() waits so that every deployment that can take them ends on the newest weights.
        """
        with self._state:
            if self._lanes and timeout != 0:
                log.info("hotload: waiting for %s to catch up", ", ".join(sorted(self._lanes)))
            return self._lanes_done.wait_for(lambda: not self._lanes, timeout)

    def drain_loading(self) -> bool:
        """:meth:`drain` for as long as the catch-ups load: ``ready_timeout_s`` at a time, again after any round
        in which a load ended (False after one in which none did). Why: a catch-up may have several loads left
        (slow loads that ``straggler_wait_s`` left to it, a publish that did not wait for its load in flight), and
        each has ``ready_timeout_s``; one bound for all of them left a deployment behind at close()."""
        while True:
            with self._state:
                loads = self._lane_loads
            if self.drain(self.ready_timeout_s):
                return True
            with self._state:
                if self._lane_loads == loads:
                    return False
