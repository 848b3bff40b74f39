"""Chunks of a tensor: boxes in the full tensor, and the checks that they tile it exactly.

A chunk is the part of one tensor that one rank holds. It is described as a box (start and length per
dimension). FSDP flat-parameter slices and FSDP2 dim-0 shards are contiguous element ranges of the flattened
tensor, which are boxes over the shape ``(numel,)``: a tensor's chunk table says which space its boxes live in
(``flat`` or ``shape``). Inside a chunk, elements are in C order of the box.

Example::

    boxes = [Box((0,), (6,)), Box((6,), (4,))]          # two flat ranges of a 10-element tensor
    check_tiling(boxes, (10,))                            # raises FormatError if they overlap or leave gaps
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .dtypes import numel
from .errors import FormatError


@dataclass(frozen=True)
class Box:
    """Start and length per dimension of a box inside a tensor (or inside the flat ``(numel,)`` space)."""

    start: tuple[int, ...]
    length: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.start) != len(self.length):
            raise FormatError(f"box start {list(self.start)} and length {list(self.length)} differ in rank")

    @property
    def numel(self) -> int:
        return numel(self.length)

    @staticmethod
    def flat(offset: int, count: int) -> "Box":
        return Box((int(offset),), (int(count),))

    @staticmethod
    def whole(shape: Sequence[int]) -> "Box":
        return Box(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    def to_json(self) -> dict[str, list[int]]:
        return {"start": list(self.start), "length": list(self.length)}

    @staticmethod
    def from_json(obj: object) -> "Box":
        if not isinstance(obj, dict):
            raise FormatError("chunk box is not an object")
        start, length = obj.get("start"), obj.get("length")
        if not (isinstance(start, list) and isinstance(length, list)):
            raise FormatError("chunk box needs 'start' and 'length' lists")
        if not all(type(v) is int and v >= 0 for v in [*start, *length]):
            raise FormatError("chunk box entries must be non-negative integers")
        return Box(tuple(start), tuple(length))

    def run_offsets(self, space: Sequence[int]) -> tuple[np.ndarray, int]:
        """The box's contiguous runs of elements inside ``space``: each run's flat element offset (int64, in box C
        order) and the one element count they share. Trailing dimensions the box spans fully merge into one run.
        Arrays, not a generator: a box one column wide has a run per element, and a loop in Python over those
        (the checksum of a full snapshot, a delta's run tables) took ~1.6 us per run."""
        nd = len(space)
        if nd == 0:
            return np.zeros(1, dtype=np.int64), 1
        if self.numel == 0:
            return np.zeros(0, dtype=np.int64), 0
        k = nd - 1
        while k > 0 and self.start[k] == 0 and self.length[k] == space[k]:
            k -= 1
        strides = [numel(space[d + 1:]) for d in range(nd)]
        offs = np.full(1, sum(self.start[d] * strides[d] for d in range(k + 1)), dtype=np.int64)
        for d in range(k):  # outer dimensions, slowest first, so that the result is in box C order
            offs = (offs[:, None] + np.arange(self.length[d], dtype=np.int64) * strides[d]).reshape(-1)
        return offs, numel(self.length[k:])


def check_box_in(box: Box, space: Sequence[int]) -> None:
    if len(box.start) != len(space):
        raise FormatError(f"box of rank {len(box.start)} in a space of rank {len(space)}")
    for s, n, dim in zip(box.start, box.length, space):
        if s + n > dim:
            raise FormatError(f"box {box.to_json()} exceeds shape {list(space)}")


# Most integers the tiling check of a multi-dimensional chunk table may build (box corners times dimensions, or
# painted elements). Chunk tables are untrusted, so this bounds the check's memory and time; real tables stay far
# below it (a tensor split along two of its dimensions fits with up to a million chunks).
MAX_TILING_WORK = 1 << 23


def check_tiling(boxes: Sequence[Box], space: Sequence[int]) -> None:
    """Raise FormatError unless ``boxes`` cover ``space`` exactly once (no overlap, no gap).

    Every box must lie inside ``space`` and the boxes' element counts must add up to the space's; then they tile it
    exactly unless two non-empty boxes overlap. That last test is near-linear in the number of boxes (they come
    from an untrusted header): a sort when the boxes are split along one dimension only, else a corner count.
    """
    if len(boxes) == 1 and boxes[0].length == tuple(space) and not any(boxes[0].start):
        return  # one box that is the whole space: the common case (a tensor one rank holds), once per tensor
    total = numel(tuple(space))
    for b in boxes:
        check_box_in(b, space)
    sizes = [b.numel for b in boxes]
    if sum(sizes) != total:
        raise FormatError(f"chunks cover {sum(sizes)} elements of a {total}-element tensor")
    live = [b for b, n in zip(boxes, sizes) if n]
    # Dimensions that every non-empty box spans fully do not decide anything: leave them out.
    split = [k for k in range(len(space)) if any(b.start[k] or b.length[k] != space[k] for b in live)]
    if len(split) <= 1:
        if split:
            _check_slabs(live, split[0])
        return  # with no split dimension, the element count leaves room for one non-empty box only
    work = (len(live) << len(split)) * len(split)
    if work <= MAX_TILING_WORK:
        _check_corners(live, space, split)
    elif total <= MAX_TILING_WORK:
        _check_painted(live, space)
    else:
        raise FormatError(f"{len(live)} chunks split {len(split)} dimensions of a {total}-element tensor: the "
                          f"tiling check handles up to {MAX_TILING_WORK} box corners times dimensions "
                          f"({work} here) or elements")


def _overlap(a: Box, b: Box) -> FormatError:
    return FormatError(f"chunks {a.to_json()} and {b.to_json()} overlap")


def _check_slabs(live: list[Box], k: int) -> None:
    """Boxes that differ in dimension ``k`` only overlap when their ranges along ``k`` do."""
    live = sorted(live, key=lambda b: b.start[k])
    for a, b in zip(live, live[1:]):
        if a.start[k] + a.length[k] > b.start[k]:
            raise _overlap(a, b)


def _check_corners(live: list[Box], space: Sequence[int], split: list[int]) -> None:
    """Whether the boxes' indicator functions add up to the space's, by their signed corners.

    The indicator of a box is a signed sum of the orthants at its 2^d corners, and distinct orthants are linearly
    independent, so the boxes cover every element exactly once iff their corners, together with the space's with
    the opposite signs, cancel. Sorting the corners makes this O(n 2^d log n). Where they do not cancel, the
    first corner left over (in C order) is an element that is covered twice or not at all.
    """
    d = len(split)
    ext = [int(space[k]) for k in split]
    lo = [[b.start[k] for k in split] for b in live]
    hi = [[b.start[k] + b.length[k] for k in split] for b in live]
    values: list[list[int]] | None = None
    if max(ext) >= 2**62:  # a parseable but absurd shape: compare coordinates by rank, which keeps their order
        values = [sorted({0, ext[j], *(r[j] for r in lo), *(r[j] for r in hi)}) for j in range(d)]
        ranks = [{v: i for i, v in enumerate(vs)} for vs in values]
        lo = [[ranks[j][v] for j, v in enumerate(r)] for r in lo]
        hi = [[ranks[j][v] for j, v in enumerate(r)] for r in hi]
        ext = [ranks[j][v] for j, v in enumerate(ext)]
    lo_a = np.array(lo, dtype=np.int64).reshape(-1, d)
    hi_a = np.array(hi, dtype=np.int64).reshape(-1, d)
    pick = ((np.arange(1 << d)[:, None] >> np.arange(d)) & 1).astype(bool)  # (2^d, d): take hi in these dims
    sign = np.where(pick.sum(axis=1) % 2, -1, 1).astype(np.int64)
    corners = np.concatenate([np.where(pick, hi_a[:, None, :], lo_a[:, None, :]).reshape(-1, d),
                              np.where(pick, np.array(ext, dtype=np.int64), 0)])
    signs = np.concatenate([np.tile(sign, len(live)), -sign])
    order = np.lexsort(corners.T[::-1])
    corners, signs = corners[order], signs[order]
    first = np.ones(len(corners), dtype=bool)
    first[1:] = (corners[1:] != corners[:-1]).any(axis=1)
    heads = np.flatnonzero(first)
    left = np.flatnonzero(np.add.reduceat(signs, heads))
    if not left.size:
        return
    point = corners[heads[left[0]]]
    inside = np.flatnonzero(((lo_a <= point) & (point < hi_a)).all(axis=1))
    if inside.size >= 2:
        raise _overlap(live[inside[0]], live[inside[1]])
    where = [int(v) if values is None else values[j][int(v)] for j, v in enumerate(point)]
    full = [0] * len(space)
    for k, v in zip(split, where):
        full[k] = v
    raise FormatError(f"chunks overlap: they hold as many elements as the tensor but leave {full} uncovered")


def _check_painted(live: list[Box], space: Sequence[int]) -> None:
    """Mark each box's elements in a map of the tensor (for tables with many corners but few elements)."""
    seen = np.zeros(tuple(int(s) for s in space), dtype=bool)
    for i, b in enumerate(live):
        view = seen[tuple(slice(s, s + n) for s, n in zip(b.start, b.length))]
        if view.any():
            point = tuple(int(v) + s for v, s in zip(np.unravel_index(int(view.argmax()), view.shape), b.start))
            other = next(a for a in live[:i] if all(s <= p < s + n for s, n, p in zip(a.start, a.length, point)))
            raise _overlap(other, b)
        view[...] = True


def _box_view(full: np.ndarray, box: Box, space: Sequence[int], itemsize: int) -> np.ndarray:
    """``box`` as a strided view of a tensor's flat byte array (one axis per dimension, then the item's bytes).
    Why a view rather than a loop over the box's runs: a box one column wide has a run per element, and a loop
    in Python over those made rebuilding a tensor split into columns ~500x slower than over one box."""
    space = tuple(int(d) for d in space)
    if full.ndim != 1 or not full.flags.c_contiguous:  # else reshape copies, and a scatter would be lost
        raise ValueError("gather and scatter need a tensor's bytes as one flat contiguous array")
    if full.size != numel(space) * itemsize:
        raise FormatError(f"a {full.size}-byte array for a {list(space)} tensor of {itemsize}-byte items")
    check_box_in(box, space)
    return full.reshape(space + (itemsize,))[tuple(slice(s, s + n) for s, n in zip(box.start, box.length))]


def gather(full: np.ndarray, box: Box, space: Sequence[int], itemsize: int) -> np.ndarray:
    """The bytes of ``box`` out of a tensor's flat byte array, in box C order (a view when contiguous)."""
    view = _box_view(full, box, space, itemsize)
    return view.reshape(-1) if view.flags.c_contiguous else np.ascontiguousarray(view).reshape(-1)


def scatter(full: np.ndarray, chunk: np.ndarray, box: Box, space: Sequence[int], itemsize: int) -> None:
    """Write a chunk's bytes (box C order) into a tensor's flat byte array. A chunk of another length than its
    box is refused: numpy would broadcast a short one and cut a long one, publishing wrong weights in silence."""
    if chunk.size != box.numel * itemsize:
        raise FormatError(f"a chunk of {chunk.size} bytes for a box of {box.numel} elements of {itemsize} bytes")
    view = _box_view(full, box, space, itemsize)
    view[...] = chunk.reshape(view.shape)
