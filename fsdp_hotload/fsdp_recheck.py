"""The ranks' comparison of their copies of tensors once training has started (:class:`RecheckReplicas`).

Why a module of its own: :func:`~fsdp_hotload.fsdp_verify.agree_on_chunks` compares the copies once, at
construction; this compares them again from the trainer's thread at its ``step()`` calls, for the whole job, and
has a gloo group of its own. Each comparison is one max-reduction of a fixed-size vector, so its cost does not
grow with the number of ranks: a second, small round names the ranks only where something differs.

Example::

    recheck = RecheckReplicas(agreed, walked, plain, storage_fingerprint(model), GlooComm.create(), every=20)
    if recheck.due():                                  # every rank, at each step() call
        why = recheck.run(model, chunk_kwargs, step)   # None, or why the copies differ (on every rank)
"""
from __future__ import annotations

import logging
import zlib
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .fsdp import LocalChunk, OwnershipError, local_chunks, storage_fingerprint
from .fsdp_verify import Agreed, _crcs, plain_samples

log = logging.getLogger("fsdp_hotload")

#: The most calls of the callback's ``step()`` at which :class:`RecheckReplicas` compares the copies at each call,
#: and the comparisons at which a tensor must have changed (each since the one before) to leave that first phase.
RECHECK_STEPS, SETTLE_CHANGES = 8, 3

_DRIFTED = ("copies that nothing keeps equal drift apart as they train, and only rank 0's would be published: "
            "partitions seeded alike (each rank's own experts, initialised from one seed) or a parameter that no "
            "wrapper syncs (a module left out of fully_shard, one FSDP1 ignores). Express a partition as DTensors "
            "(FSDP2 over a device mesh), wrap the module nothing syncs, or publish a gathered state dict from rank 0 "
            "with TensorPublisher")

_TOP = (1 << 32) - 1  # digests are CRC-32s: 0.._TOP, so -1 marks a slot this rank did not read


class RecheckReplicas:
    """The comparison of copies that :func:`~fsdp_hotload.fsdp_verify.agree_on_chunks` makes at construction, made
    again once training has changed them: at each ``step()`` until every compared tensor has changed at
    ``SETTLE_CHANGES`` comparisons (each since the one before) and still agrees, for at most ``RECHECK_STEPS``
    calls; then one comparison of every copy each ``every`` calls (the callback passes ``full_every`` x
    ``publish_every``: a full snapshot's span) for the rest of the job. Constructed on every rank at once where
    ``agreed.recheck`` (it checks that the ranks line their tensors up alike, collectively).

    Why: at construction, copies that start equal pass whether or not anything keeps them equal. Partitions
    seeded alike and a parameter that no wrapper syncs pass there, drift apart from the first optimizer step that
    changes them, and only rank 0's would be published. Not one fixed step: a first ``step()`` called before any
    optimizer step (to publish the initial weights), a warmup that starts at a learning rate of 0, or experts
    that get no tokens at first leave some tensors as they were, and equal copies then prove nothing. Nor one
    change: a first step can change every rank's copy alike (weight decay over a zero gradient, Adam's first
    update, about the learning rate times the gradient's sign). Nor only those first steps: a tensor can start to
    drift later (a module unfrozen after DistributedDataParallel was built, which then never syncs it; experts
    that get their first tokens after eight steps), so every copy is compared again at each full snapshot's
    span. Only chunks whose box another rank holds too, and plain tensors, are read (a few sampled elements and the
    sum of all their bits, or every byte of a small one); where no rank has any (FSDP2, HSDP), nothing is, and no
    collective runs. Plain parameters are read only while they train (``requires_grad`` on some rank): frozen, they
    stay as equal as construction found them, and a frozen base model under LoRA adapters is not read every time.
    The comparisons have a gloo group of their own (``comm``): the trainer's side group also carries close()'s vote,
    which another thread may take meanwhile.

    How: every compared tensor has a slot (its group of copies, then each plain path), the same on every rank
    (construction checks it, collectively: :meth:`_check_slots`). Each rank reduces, by maximum, its digests and
    their complements (``_TOP - digest``; -1 where it read none), and whether it trains each plain tensor, so
    every rank learns the largest and the smallest digest of each slot from one reduction of 24 bytes per slot,
    whatever the number of ranks, and decides alike what settled. Gathering each rank's digests to rank 0
    instead sent it ranks x slots entries, pickled with their paths (23 bytes each for short names in
    ``benchmarks/replica_compare.py``, more for real ones: 0.5-1.4 GB per comparison at 512 ranks and 40,000
    plain tensors).
    """

    def __init__(self, agreed: Agreed, chunks: Sequence[LocalChunk], plain: Mapping[str, torch.Tensor],
                 fingerprint: tuple[int, ...], comm: Any, every: int) -> None:
        self.left = RECHECK_STEPS if agreed.recheck else 0  # calls left in the first phase (one comparison each)
        self.every = every  # then, calls from one comparison to the next
        self.comm = comm
        self.made = 0  # comparisons made (each one collective over comm)
        self._wait = 0  # calls before the next comparison
        self._index = {g: i for i, g in agreed.shared}
        self._shared = {g: chunks[i].source for i, g in agreed.shared}  # every copy of a box, for the later phase
        self._all_plain = dict(plain)  # every plain tensor: one may train later (unfrozen)
        self._views, self._plain = dict(self._shared), dict(plain)  # those the first phase compares still
        self._groups = agreed.groups  # rank 0 only: (name, box) of each group, for the message
        self._ngroups = agreed.ngroups  # the groups' slots come first, then the plain paths'
        self._paths = sorted(plain)  # the same on every rank: checked below
        self._slot = {p: agreed.ngroups + j for j, p in enumerate(self._paths)}
        slots = agreed.ngroups + len(self._paths)
        self._prev = np.full(slots, -1, dtype=np.int64)  # each slot's digest at the last comparison that read it
        self._changes = np.zeros(slots, dtype=np.int64)  # comparisons at which it had changed since then
        self._trains = np.zeros(slots, dtype=bool)  # plain slots some rank trained at the last comparison
        self._layout = [(c.name, c.box) for c in chunks]  # only read where storage changed
        self._fingerprint = fingerprint
        if not self.left:
            self.finish()
        else:
            self._check_slots()

    def _check_slots(self) -> None:
        """Collective, at construction: raises OwnershipError on every rank where the ranks number their slots
        differently. Why: each comparison reduces one vector of a fixed layout, and ranks holding other plain
        parameters would reduce vectors of other lengths (gloo's reduction would then fail or hang) or line one
        tensor's digest up with another's."""
        crc = zlib.crc32("\0".join([str(self._ngroups), *self._paths]).encode())
        slots = len(self._prev)
        top = self.comm.allreduce_max(np.array([slots, -slots, crc, -crc], dtype=np.int64))
        if top[0] == -top[1] and top[2] == -top[3]:
            return
        gathered = self.comm.gather((slots, crc, self._paths))
        why = None
        if gathered is not None:
            r = next(r for r, (n, c, _p) in enumerate(gathered) if (n, c) != gathered[0][:2])
            odd = sorted(set(gathered[0][2]) ^ set(gathered[r][2]))[:3]
            why = (f"ranks 0 and {r} hold different plain parameters ({gathered[0][0]} and {gathered[r][0]} "
                   f"tensors to compare as copies{', e.g. ' + ', '.join(map(repr, odd)) if odd else ''}): every "
                   "rank must hold the same parameters outside DTensors and FSDP's")
        why = self.comm.broadcast(why)
        self.finish()
        raise OwnershipError(why)

    @property
    def active(self) -> bool:
        """Whether comparisons are still made (they end on a difference, on one that could not be made, or on
        close)."""
        return self.comm is not None

    def due(self) -> bool:
        """Counts one ``step()`` call: whether it compares. The same answer on every rank, as long as every rank
        calls ``step()`` alike, which the publisher's own collectives need too."""
        if self.comm is None:
            return False
        self._wait -= 1
        return self._wait < 0

    def finish(self, close: bool = True) -> None:
        """No more comparisons: the views are let go, and with ``close`` the group (its destruction is local).
        Why the views: they are the model's tensors, which a callback its owner still holds after close() must not
        keep alive once the model has let go of them."""
        self.left, self._views, self._plain, self._layout, self._shared, self._all_plain = 0, {}, {}, [], {}, {}
        comm, self.comm = self.comm, None
        if comm is not None and close:
            comm.close()

    def run(self, model: nn.Module, chunk_kwargs: Mapping[str, Any], step: int) -> str | None:
        """Collective over ``comm``: None where every copy still agrees, else why not, the same on every rank.

        A comparison that cannot be made (a rank fails to read its copies, or the collective fails) is logged
        and not made again: publishing goes on, as before the comparisons began, since ranks that saw the failure
        differently would otherwise stop apart."""
        settling, self.left = self.left > 0, max(self.left - 1, 0)
        problem: str | None = None
        slots = len(self._prev)
        mine = np.full(3 * slots + 1, -1, dtype=np.int64)  # digests, complements, trains, whether a read failed
        try:
            groups, plain, trains = self._read(model, chunk_kwargs, settling)
            for slot, digest in [*groups.items(), *((self._slot[p], d) for p, d in plain.items())]:
                mine[slot], mine[slots + slot] = digest, _TOP - digest
            mine[[2 * slots + self._slot[p] for p in trains]] = 1
        except Exception as exc:  # noqa: BLE001 - told: the other ranks must not wait for this rank alone
            problem = f"{type(exc).__name__}: {exc}"
            mine[:] = -1
            mine[-1] = 1
        self.made += 1
        try:
            if self.comm is None:
                raise RuntimeError("its group was destroyed")
            top = self.comm.allreduce_max(mine)
            high, low = top[:slots], _TOP - top[slots:2 * slots]
            self._trains = top[2 * slots:3 * slots] > 0  # read on every rank from the next comparison on
            read = high >= 0  # some rank read the slot
            differ = np.flatnonzero(read & (high != low))
            kind, why = "agree", None
            if top[-1] > 0 or differ.size:  # a second round names the ranks: only where something is off
                first = int(differ[0]) if differ.size else -1
                gathered = self.comm.gather((problem, int(mine[first]) if first >= 0 else -1))
                kind, why = self.comm.broadcast(None if gathered is None else self._why(gathered, differ, step))
        except Exception as exc:  # noqa: BLE001 - gloo's (a peer gone, a rank past the timeout), or closed meanwhile
            kind, why = "trouble", f"its collective failed: {exc!r}"
        if kind == "trouble":
            log.warning("hotload: the ranks' comparison of their copies of tensors at step %d could not be made, "
                        "and is not made again (publishing goes on): %s", step, why)
        elif kind == "agree":
            if not (settling and self._settle(read, high) and self.left > 0):
                # the first phase is over: every copy, once per span from now on
                self.left, self._wait = 0, self.every - 1
            return None
        self.finish()
        return why if kind == "differ" else None

    def _settle(self, read: np.ndarray, digests: np.ndarray) -> bool:
        """Counts the changes of the slots read (the same on every rank: from the reduced digests), lets go of
        those that settled, and says whether any slot read has not."""
        changed = read & (self._prev >= 0) & (self._prev != digests)
        self._changes += changed
        self._prev = np.where(read, digests, self._prev)
        settled = read & (self._changes >= SETTLE_CHANGES)
        for slot in np.flatnonzero(settled).tolist():
            if slot < self._ngroups:
                self._views.pop(slot, None)
            else:
                self._plain.pop(self._paths[slot - self._ngroups], None)
        return bool((read & ~settled).any())

    def _read(self, model: nn.Module, chunk_kwargs: Mapping[str, Any],
              settling: bool) -> tuple[dict[int, int], dict[str, int], list[str]]:
        """This rank's samples of the copies compared (in the first phase, those not settled), read again from
        a new walk where the model's storage changed (the views would read memory the model let go of), and the
        plain paths that train here. A plain tensor is read where it trains, or where any rank trained it at the
        last comparison: a copy frozen on rank 0 alone, and so never read there, would be published unseen."""
        fingerprint = storage_fingerprint(model)
        if fingerprint != self._fingerprint:
            held: dict[str, torch.Tensor] = {}
            walked = local_chunks(model, **chunk_kwargs, plain=held)
            if [(c.name, c.box) for c in walked] != self._layout or not set(self._all_plain) <= set(held):
                raise RuntimeError("the model's tensors or sharding changed since HotloadCallback was created")
            self._shared = {g: walked[self._index[g]].source for g in self._shared}
            self._all_plain, self._fingerprint = {p: held[p] for p in self._all_plain}, fingerprint
            self._views = {g: self._shared[g] for g in self._views}
            self._plain = {p: self._all_plain[p] for p in self._plain}
        views, plain = (self._views, self._plain) if settling else (self._shared, self._all_plain)
        trains = [p for p, t in plain.items() if t.requires_grad]
        read = {p: t for p, t in plain.items() if t.requires_grad or self._trains[self._slot[p]]}
        return _crcs(list(views.items()), whole=True), plain_samples(read, whole=True), trains

    def _why(self, gathered: Sequence[tuple[str | None, int]], differ: np.ndarray, step: int) -> tuple[str, str]:
        """On rank 0: ("trouble", why) where a rank could not read its copies, else ("differ", why), naming the
        first slot that differs and two ranks whose digests of it do (``gathered``: each rank's problem and
        digest of that slot, -1 where it read none)."""
        for r, (problem, _digest) in enumerate(gathered):
            if problem:
                return "trouble", f"rank {r} could not read its copies: {problem}"
        held = [(r, d) for r, (_p, d) in enumerate(gathered) if d >= 0]
        r0, d0 = held[0]
        r = next(r for r, d in held if d != d0)
        slot, groups = int(differ[0]), self._ngroups
        if slot < groups:
            name, box = self._groups[slot]
            return "differ", (f"ranks {r0} and {r} held the same part of tensor {name!r} ({box.to_json()}) alike "
                              f"when the callback was created and different values at step {step}: {_DRIFTED}")
        more = int((differ >= groups).sum()) - 1
        which = repr(self._paths[slot - groups]) + (f" and {more} more" if more else "")
        return "differ", (f"ranks {r0} and {r} held plain tensor {which} (neither a DTensor nor FSDP's: rank 0 "
                          f"alone publishes it) alike when the callback was created and different values at step "
                          f"{step}: {_DRIFTED}")
