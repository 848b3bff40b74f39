"""Cadence: which kind of snapshot the next publish is.

Full at the first publish (a restarted trainer has no cache, so it starts here too), every ``full_every``
publishes, after ``max_chain_length`` deltas, and after any failure: a delta is only ever made against the
snapshot every deployment accepted last, so any doubt about that base means a full snapshot.

Example::

    c = Cadence(full_every=10)
    c.next_kind()                      # "full"
    c.on_success("step-1", "full"); c.next_kind()   # "delta", parent "step-1"
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["full", "delta"]


@dataclass
class Cadence:
    full_every: int = 20
    max_chain_length: int | None = None
    accepted: str | None = None  # identity of the last snapshot every deployment serves
    deltas_since_full: int = 0
    force_full: bool = True
    # deployments that do not serve ``accepted`` (deployments_required="any"): the final snapshot is full for
    # those of them that were not catching up (the others take it through their catch-up)
    behind: tuple[str, ...] = ()
    catching_up: tuple[str, ...] = ()

    def next_kind(self) -> Kind:
        if self.force_full or self.accepted is None:
            return "full"
        if self.deltas_since_full + 1 >= self.full_every:
            return "full"
        if self.max_chain_length is not None and self.deltas_since_full >= self.max_chain_length:
            return "full"
        return "delta"

    def on_success(self, identity: str, kind: Kind, metrics: Any = None) -> None:
        """``metrics``: the snapshot's PublishMetrics (who does not serve it), or None."""
        self.accepted = identity
        self.behind = tuple(getattr(metrics, "deployments_behind", ()))
        self.catching_up = tuple(getattr(metrics, "deployments_catching_up", ()))
        self.force_full = False
        self.deltas_since_full = 0 if kind == "full" else self.deltas_since_full + 1

    def on_failure(self) -> None:
        self.force_full = True


def next_step(given: object, latest: int, *, attached: bool = False, owner: str = "HotloadCallback") -> int:
    """``given`` as the trainer's next step, after ``latest``: any integer type (numpy's too), not a bool or a
    float, and larger than ``latest``, since steps name the snapshots (a step seen twice would overwrite one).
    ``attached``: the optimizer hooks of ``HotloadCallback.attach()`` publish steps too, so a step that does not
    follow most likely repeats one they published, and the error says to use one of the two. ``owner``: the class
    the caller made, which a lower step needs a new one of (a TensorPublisher user was told of HotloadCallback)."""
    try:
        # a bool is not a step, nor a bool tensor (which operator.index takes as 0 or 1)
        boolean = isinstance(given, bool) or str(getattr(given, "dtype", "")) in ("torch.bool", "bool")
        step = operator.index(given) if not boolean else -1  # type: ignore[arg-type]
    except TypeError:
        step = -1
    if step < 0:
        raise ValueError(f"step must be a non-negative integer, got {given!r}")
    if step <= latest:
        advice = ("attach()'s hooks already publish at every optimizer.step(): use one of attach() or step(), "
                  "not both" if attached else "pass a global step counter, not the step within an epoch")
        back = f"; to go back to an older step, create a new {owner}" if step < latest else ""
        raise ValueError(f"step {step} does not follow step {latest}: steps must increase, since they name the "
                         f"snapshots (a step seen twice would overwrite a published one); {advice}{back}")
    return step
