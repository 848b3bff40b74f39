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
