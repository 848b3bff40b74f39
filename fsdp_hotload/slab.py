"""Where a split's part lies in a tensor sharded along a dimension other than 0.

A split part (``naming.Split``) is a contiguous range of its tensor's flattened elements. A rank that holds a
dim-0 shard holds a range of those elements too, so its part of the part is a range. A rank that holds a box of
the tensor instead (tensor parallelism; FSDP2's ``Shard(1)`` or ``Shard(2)`` for fused experts, as torchtitan
shards experts when there are fewer of them than data-parallel ranks) needs more: its elements of the part form a
box of the part only when the part's range is a *slab*, with fixed indices on the leading dimensions, a range on
one dimension and every later dimension whole (one expert of a fused ``[experts, rows, cols]`` tensor, or the
gate half of its rows). The rank's elements of a slab are then one contiguous run of its local shard as well, so
the part's chunk stays a view of the shard: nothing is copied to publish it.

A part may also be published with its dims in another order (a checkpoint that stores a tensor transposed):
:func:`range_boxes` cuts a rank's range of it into boxes and :func:`permute_box` moves each box into the
published order, whose elements the rank's data, viewed as the box and permuted, gives in C order.

Pure shape arithmetic, the same answer on every rank.

Example::

    slab = Slab.of((3, 8, 4), start=1 * 32 + 16, count=16)   # expert 1, rows 4..7 (the "up" half)
    slab.fits((4, 4))                                        # True: the part is those rows
    slab.cut(Box((0, 0, 2), (3, 8, 2)), (4, 4))              # this rank holds columns 2..3 of every row
    # -> (Box((0, 2), (4, 2)), 24, 8): the part's box, and where its 8 elements are in the local shard
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .arc.boxes import Box


@dataclass(frozen=True)
class Slab:
    """Elements ``index + (lo..hi-1,) + (every index of the later dims)`` of a tensor of ``shape``."""

    shape: tuple[int, ...]
    dim: int
    index: tuple[int, ...]  # fixed indices of the dims before ``dim``
    lo: int
    hi: int

    @staticmethod
    def of(shape: Sequence[int], start: int, count: int) -> "Slab | None":
        """The slab that elements ``[start, start + count)`` of a C-ordered tensor of ``shape`` are, or None."""
        shape = tuple(int(s) for s in shape)
        if count <= 0 or start < 0 or start + count > math.prod(shape):
            return None
        for dim in range(len(shape)):
            inner = math.prod(shape[dim + 1:])
            outer = inner * shape[dim]
            if start % inner or count % inner or start // outer != (start + count - 1) // outer:
                continue
            index, rest = [], start // outer
            for size in reversed(shape[:dim]):
                rest, i = divmod(rest, size)
                index.append(i)
            lo = start % outer // inner
            return Slab(shape, dim, tuple(reversed(index)), lo, lo + count // inner)
        return None

    @property
    def slab_shape(self) -> tuple[int, ...]:
        return (1,) * self.dim + (self.hi - self.lo,) + self.shape[self.dim + 1:]

    def fits(self, part_shape: Sequence[int]) -> bool:
        """Whether a part of ``part_shape`` is this slab's elements in the slab's own layout (leading dims of
        size 1 aside), so that a box of the slab is a box of the part."""
        return _squeeze(self.slab_shape) == _squeeze(tuple(part_shape))

    def cut(self, box: Box, part_shape: Sequence[int]) -> tuple[Box, int, int] | None:
        """This slab's elements within ``box`` (a box of the whole tensor, as a rank holds it): their box in the
        part (``part_shape``, which :meth:`fits`), and their ``(offset, count)`` in the box's C order, one run.
        None when the box holds none of them."""
        k = self.dim
        if 0 in box.length:  # an empty box (its zero on a dim of size 1 would be squeezed away below)
            return None
        for d in range(k):
            if not box.start[d] <= self.index[d] < box.start[d] + box.length[d]:
                return None
        a, b = max(box.start[k], self.lo), min(box.start[k] + box.length[k], self.hi)
        if a >= b:
            return None
        strides = [math.prod(box.length[d + 1:]) for d in range(len(self.shape))]
        offset = sum((self.index[d] - box.start[d]) * strides[d] for d in range(k)) + (a - box.start[k]) * strides[k]
        starts = (0,) * k + (a - self.lo,) + box.start[k + 1:]
        lengths = (1,) * k + (b - a,) + box.length[k + 1:]
        kept = len(_squeeze(self.slab_shape))  # trailing dims that the part shares with the slab
        extra = len(part_shape) - kept  # the part's own leading dims of size 1
        cut = slice(len(starts) - kept, None)
        return Box((0,) * extra + starts[cut], (1,) * extra + lengths[cut]), offset, (b - a) * strides[k]


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` without its leading dims of size 1."""
    i = 0
    while i < len(shape) and shape[i] == 1:
        i += 1
    return shape[i:]


def range_boxes(shape: Sequence[int], start: int, count: int) -> list[tuple[Box, int, int]]:
    """Elements ``[start, start + count)`` of a C-ordered tensor of ``shape`` as boxes of it, in order, each with
    the ``(offset, count)`` of its elements within the range: a partial first row, whole rows, a partial last row
    (recursively), so at most two boxes per dimension."""
    shape = tuple(int(d) for d in shape)
    if count <= 0:
        return []
    if len(shape) <= 1:
        return [(Box(tuple(start for _ in shape), tuple(count for _ in shape)), 0, count)]
    row = math.prod(shape[1:])
    out: list[tuple[Box, int, int]] = []
    r, c = divmod(start, row)
    done = 0
    if c:  # the end of row r
        n = min(count, row - c)
        out += [(_row(r, b), o, k) for b, o, k in range_boxes(shape[1:], c, n)]
        done, r = n, r + 1
    whole = (count - done) // row
    if whole:
        out.append((Box((r,) + (0,) * (len(shape) - 1), (whole,) + shape[1:]), done, whole * row))
        done, r = done + whole * row, r + whole
    if count > done:  # the start of row r
        out += [(_row(r, b), done + o, k) for b, o, k in range_boxes(shape[1:], 0, count - done)]
    return out


def _row(r: int, box: Box) -> Box:
    return Box((r, *box.start), (1, *box.length))


def permute_box(box: Box, dims: Sequence[int]) -> Box:
    """``box`` in the tensor whose dim ``j`` is this one's dim ``dims[j]`` (``tensor.permute(dims)``)."""
    return Box(tuple(box.start[d] for d in dims), tuple(box.length[d] for d in dims))
