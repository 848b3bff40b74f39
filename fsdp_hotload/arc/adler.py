"""Adler-32 of a tensor from its chunks, and from sparse changes alone.

Adler-32 over bytes ``x_0..x_{N-1}`` is ``A = 1 + sum(x)`` and ``B = N + sum((N - p) * x_p)`` (mod 65521), so
both sums are linear in the bytes with weights that depend only on the global byte position. A chunk can
therefore compute its share ``(a, b)`` of a tensor's sums wherever its bytes sit (even a column box), shares
add up across ranks, and a chunk whose bytes changed at a few positions updates its share from those positions
alone, without a second pass over the data.

Example::

    parts = chunk_parts(chunk_bytes, box, space, itemsize, total_bytes)
    checksum = combine([parts, other_rank_parts], total_bytes)   # == zlib.adler32(full tensor bytes)
"""
from __future__ import annotations

import zlib
from typing import Any, Iterable, Sequence

import numpy as np
from numba import njit

from .boxes import Box

MOD = 65521


def segment_parts(seg: Any, offset: int, total: int) -> tuple[int, int]:
    """Shares ``(a, b)`` of a contiguous byte segment at byte ``offset`` of a ``total``-byte tensor."""
    length = len(seg) if not isinstance(seg, np.ndarray) else int(seg.size)
    ad = zlib.adler32(seg) & 0xFFFFFFFF
    s_a, s_b = (ad & 0xFFFF), (ad >> 16)
    total_sum = (s_a - 1) % MOD
    # zlib's B = L + sum((L - j) x_j); ours needs sum((total - offset - j) x_j).
    weighted = (s_b - length) % MOD
    b = (weighted + ((total - offset - length) % MOD) * total_sum) % MOD
    return total_sum, b


def chunk_parts(chunk: Any, box: Box, space: Sequence[int], itemsize: int, total: int) -> tuple[int, int]:
    """Shares of a chunk given as its bytes in box C order."""
    offs, n = box.run_offsets(space)
    data = (chunk if isinstance(chunk, np.ndarray) else np.frombuffer(chunk, dtype=np.uint8)).reshape(-1).view(np.uint8)
    if data.size != offs.size * n * itemsize:
        raise ValueError(f"a {data.size}-byte chunk for a box of {offs.size * n * itemsize} bytes")
    if data.size == 0:
        return 0, 0
    a, b = _runs_parts(data, offs * itemsize, n * itemsize, total % MOD)
    return int(a), int(b)


_SUM_BLOCK = 1 << 16  # bytes summed before a reduction: sum(j * x) < 2**16 * 2**16 * 2**8 stays exact in int64


@njit(nogil=True, cache=True, inline="always")
def _block_sums(blk: np.ndarray) -> tuple[int, int]:
    s = np.int64(0)
    w = np.int64(0)
    for j in range(blk.size):
        x = np.int64(blk[j])
        s += x
        w += j * x
    return s, w


@njit(nogil=True, cache=True)
def _runs_parts(data: np.ndarray, goff: np.ndarray, run: int, total: int) -> tuple[int, int]:
    # A byte x at tensor byte position g weighs (total - g) in B: over a block of bytes j = 0..m-1 starting at g0,
    # that is (total - g0) * sum(x) - sum(j * x). One pass, whatever the runs' length: a box one column wide has a
    # run per element, and a call to zlib per run (~1.6 us each in Python) made its checksum ~100x slower; on long
    # runs this loop (~5 GB/s on one core of the 2-vCPU VM) is not slower than zlib's either.
    a = np.int64(0)
    b = np.int64(0)
    pos = 0
    for r in range(goff.size):
        for start in range(0, run, _SUM_BLOCK):
            m = min(_SUM_BLOCK, run - start)
            s, w = _block_sums(data[pos:pos + m])
            pos += m
            s %= MOD
            a = (a + s) % MOD
            b = (b + ((total - goff[r] - start) % MOD) * s - w % MOD) % MOD
    return a, b


def add_parts(parts: tuple[int, int], delta: tuple[int, int]) -> tuple[int, int]:
    """Shares after a change whose own share delta is ``delta`` (e.g. ``DenseDelta.parts_delta``)."""
    return (parts[0] + delta[0]) % MOD, (parts[1] + delta[1]) % MOD


def combine(parts: Iterable[tuple[int, int]], total: int) -> int:
    """Adler-32 of a ``total``-byte tensor from the shares of chunks that tile it."""
    a = b = 0
    for pa, pb in parts:
        a, b = (a + pa) % MOD, (b + pb) % MOD
    return ((((b + total) % MOD) << 16) | ((a + 1) % MOD)) & 0xFFFFFFFF


def global_elements(idx: np.ndarray, box: Box, space: Sequence[int]) -> np.ndarray:
    """Map element positions inside a box (C order) to flat element positions in ``space``."""
    if len(space) <= 1:
        start = box.start[0] if box.start else 0
        return idx + start
    local = np.unravel_index(idx, box.length)
    glob = tuple(li + s for li, s in zip(local, box.start))
    return np.ravel_multi_index(glob, tuple(space)).astype(np.int64)


@njit(nogil=True, cache=True)
def _sparse_update(a: Any, b: Any, gidx: np.ndarray, old: np.ndarray, new: np.ndarray, itemsize: int,
                   total: int) -> tuple[int, int]:
    # One reduction per element (its weight) and none per sum: |weight * d| < 65536 * 256 = 2**24, so the int64
    # sums stay exact for 2**39 terms. A reduction per sum as well made 20 M changes take 1.5x as long.
    sa = np.int64(0)
    sb = np.int64(0)
    for i in range(gidx.size):
        o = np.uint64(old[i])
        w = np.uint64(new[i])
        top = (total - gidx[i] * itemsize) % MOD
        for j in range(itemsize):
            sh = np.uint64(8 * j)
            d = np.int64((w >> sh) & np.uint64(0xFF)) - np.int64((o >> sh) & np.uint64(0xFF))
            sa += d
            sb += (top - j) * d
    return (a + sa) % MOD, (b + sb) % MOD


def update_parts(parts: tuple[int, int], gidx: np.ndarray, old: np.ndarray, new: np.ndarray, itemsize: int,
                 total: int) -> tuple[int, int]:
    """Shares after elements at flat positions ``gidx`` changed from ``old`` to ``new`` (unsigned ints)."""
    if gidx.size == 0:
        return parts
    a, b = _sparse_update(parts[0], parts[1], np.asarray(gidx, dtype=np.int64), old, new, itemsize, total)
    return int(a) % MOD, int(b) % MOD
