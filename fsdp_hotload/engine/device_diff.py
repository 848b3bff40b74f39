"""The diff of a slot against the cache on the slot's device: only the changed positions and values reach the host.

Why a module of its own: it is the one part of staging that runs on the publisher's thread for every delta on a
GPU trainer, and its memory (device temporaries per block, host arrays per diff) has rules of its own.

Example::

    arena = HostArena(pin=slot.is_cuda)
    diffs = device_diff(slot, cache, slices, arena=arena)   # one ElementDiff per slice, views of arena.buf
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..arc.codecs import ElementDiff
from ..arc.dtypes import UINT_BY_SIZE
from .copies import SIGNED, Slice

DIFF_BLOCK = 1 << 22  # elements per device-diff step (the device temporaries are ~13 bytes per element)
SHRINK_BELOW = 1 << 20  # a HostArena this large or smaller is never shrunk (bytes)
SHRINK_AFTER = 3  # diffs in a row needing under an eighth of a HostArena before it shrinks (no churn between sizes)
_NO_STATIC_NONZERO: set[str] = set()  # device types whose torch has no nonzero_static kernel (see _positions)


class HostArena:
    """Host bytes that :func:`device_diff` cuts its arrays from, kept from one diff to the next (pinned on CUDA).

    Why: torch's pinned-memory cache rounds each request up to a power of two, gives a freed block only to a later
    request of the same size class, and keeps every block it made. Three arrays per chunk and diff, whose sizes
    move with each publish's changes, left every class ever reached page-locked (1.7-2.8x the largest diff's need,
    in a simulation of those rules), and each new class cost a page-locking allocation on the publisher's thread.
    One buffer, grown to the next power of two when a diff needs more, holds less than twice the largest need; the
    smaller one it replaces goes back to the driver (the free blocks of torch's pinned cache are released then).
    It shrinks too, once three diffs in a row need under an eighth of it: one delta with half the values changed
    needs 6x the bf16 shard, which stayed page-locked for the rest of the job (``SHRINK_BELOW`` avoids reallocating
    for small needs). What is cut from it is valid until the next diff given this arena: the encoder is done with it
    by then.

    Example::

        arena = HostArena(pin=True)
        diffs = device_diff(slot, cache, slices, arena=arena)   # views of arena.buf
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buf: torch.Tensor | None = None
        self._small = 0  # consecutive takes that needed under an eighth of ``buf``

    def take(self, nbytes: int) -> torch.Tensor:
        """At least ``nbytes`` bytes (uint8), the same buffer as last time where it is large enough, unless this is
        the ``SHRINK_AFTER``-th take in a row that needs under an eighth of it (and under ``SHRINK_BELOW``)."""
        small = self.buf is not None and self.buf.numel() > 8 * max(nbytes, SHRINK_BELOW)
        self._small = self._small + 1 if small else 0
        if self.buf is None or self.buf.numel() < nbytes or self._small >= SHRINK_AFTER:
            self._small = 0
            self.buf = None
            if self.pin and hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()
            self.buf = torch.empty(1 << max(nbytes - 1, 0).bit_length(), dtype=torch.uint8, pin_memory=self.pin)
        return self.buf


def device_diff(new: torch.Tensor, old: torch.Tensor, slices: Sequence[Slice], block: int = DIFF_BLOCK,
                arena: HostArena | None = None) -> list[ElementDiff]:
    """Every chunk's changes between ``new`` (a slot's bytes, on its device) and ``old`` (the cache's bytes, on that
    device or in host memory): positions and old/new values, copied straight into host arrays (cut from ``arena``
    where given, else from one allocation of their own).

    Chunks whose slices follow each other with the same element size are diffed as one range, then cut apart on
    the host. Why: each block costs a handful of torch calls (~150 us on an H100, ~60 us on a CPU), so a split MoE
    model's thousands of small expert parts cost a block each: on a CPU, 6,144 parts of 8 Ki elements took 476 ms
    one by one against 119 ms as one range.
    """
    runs: list[list[int]] = []
    for i, s in enumerate(slices):
        last = slices[runs[-1][-1]] if runs else None
        if last is not None and s.itemsize == last.itemsize and s.offset == last.offset + last.nbytes:
            runs[-1].append(i)
        else:
            runs.append([i])
    ranges = [Slice(slices[r[0]].offset, sum(slices[i].nbytes for i in r), sum(slices[i].numel for i in r),
                    slices[r[0]].itemsize, slices[r[0]].torch_dtype) for r in runs]
    out: list[ElementDiff] = []
    for r, d in zip(runs, _range_diffs(new, old, ranges, block, arena)):
        if len(r) == 1:
            out.append(d)
            continue
        starts = np.cumsum([0] + [slices[i].numel for i in r])
        bounds = np.searchsorted(d.idx, starts)
        for k, i in enumerate(r):
            lo, hi = bounds[k], bounds[k + 1]
            out.append(ElementDiff(slices[i].numel, d.itemsize, d.idx[lo:hi] - starts[k], d.old[lo:hi], d.new[lo:hi]))
    return out


def _range_diffs(new: torch.Tensor, old: torch.Tensor, slices: Sequence[Slice], block: int,
                 arena: HostArena | None) -> list[ElementDiff]:
    """:func:`device_diff` of each of ``slices``, one range of elements each.

    Why two passes over each block of at most ``block`` elements: the first counts every block's changes and
    reads all the counts at once, so the host arrays are allocated once at their final size (pinned on CUDA:
    the copies into them are queued and run at the link's speed); the second finds the positions, gathers both
    values and copies them out. One pass instead left the host to shift, join and split the pieces: on an H100
    that made a 2 GB shard with 2% changed take 0.27 s instead of 0.04 (``benchmarks/RESULTS.md``). The device
    temporaries stay per block (a mask, the block's int64 positions, one gathered value array, and on a host
    cache the block brought over: at most ``block * (9 + 2 * itemsize)`` bytes) however many values changed;
    a host cache crosses to the device one block at a time, once per pass. The host arrays are cut from one
    buffer (:class:`HostArena`: 12 bytes per changed bf16 element, each array aligned to 8 bytes).
    """
    pieces = [(i, start, min(block, s.numel - start)) for i, s in enumerate(slices)
              for start in range(0, s.numel, block)]

    def pair(i: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = slices[i]
        kind = SIGNED[s.itemsize]
        a = new[s.offset:s.offset + s.nbytes].view(kind)[start:start + n]
        b = old[s.offset:s.offset + s.nbytes].view(kind)[start:start + n]
        return a, b.to(a.device, non_blocking=True)  # a pinned host cache: queued, in order

    counts = torch.stack([_count(torch.ne(*pair(*p))) for p in pieces]).tolist() if pieces else []
    per_chunk = [0] * len(slices)
    for (i, _, _), c in zip(pieces, counts):
        per_chunk[i] += c
    pin = new.device.type == "cuda"
    layout: list[tuple[int, int, torch.dtype]] = []  # (offset, bytes, dtype): positions, old, new of each slice
    total = 0
    for s, c in zip(slices, per_chunk):
        for nbytes, kind in ((c * 8, torch.int64), *((c * s.itemsize, SIGNED[s.itemsize]),) * 2):
            layout.append((total, nbytes, kind))
            total += nbytes + -nbytes % 8
    raw = (arena.take(total) if arena is not None and total else
           torch.empty(total, dtype=torch.uint8, pin_memory=pin and total > 0))
    cuts = [raw[o:o + n].view(kind) for o, n, kind in layout]
    host = [(cuts[k], cuts[k + 1], cuts[k + 2]) for k in range(0, len(cuts), 3)]
    filled = [0] * len(slices)

    def copy_out(i: int, start: int, n: int, c: int) -> None:
        # A function of its own, so each block's temporaries are freed when it returns, not held by loop
        # variables through the next block (which doubled the peak). Stream-ordered: the caching allocator gives
        # a freed temporary only to later work on this stream, which runs after the copy out of it.
        a, b = pair(i, start, n)
        pos = _positions(torch.ne(a, b), c)
        h_idx, h_old, h_new = host[i]
        at = filled[i]
        filled[i] += c
        h_old[at:at + c].copy_(b.index_select(0, pos), non_blocking=True)
        h_new[at:at + c].copy_(a.index_select(0, pos), non_blocking=True)
        if start:
            pos += start
        h_idx[at:at + c].copy_(pos, non_blocking=True)

    for (i, start, n), c in zip(pieces, counts):
        if c:
            copy_out(i, start, n, c)
    if pin:
        torch.cuda.current_stream(new.device).synchronize()
    return [ElementDiff(s.numel, s.itemsize, h_idx.numpy(), h_old.numpy().view(UINT_BY_SIZE[s.itemsize]),
                        h_new.numpy().view(UINT_BY_SIZE[s.itemsize])) for s, (h_idx, h_old, h_new) in zip(slices, host)]


def _count(mask: torch.Tensor) -> torch.Tensor:
    """How many elements of a bool mask are set, as a 0-d tensor, without the int64 copy of the mask that
    summing a bool tensor makes (8 bytes per element): rows of 128 are summed as uint8 first."""
    flat = mask.view(torch.uint8)
    bulk = flat.numel() // 128 * 128
    total = flat[:bulk].view(-1, 128).sum(1, dtype=torch.uint8).sum()
    return total + flat[bulk:].sum() if bulk < flat.numel() else total


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted int64 positions of the ``count`` set elements of ``mask``, without a host sync where torch has
    ``nonzero_static`` (its padding, never needed since the count was read from the same bytes, is position 0:
    a valid index, where -1 would fail on the device).

    Why the fallback: torch 2.4 and 2.5 define ``nonzero_static`` for the CPU only, and on a CUDA tensor it
    raises NotImplementedError; ``nonzero`` (one host sync per block) gives the same positions. The device type
    is remembered, so the missing kernel costs one failed call per process, not one per block."""
    kind = mask.device.type
    if kind not in _NO_STATIC_NONZERO and hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=count, fill_value=0).reshape(-1)
        except NotImplementedError:
            _NO_STATIC_NONZERO.add(kind)
    return torch.nonzero(mask).reshape(-1)
