"""One pass over a chunk's parent and new bytes: XOR blocks for a streaming codec, plus what the container needs.

Why: on the host, a delta used to take a diff pass (changed positions), a dense XOR rebuilt from them, a zstd pass
and a checksum update, each streaming the chunk through memory next to a training job that is itself
memory-bound. Here each block of a chunk is read once: XORed into a small reused buffer (it stays in cache for
the compressor), counted, and folded into the change of the tensor's Adler-32 shares, without materialising
changed positions at all. Pure numpy/numba; no torch.

Example::

    scan = DenseDelta(parent_bytes, new_bytes, 2, run_tables([(0, n)], 2), total=2 * n)
    payload = ArcV2().encode_xor_blocks(scan.blocks(), len(new_bytes))
    shares = add_parts(parent_shares, scan.parts_delta)   # adler.add_parts; == chunk_parts(new_bytes, ...)
    scan.changed                                          # changed elements
"""
from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import numpy as np

from .adler import MOD
from .boxes import Box
from .errors import FormatError
from .kernels import LANES, NO_SEQUENCES, NO_TABLE, scan_block

BLOCK_BYTES = 1 << 17  # two inputs and the XOR stay in a core's L2 next to the compressor's window


def run_tables(runs: Iterable[tuple[int, int]], itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """``(run_lstart, run_goff)`` in bytes for a chunk's element runs ``(tensor offset, count)`` in box order
    (``[(0, n)]`` for a chunk that is one contiguous run): where each run starts in the chunk and in the tensor.
    Compute once per chunk."""
    lstart, goff = [], []
    pos = 0
    for off, n in runs:
        lstart.append(pos)
        goff.append(int(off) * itemsize)
        pos += int(n) * itemsize
    if not lstart:
        lstart, goff = [0], [0]
    return np.asarray(lstart, dtype=np.int64), np.asarray(goff, dtype=np.int64)


def box_run_tables(box: Box, space: Sequence[int], itemsize: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`run_tables` of a chunk's box, built from :meth:`Box.run_offsets` without a loop in Python (a box
    one column wide has a run per element)."""
    offs, n = box.run_offsets(space)
    if not offs.size:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    return np.arange(offs.size, dtype=np.int64) * (n * itemsize), offs * itemsize


class DenseDelta:
    """The XOR of two equal-length byte chunks, block by block, with its changed count and Adler-32 delta.

    ``blocks()`` yields views of one reused buffer: consume each before asking for the next (a streaming
    compressor does). ``changed`` and ``parts_delta`` are complete once the iterator is exhausted.
    """

    def __init__(self, parent: np.ndarray, new: np.ndarray, itemsize: int, tables: tuple[np.ndarray, np.ndarray],
                 total: int, *, scratch: np.ndarray | None = None, block_bytes: int = BLOCK_BYTES) -> None:
        if parent.shape != new.shape or parent.dtype != np.uint8 or new.dtype != np.uint8 or parent.ndim != 1:
            raise FormatError("DenseDelta needs two flat uint8 arrays of equal length")
        if parent.size % itemsize or block_bytes % 8 or not 0 < block_bytes <= 1 << 20:
            raise FormatError(f"chunk of {parent.size} bytes, element size {itemsize}, block {block_bytes}")
        self.parent, self.new, self.itemsize = parent, new, itemsize
        self.run_lstart, self.run_goff = tables
        self.total = total
        self.block_bytes = block_bytes
        self.scratch = scratch if scratch is not None and scratch.size >= block_bytes else np.empty(
            min(block_bytes, max(parent.size, 8)), dtype=np.uint8)
        self.changed = 0
        self.parts_delta = (0, 0)

    def blocks(self) -> Iterator[memoryview]:
        n, step = self.parent.size, self.block_bytes
        da = db = 0
        r = 0
        for s in range(0, n, step):
            e = min(n, s + step)
            out = self.scratch[:e - s]
            _, changed, a, b, r = scan_block(self.parent[s:e], self.new[s:e], out, s, self.run_lstart, self.run_goff,
                                             r, self.total, self.itemsize, LANES[self.itemsize], NO_SEQUENCES, 0,
                                             NO_TABLE)
            self.changed += int(changed)
            da, db = (da + int(a)) % MOD, (db + int(b)) % MOD
            yield out.data
        self.parts_delta = (da, db)
