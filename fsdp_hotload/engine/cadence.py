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

from dataclasses import dataclass
from typing import Literal

Kind = Literal["full", "delta"]


@dataclass
class Cadence:
    full_every: int = 20
    max_chain_length: int | None = None
    accepted: str | None = None  # identity of the last snapshot every deployment serves
    deltas_since_full: int = 0
    force_full: bool = True

    def next_kind(self) -> Kind:
        if self.force_full or self.accepted is None:
            return "full"
        if self.deltas_since_full + 1 >= self.full_every:
            return "full"
        if self.max_chain_length is not None and self.deltas_since_full >= self.max_chain_length:
            return "full"
        return "delta"

    def on_success(self, identity: str, kind: Kind) -> None:
        self.accepted = identity
        self.force_full = False
        self.deltas_since_full = 0 if kind == "full" else self.deltas_since_full + 1

    def on_failure(self) -> None:
        self.force_full = True
