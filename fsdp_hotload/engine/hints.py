"""Hints: tell each deployment that one file of a snapshot is durable, so that its replicas can fetch it early.

Apart from :mod:`.signal` so that the Signaller's module holds the signalling itself; :class:`.signal.Signaller`
inherits :class:`Hints`, with its clients. What hints learn of a deployment's hot-load manager is not shared with
the signal, which reads each deployment's status itself before every snapshot: a first signal that found every
manager marked up by hints never waited for them, and a manager that went down later then held a publish with
``deployments_required="any"`` for up to ``MANAGER_WAIT_S``.

Example::

    sig = Signaller.from_config(cfg)
    sig.hint("step-000012-ab12cd34", "model-00001-of-00004.safetensors", previous="step-000011-ab12cd34")
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .signal_limits import HINT_DEADLINE_S

log = logging.getLogger("fsdp_hotload")


class Hints:
    """The hints of :class:`.signal.Signaller`, whose ``__init__`` sets these attributes."""

    clients: list[Any]
    compression_format: str
    ready_timeout_s: float
    hint_skip: frozenset[str]  # deployments left behind (the last outcome's deployments_behind)
    _hints_failed: dict[str, str]  # deployment -> the identity whose hints stopped after a failure
    _hints_asked: dict[str, str]  # deployment -> the identity whose hints its status let go out
    _hint_lock: threading.Lock

    def _short_deadline(self) -> float:
        """The deadline of a hint or a status read (``time.monotonic()``): ``HINT_DEADLINE_S``, retries included."""
        return time.monotonic() + min(HINT_DEADLINE_S, self.ready_timeout_s)

    def hint(self, identity: str, filename: str, previous: str | None) -> None:
        """Best effort: a lost hint only delays the replicas' prefetch, never correctness. So each hint gets at
        most ``HINT_DEADLINE_S`` (retries included), and after one fails, that deployment gets no more hints for
        this snapshot: an unreachable API used to hold every file's upload worker for the full retry budget.

        A deployment gets a snapshot's hints only once its status lists a replica. Why: a signal before its
        hot-load manager is up can crash the serving container (the reference client waits for replicas before its
        first signal), and a hint is a POST to the same service (that it carries the same risk is inferred, not
        documented); rank 0's manager wait runs only after the files are uploaded, and the other ranks never run
        it. So each Signaller asks before a snapshot's first hint to it (one status GET: its container may have
        restarted since the last snapshot) and, while none is listed, skips that snapshot's hints. A deployment left
        behind (``hint_skip``) gets no hints: it is not signalled deltas, and its full snapshot's signal is enough
        (a region that is down would otherwise hold each snapshot's outcome up to ``HINT_DEADLINE_S``)."""
        for c in self.clients:
            if self._hints_failed.get(c.deployment_name) == identity:
                continue
            if c.deployment_name in self.hint_skip:  # left behind: not signalled a delta, and one that is down
                continue  # would hold every snapshot's outcome for the hints' retries
            if not self._manager_up_for_hints(c, identity):
                continue
            try:
                c.hint(identity, filename, previous_identity=previous, compression_format=self.compression_format,
                       deadline=self._short_deadline())
            except Exception as exc:  # noqa: BLE001
                self._hints_failed[c.deployment_name] = identity
                log.warning("hotload: hint for %s/%s to %s failed (no more hints for this snapshot): %s",
                            identity, filename, c.deployment_name, exc)

    def _manager_up_for_hints(self, c: Any, identity: str) -> bool:
        name = c.deployment_name
        if self._hints_asked.get(name) == identity:
            return True
        with self._hint_lock:  # upload workers hint at once; one status GET answers all of them
            if self._hints_asked.get(name) == identity:
                return True
            if self._hints_failed.get(name) == identity:
                return False
            try:
                st = c.status(deadline=self._short_deadline())
                why = "" if st.replicas else "it reports no replica yet (its hot-load manager is not up)"
            except Exception as exc:  # noqa: BLE001 - best effort, like the hint itself
                why = f"its status could not be read: {exc}"
            if not why:
                self._hints_asked[name] = identity
                return True
            self._hints_failed[name] = identity
            log.info("hotload: no hints for %s to %s: %s", identity, name, why)
            return False
