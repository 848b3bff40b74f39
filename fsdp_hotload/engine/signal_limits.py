"""How long signalling may take, and the settings that cost publishes, said once at start; what a deployment
serves, said before its first signal (and kept from retention while it may serve it); those that fall behind or
catch up; at close, those left behind.

Apart from :mod:`.signal` so that the Signaller's module holds the signalling itself.

Example::

    warn_at_start(cfg, codec)          # rank 0, once
    budget_s = longest_signal_s(cfg)   # what the other ranks must wait for rank 0's outcome
"""
from __future__ import annotations

import logging
import os
import urllib.parse
from typing import Any

from ..config import HotloadConfig

log = logging.getLogger("fsdp_hotload")

#: The most one hint may take, retries included (and never more than ``ready_timeout_s``).
HINT_DEADLINE_S = 10.0
#: The longest a signal retries transient failures; shorter when ``ready_timeout_s`` is.
SIGNAL_RETRY_BUDGET_S = 300.0
#: The longest the first signal to a deployment waits for its hot-load manager (replicas reported).
MANAGER_WAIT_S = 300.0
#: With ``keep_last``: after a replica's load error, the longest a publish asks on (within ``ready_timeout_s``)
#: while another replica still loads the snapshot, to tell whether every replica failed it (it is then deleted).
#: Replicas read the same files, so a bad one fails each soon after the first; a bound, since the failed
#: publish's report waits meanwhile.
LOAD_ERROR_SETTLE_S = 60.0


#: Beyond what its load may take, how long a snapshot waits for a catch-up to end (:func:`join_wait_s`).
JOIN_SLACK_S = 5.0


def join_wait_s(ready_timeout_s: float) -> float:
    """How long a snapshot waits for a catch-up's load in flight to end: the catch-up's status request and its
    signal (``HINT_DEADLINE_S`` each at most), the readiness wait, and some slack."""
    return ready_timeout_s + 2 * HINT_DEADLINE_S + JOIN_SLACK_S


def longest_signal_s(cfg: HotloadConfig) -> float:
    """The longest rank 0 may spend signalling one snapshot: the status request that asks whether the deployment's
    manager is still up, the wait for it and the status requests after that wait (another may have gone down
    meanwhile), the signal's retries, then the readiness wait. With ``deployments_required="any"`` the wait may
    instead be for a catch-up's load to end, and a status request after it, where that is longer."""
    short, rt = min(HINT_DEADLINE_S, cfg.ready_timeout_s), cfg.ready_timeout_s
    wait = min(MANAGER_WAIT_S, rt)
    if cfg.deployments_required == "any":
        wait = max(wait, join_wait_s(rt) + short)
    return 2 * short + wait + min(SIGNAL_RETRY_BUDGET_S, rt) + rt


def warn_at_start(cfg: HotloadConfig, codec: Any = None) -> None:
    """Settings that are allowed but cost publishes, said once at start (rank 0) instead of at the first failure;
    and which encoder ``codec`` runs (a warning if ``HOTLOAD_LIBZSTD``'s library could not be loaded).

    keep_last=1 without a hot-load API deletes each snapshot when the next commits, under readers that may still
    be downloading it (with the API, a snapshot is deleted only once the fleet serves a newer one).

    The other ranks wait for rank 0's outcome under the side groups' timeout; when that is shorter than a signal
    may take, a slow load breaks the group and publishing stops for the rest of the job. And a delta codec other
    than arc_v2, the one ``compression_format`` Fireworks documents, is refused by a service that does not run our
    decoder: every delta fails and the next publish is full, so half the steps never reach the fleet. A loopback
    API is the emulator, which is told the formats it takes (``--compression-formats``). ``straggler_wait_s``
    with one deployment changes nothing, which a fleet's config copied to a one-region job would not show."""
    info = getattr(codec, "encoder_info", None)
    if info is not None:
        log.log(logging.WARNING if os.environ.get("HOTLOAD_LIBZSTD") and "unavailable" in info else logging.INFO,
                "%s encoder: %s", codec.name, info)
    if cfg.keep_last == 1 and not cfg.hotload_api_url:
        log.warning("hotload: keep_last=1 without hotload_api_url deletes each snapshot as soon as the next one "
                    "commits, under readers that may still be downloading it: keep 2 or more")
    if not cfg.hotload_api_url:
        return
    from ..fireworks_http import is_loopback

    if cfg.codec != "arc_v2" and not is_loopback(urllib.parse.urlsplit(cfg.hotload_api_url).hostname or ""):
        log.warning("hotload: codec %r is not arc_v2, the only compression_format Fireworks documents for deltas: a "
                    "service that refuses it answers every delta with HTTP 400, and each next publish is full. Use "
                    "codec='arc_v2' unless this service runs hotload's decoder", cfg.codec)
    if cfg.straggler_wait_s is not None and len(cfg.deployments) == 1:
        log.warning("hotload: straggler_wait_s is set with one deployment (%s), which is waited for up to "
                    "ready_timeout_s at each snapshot: the wait ends straggler_wait_s after another deployment "
                    "serves the snapshot, and there is none", cfg.deployments[0])
    if cfg.side_group_timeout_s <= longest_signal_s(cfg):  # only a value set can be: the default is an hour more
        log.warning("hotload: collective_timeout_s (%g s) is not longer than signalling may take (%g s: a wait for "
                    "the deployment's hot-load manager%s, the signal's retries, then ready_timeout_s): a load that "
                    "slow makes the other ranks give up, and publishing stops for the rest of the job; set it above "
                    "%g s, or leave it unset (that plus an hour)",
                    cfg.side_group_timeout_s, longest_signal_s(cfg),
                    " or for its catch-up's load" if cfg.deployments_required == "any" else "", longest_signal_s(cfg))


def say_what_is_served(deployment: str, st: Any, identity: str) -> None:
    """Before the first signal to a deployment, what it serves (once per publisher). Why: a restarted trainer's
    first snapshot replaces what an earlier run left there, and a deployment that serves another run's snapshot
    is also how two trainers on one deployment show."""
    from ..markers import session_of

    served = sorted({r.current_snapshot_identity for r in st.replicas if r.current_snapshot_identity})
    others = [s for s in served if session_of(s) != session_of(identity)]
    now = f"serving {', '.join(served)}{' (another run)' if others else ''}" if served else "serving no snapshot yet"
    log.info("hotload: deployment %s is up (%d replica(s)), %s; signalling %s", deployment, len(st.replicas), now,
             identity)


def found_in(st: Any) -> set[str]:
    """The snapshots a deployment's first status shows its replicas serving or loading (not those whose load
    failed). Why: after a restart they are the earlier run's, which a deployment left behind serves on; retention
    must keep them while it may, so that a replica of it that restarts can rebuild one."""
    return {i for r in st.replicas for i in (r.current_snapshot_identity, r.target if r.stage != "error" else None)
            if i}


def say_behind(identity: str, before: dict[str, str], now: dict[str, str]) -> None:
    """The deployments that fell behind at ``identity`` (-> why), and those no longer behind. Only changes are
    logged: a deployment left out of every delta until the next full would otherwise be logged at every step."""
    for name, why in now.items():
        if name not in before:
            log.warning("hotload: deployment %s does not serve %s (%s); the others go on "
                        "(deployments_required='any'), and it catches up when it takes the snapshots it "
                        "missed, or at the next full snapshot", name, identity, why)
    for name in sorted(before.keys() - now.keys()):
        log.info("hotload: deployment %s serves %s: it is no longer behind", name, identity)


def say_left_behind(newest: str | None, behind: dict[str, str | None]) -> None:
    """At close, each deployment that does not serve the newest snapshot (-> what it serves), where the job's end
    is seen last."""
    if behind:
        log.warning("hotload: closing with deployment(s) left behind, which do not serve the newest snapshot %s: %s",
                    newest, ", ".join(f"{name} serves {ident or 'none of this run'}" for name, ident in behind.items()))
