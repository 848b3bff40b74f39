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
from typing import Iterator, Sequence

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

    def runs(self, space: Sequence[int]) -> Iterator[tuple[int, int]]:
        """Contiguous element runs ``(flat_offset, count)`` of this box inside ``space``, in box C order."""
        nd = len(space)
        if nd == 0:
            yield (0, 1)
            return
        if self.numel == 0:
            return
        # Merge trailing dimensions that the box covers fully: they form one contiguous run.
        k = nd - 1
        while k > 0 and self.start[k] == 0 and self.length[k] == space[k]:
            k -= 1
        run = numel(self.length[k:])
        strides = [numel(space[d + 1:]) for d in range(nd)]
        outer = self.length[:k]
        for idx in np.ndindex(*outer) if outer else [()]:
            off = sum((self.start[d] + idx[d]) * strides[d] for d in range(k))
            off += self.start[k] * strides[k]
            yield (off, run)


def check_box_in(box: Box, space: Sequence[int]) -> None:
    if len(box.start) != len(space):
        raise FormatError(f"box of rank {len(box.start)} in a space of rank {len(space)}")
    for s, n, dim in zip(box.start, box.length, space):
        if s + n > dim:
            raise FormatError(f"box {box.to_json()} exceeds shape {list(space)}")


def check_tiling(boxes: Sequence[Box], space: Sequence[int]) -> None:
    """Raise FormatError unless ``boxes`` cover ``space`` exactly once (no overlap, no gap)."""
    total = numel(tuple(space))
    for b in boxes:
        check_box_in(b, space)
    if sum(b.numel for b in boxes) != total:
        raise FormatError(f"chunks cover {sum(b.numel for b in boxes)} elements of a {total}-element tensor")
    live = [b for b in boxes if b.numel]
    if len(space) == 1:
        live.sort(key=lambda b: b.start[0])
        for a, b in zip(live, live[1:]):
            if a.start[0] + a.length[0] > b.start[0]:
                raise FormatError(f"chunks {a.to_json()} and {b.to_json()} overlap")
        return
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            if all(sa < sb + nb and sb < sa + na for sa, na, sb, nb in zip(a.start, a.length, b.start, b.length)):
                raise FormatError(f"chunks {a.to_json()} and {b.to_json()} overlap")


def gather(full: np.ndarray, box: Box, space: Sequence[int], itemsize: int) -> np.ndarray:
    """The bytes of ``box`` out of a tensor's flat byte array, in box C order (a view when contiguous)."""
    runs = list(box.runs(space))
    if len(runs) == 1:
        off, n = runs[0]
        return full[off * itemsize:(off + n) * itemsize]
    out = np.empty(box.numel * itemsize, dtype=np.uint8)
    pos = 0
    for off, n in runs:
        out[pos:pos + n * itemsize] = full[off * itemsize:(off + n) * itemsize]
        pos += n * itemsize
    return out


def scatter(full: np.ndarray, chunk: np.ndarray, box: Box, space: Sequence[int], itemsize: int) -> None:
    """Write a chunk's bytes (box C order) into a tensor's flat byte array."""
    pos = 0
    for off, n in box.runs(space):
        full[off * itemsize:(off + n) * itemsize] = chunk[pos:pos + n * itemsize]
        pos += n * itemsize
