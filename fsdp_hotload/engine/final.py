"""Publishing the newest step at close, so that the fleet ends on the final weights.

Why a module of its own: the step a trainer ends on is often one the publisher skipped (while busy, or between
``publish_every`` steps), and whether it may still be published is a vote of every rank, taken after every
snapshot in flight has ended, with reasons to refuse that each rank checks on its own. The publisher calls
:func:`publish_newest` from ``publish_final`` under its API lock; the staging itself is the publisher's.

Example::

    started = publish_newest(publisher, sources=None, timeout=30.0)   # every rank calls it (close() does)
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .agreement import NoVote
from .exits import deadline_after
from .jobs import PublishError

log = logging.getLogger("fsdp_hotload")


def publish_newest(pub: Any, sources: Any, timeout: float | None) -> bool:
    """The body of ``Publisher.publish_final`` (see there); ``pub`` is the Publisher, its API lock held."""
    late: TimeoutError | None = None
    deadline = deadline_after(timeout)  # the vote's too: a rank that never votes must not hold this one
    try:
        pub.wait(timeout)
    except TimeoutError as exc:
        late = exc
    if pub.agreements.pending:  # an agreement for a step that never came: read it, it pairs
        pub.agreements.read_at_close(pub._agreement_failed, deadline)
    if pub.config.keep_training_on_error:
        pub.raise_if_failed()  # logs it
        if pub.rank == 0 and pub._last_accepted < pub._last_staged == pub.latest_step:
            # Not published again: a step's identity is never signalled twice (the fleet may hold it).
            log.warning("hotload: the newest step %d failed to publish (keep_training_on_error); the fleet "
                        "ends on step %s", pub.latest_step,
                        pub._last_accepted if pub._last_accepted >= 0 else "none of this run")
    sources = pub._sources_fn if sources is None else sources
    wanted = pub.latest_step > pub._last_staged
    why = objection(pub, sources) if wanted else None
    if wanted and late is not None:
        why = why or "close()'s timeout passed while snapshots were in flight"
    vote = int(not wanted or why is not None)  # a broken rank votes too: ctrl is not the group that broke
    if pub.world > 1:  # one vote: all ranks publish, or none
        if pub.agreements.failed is not None:  # no vote from this rank: the others must not wait for it
            pub.agreements.withdraw("cannot vote: its agreement on the trainer's side group failed earlier")
            declined: str | None = "the ranks' agreement failed earlier"
        else:
            declined = _declined(pub, vote, deadline)
        if declined is not None:
            why = why or (declined if wanted else None)
            wanted = False
    if late is not None and pub._pending:
        raise late
    if why is not None:
        log.warning("hotload: the newest step %d is not published at close: %s (the last snapshot sent: "
                    "step %d)", pub.latest_step, why, pub._last_staged)
    if not wanted or why is not None:
        return False
    stuck = [name for name in pub.cadence.behind if name not in pub.cadence.catching_up]
    if stuck:  # a delta would leave them out: the fleet is to end on the final weights everywhere
        pub.cadence.force_full = True
    if pub.rank == 0:
        log.info("hotload: publishing step %d at close (the newest published before it: step %d)%s",
                 pub.latest_step, pub._last_staged,
                 f", a full snapshot for {', '.join(stuck)}, left behind" if stuck else "")
    t0 = time.perf_counter()  # blocking_ms: the copy, as for any publish (not the wait for the others)
    buf = pub.stager.acquire(wait=True)
    assert buf is not None
    pub._skipped -= pub._skipped_newest
    pub._start(pub.latest_step, buf, sources, False, t0)
    return True


def _declined(pub: Any, vote: int, deadline: float | None) -> str | None:
    """The vote: None where every rank may publish, else why not (some rank objects, or no vote could be taken:
    no rank publishes then). Its failure is raised, or logged with ``keep_training_on_error``."""
    try:
        return "another rank cannot publish it" if pub.agreements.vote(vote, deadline) else None
    except NoVote as exc:
        return f"the ranks' vote ended without every rank's: {exc}"
    except PublishError as exc:
        if not pub.config.keep_training_on_error:
            raise PublishError(f"the ranks' vote on publishing the newest step at close failed: {exc}") from exc
        log.error("hotload: the ranks' vote on publishing the newest step at close failed: %s", exc)
        return "the ranks' vote failed"


def objection(pub: Any, sources: object) -> str | None:
    """Why this rank may not publish the newest step at close, or None."""
    if isinstance(pub.agreements.failed, NoVote):
        return f"no vote can be taken: {pub.agreements.failed}"
    if pub.agreements.failed is not None:
        return "publishing stopped after the ranks' agreement failed"
    if pub._broken is not None:
        return "publishing stopped after a collective failed"
    if pub._halted is not None:
        return f"publishing stopped ({pub._halted})"
    if pub._errors.due(pub._staged) or pub._carried is not None:
        return "an earlier publish failed (raised by close)"
    if threading.get_ident() != pub._stepping_thread:
        # Which thread trains there, and whether it is mid-step, cannot be told from here: a snapshot copied now
        # could mix two steps. Optimizers stepped inside backward on CUDA run their hooks on autograd's device
        # thread, which Python did not start: say how to publish from the training thread instead.
        if isinstance(pub._stepper, getattr(threading, "_DummyThread", ())):
            return ("the steps were published from a thread Python did not start (autograd's device thread runs "
                    "optimizer hooks stepped inside backward on CUDA), and close() runs on another; call "
                    "hot.step(step) after backward() instead of attach() to publish from the training thread")
        return "close() runs on another thread than the training steps, whose weights may be changing"
    if pub._given_sources and sources is None:
        return "publish() was given its tensors, and close() was not given them again"
    return None
