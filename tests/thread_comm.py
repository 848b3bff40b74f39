"""Ranks as threads of one process, for engine tests that need several ranks and control over their timing.

A :class:`ThreadComm` has the engine's ``Comm`` interface; every collective meets at a :class:`Meeting` shared by
the ranks' comms of one group. ``outcome_delay_s`` makes one rank receive a failed snapshot's outcome late, the
network or scheduling jitter that real ranks see, which torchrun jobs cannot produce on demand.

Example::

    meeting = Meeting(world=2)
    comms = [ThreadComm(meeting, rank, 2) for rank in range(2)]
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence


def run_ranks(target: Callable[[int], Any], world: int, timeout_s: float = 60.0) -> None:
    """Run ``target(rank)`` on one thread per rank and wait for all of them; a rank still running is a hang, and
    a rank that raised fails the caller with the lowest such rank's exception.

    Why: an exception on a plain thread only reaches ``threading.excepthook`` (pytest turns it into a warning),
    so an assert inside a rank's body could never fail the test. A test that expects a rank to raise catches
    the exception inside ``target`` and checks it afterwards."""
    raised: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            target(rank)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread below
            raised[rank] = exc

    ranks = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout_s)
    hung = [r for r, t in enumerate(ranks) if t.is_alive()]
    first = min(raised) if raised else None
    if hung:
        why = f"; rank {first} raised {raised[first]!r}" if first is not None else ""
        raise AssertionError(f"a rank hung: rank(s) {hung} still running after {timeout_s:g} s{why}") from (
            raised[first] if first is not None else None)
    if first is not None:
        raise AssertionError(f"rank {first} raised {raised[first]!r}") from raised[first]


class Meeting:
    """Where the ranks of one group exchange values, collective by collective (numbered per rank)."""

    def __init__(self, world: int, timeout_s: float = 60.0) -> None:
        self.world, self.timeout_s = world, timeout_s
        self._cond = threading.Condition()
        self._values: dict[int, dict[int, Any]] = {}
        self.notes: dict[str, str] = {}  # the job's key-value store (Comm.note)
        self.lock = threading.Lock()  # the store's atomic operations (Comm.count, Comm.settle)

    def put(self, n: int, rank: int, value: Any) -> None:
        with self._cond:
            self._values.setdefault(n, {})[rank] = value
            self._cond.notify_all()

    def get(self, n: int, timeout: float | None = None) -> dict[int, Any]:
        """Every rank's value of collective ``n``; TimeoutError after ``timeout`` s, RuntimeError (as gloo's own
        timeout) after the group's ``timeout_s`` when none is given."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._values.get(n, {})) == self.world,
                                       self.timeout_s if timeout is None else timeout):
                arrived = sorted(self._values.get(n, {}))
                if timeout is not None:
                    raise TimeoutError(f"collective {n}: only ranks {arrived} arrived within {timeout:g} s")
                raise RuntimeError(f"collective {n}: only ranks {arrived} arrived (the group's timeout)")
            return dict(self._values[n])


class ThreadComm:
    def __init__(self, meeting: Meeting, rank: int, world: int, *, outcome_delay_s: float = 0.0) -> None:
        self.meeting, self.rank, self.world, self.outcome_delay_s = meeting, rank, world, outcome_delay_s
        self._n = 0

    def _meet(self, value: Any) -> dict[int, Any]:
        self._n += 1
        self.meeting.put(self._n, self.rank, value)
        return self.meeting.get(self._n)

    def exchange(self, outgoing: Sequence[Any]) -> list[Any]:
        values = self._meet(list(outgoing))
        return [values[src][self.rank] for src in range(self.world)]

    def gather(self, obj: Any) -> list[Any] | None:
        values = self._meet(obj)
        return [values[r] for r in range(self.world)] if self.rank == 0 else None

    def broadcast(self, obj: Any) -> Any:
        value = self._meet(obj)[0]
        if getattr(value, "ok", True) is False:
            time.sleep(self.outcome_delay_s)
        return value

    def allreduce_max_async(self, value: int) -> Callable[..., int]:
        self._n += 1
        n = self._n
        self.meeting.put(n, self.rank, value)
        return lambda timeout=None: max(self.meeting.get(n, timeout).values())

    def allreduce_max(self, values: Any) -> Any:
        import numpy as np

        self._n += 1
        n = self._n
        self.meeting.put(n, self.rank, values)
        return np.maximum.reduce(list(self.meeting.get(n).values()))

    def note(self, key: str, value: str, *, at_exit: bool = False) -> None:
        self.meeting.notes[key] = value

    def noted(self, key: str) -> str | None:
        return self.meeting.notes.get(key)

    def count(self, key: str, n: int) -> int:
        with self.meeting.lock:
            total = int(self.meeting.notes.get(key, 0)) + n
            self.meeting.notes[key] = str(total)
            return total

    def settle(self, key: str, value: str) -> str:
        with self.meeting.lock:
            return self.meeting.notes.setdefault(key, value)

    def close(self) -> None:
        pass
