"""numba kernels for the format's hot loops.

Every kernel is compiled with ``nogil=True``: they run on publisher threads next to the training loop, and a
kernel that held the GIL would stall the trainer's Python code for its whole duration.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_JIT = dict(nogil=True, cache=True)


@njit(**_JIT)
def _count_diff(a: np.ndarray, b: np.ndarray) -> int:
    c = 0
    for i in range(a.size):
        if a[i] != b[i]:
            c += 1
    return c


@njit(**_JIT)
def _fill_diff(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    j = 0
    for i in range(a.size):
        if a[i] != b[i]:
            out[j] = i
            j += 1


def diff_positions(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted int64 positions where two equal-length 1-D arrays differ."""
    out = np.empty(_count_diff(a, b), dtype=np.int64)
    _fill_diff(a, b, out)
    return out


@njit(**_JIT)
def scatter_xor(dst: np.ndarray, idx: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
    """``dst[idx[i]] = old[i] ^ new[i]`` (dst pre-zeroed)."""
    for i in range(idx.size):
        dst[idx[i]] = old[i] ^ new[i]


@njit(**_JIT)
def _xor_sums(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> tuple[int, int]:
    # Separate function over whole arrays so the loop vectorizes (indices start at 0, no offsets).
    sd = np.int64(0)
    spd = np.int64(0)
    for p in range(a.size):
        out[p] = a[p] ^ b[p]
        d = np.int64(b[p]) - np.int64(a[p])
        sd += d
        spd += np.int64(p) * d
    return sd, spd


@njit(**_JIT)
def xor_adler_block(a: np.ndarray, b: np.ndarray, out: np.ndarray, lpos: int, run_lstart: np.ndarray,
                    run_goff: np.ndarray, r: int, total: int) -> tuple[int, int, int]:
    """``out = a ^ b`` over one block of bytes, and the block's change of its tensor's Adler-32 shares.

    The block starts at byte ``lpos`` of its chunk; run ``k`` of the chunk starts at chunk byte
    ``run_lstart[k]`` and sits at tensor byte ``run_goff[k]``; ``r`` is the run holding ``lpos``. Returns
    ``(da, db, r)``: the share deltas mod 65521 and the run holding the block's end, for the next call.
    A byte at tensor position ``g`` changing by ``d`` adds ``d`` to A and ``(total - g) * d`` to B.
    """
    mod = 65521
    n = a.size
    da = np.int64(0)
    db = np.int64(0)
    i = 0
    while i < n:
        while r + 1 < run_lstart.size and run_lstart[r + 1] <= lpos + i:
            r += 1
        end = n if r + 1 >= run_lstart.size else min(n, run_lstart[r + 1] - lpos)
        g = run_goff[r] + (lpos + i - run_lstart[r])
        # |spd| <= n * 255 * n < 2**48 for blocks under 2**20 bytes: exact in int64.
        sd, spd = _xor_sums(a[i:end], b[i:end], out[i:end])
        da = (da + sd) % mod
        db = (db + ((total - g) % mod) * (sd % mod) - spd) % mod
        i = end
    return da, db, r
