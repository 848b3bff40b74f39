"""Slab arithmetic (fsdp_hotload/slab.py) against numpy indexing, exhaustively on small shapes: which element ranges
are slabs, and where a slab's elements lie in a box of the tensor, as a part's box and as a run of the box's data."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.slab import Slab, permute_box, range_boxes

SHAPES = [(6,), (3, 4), (2, 3, 4), (3, 1, 2, 2), (1, 5)]


def all_slabs(shape: tuple[int, ...]) -> set[tuple[int, int]]:
    """Every (start, count) range that is a slab, by enumerating slabs and reading their flat positions."""
    full = np.arange(math.prod(shape)).reshape(shape)
    out = set()
    for dim in range(len(shape)):
        for index in itertools.product(*(range(s) for s in shape[:dim])):
            for lo in range(shape[dim]):
                for hi in range(lo + 1, shape[dim] + 1):
                    flat = full[index + (slice(lo, hi),)].reshape(-1)
                    out.add((int(flat[0]), int(flat.size)))
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_of_finds_exactly_the_slabs(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    full = np.arange(n).reshape(shape)
    slabs = all_slabs(shape)
    for start in range(n):
        for count in range(1, n - start + 1):
            slab = Slab.of(shape, start, count)
            assert (slab is not None) is ((start, count) in slabs), (shape, start, count)
            if slab is not None:  # its description covers exactly those elements
                got = full[slab.index + (slice(slab.lo, slab.hi),)].reshape(-1)
                assert np.array_equal(got, np.arange(start, start + count))
    assert Slab.of(shape, 0, 0) is None and Slab.of(shape, n - 1, 2) is None


def boxes(shape: tuple[int, ...]) -> list[Box]:
    ranges = [[(a, b - a) for a in range(s) for b in range(a + 1, s + 1)] for s in shape]
    return [Box(tuple(r[0] for r in rs), tuple(r[1] for r in rs)) for rs in itertools.product(*ranges)]


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 4), (3, 1, 2, 2)])
def test_cut_gives_the_parts_box_and_one_run_of_the_local_data(shape: tuple[int, ...]) -> None:
    """For every slab, every part shape it fits (with and without leading 1s) and every box a rank could hold:
    the elements the cut names in the local data are the part's elements in the part's box, in C order."""
    full = np.arange(math.prod(shape)).reshape(shape)
    checked = 0
    for start, count in sorted(all_slabs(shape)):
        slab = Slab.of(shape, start, count)
        assert slab is not None
        squeezed = slab.slab_shape[next((i for i, s in enumerate(slab.slab_shape) if s != 1), len(shape)):]
        for part_shape in {squeezed, (1, *squeezed), slab.slab_shape}:
            assert slab.fits(part_shape)
            part = full.reshape(-1)[start:start + count].reshape(part_shape)
            for box in boxes(shape):
                local = full[tuple(slice(a, a + n) for a, n in zip(box.start, box.length))].reshape(-1)
                held = {int(v) for v in local} & {int(v) for v in part.reshape(-1)}
                cut = slab.cut(box, part_shape)
                if not held:
                    assert cut is None
                    continue
                assert cut is not None
                part_box, offset, n = cut
                want = part[tuple(slice(a, a + k) for a, k in zip(part_box.start, part_box.length))].reshape(-1)
                assert np.array_equal(local[offset:offset + n], want) and set(want.tolist()) == held
                checked += 1
    assert checked > 100


def test_a_part_in_another_layout_does_not_fit() -> None:
    slab = Slab.of((3, 8, 4), 48, 16)  # expert 1, rows 4..7
    assert slab is not None and (slab.dim, slab.index, slab.lo, slab.hi) == (1, (1,), 4, 8)
    assert slab.fits((4, 4)) and slab.fits((1, 4, 4)) and slab.fits((1, 1, 4, 4))
    assert not slab.fits((16,)) and not slab.fits((4, 2, 2)) and not slab.fits((2, 8))


@pytest.mark.parametrize("shape", SHAPES + [(2, 2, 2, 3)])
def test_range_boxes_cover_every_range_in_order_with_few_boxes(shape: tuple[int, ...]) -> None:
    """Every range of every shape: the boxes hold exactly its elements, in order, each box's run at its offset."""
    n = math.prod(shape)
    full = np.arange(n).reshape(shape)
    for start in range(n):
        for count in range(1, n - start + 1):
            boxes = range_boxes(shape, start, count)
            assert len(boxes) <= 2 * len(shape) - 1, (shape, start, count, boxes)
            pos = 0
            for box, offset, k in boxes:
                got = full[tuple(slice(a, a + m) for a, m in zip(box.start, box.length))].reshape(-1)
                assert offset == pos and k == box.numel == got.size
                assert np.array_equal(got, np.arange(start + pos, start + pos + k)), (shape, start, count, box)
                pos += k
            assert pos == count
    assert range_boxes(shape, 0, 0) == []


def test_a_permuted_box_holds_the_permuted_tensors_elements() -> None:
    full = np.arange(60).reshape(3, 4, 5)
    box = Box((1, 0, 2), (2, 3, 2))
    for dims in itertools.permutations(range(3)):
        moved = permute_box(box, dims)
        want = full[1:3, 0:3, 2:4].transpose(dims).reshape(-1)
        got = full.transpose(dims)[tuple(slice(a, a + m) for a, m in zip(moved.start, moved.length))].reshape(-1)
        assert np.array_equal(got, want), dims


def test_an_empty_box_holds_no_part_even_where_its_empty_dim_has_size_one() -> None:
    """A box of length 0 on a dim of size 1 after the slab's dim was cut into a non-empty part box with a run of 0
    elements: that dim was squeezed away with its zero."""
    slab = Slab.of((2, 1), 0, 1)
    assert slab is not None
    assert slab.cut(Box((0, 1), (1, 0)), (1, 1)) is None
    assert slab.cut(Box((0, 0), (1, 1)), (1, 1)) is not None
