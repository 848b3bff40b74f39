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
def xor_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    # Separate function over whole arrays so the loop vectorizes (indices start at 0, no offsets).
    for p in range(a.size):
        out[p] = a[p] ^ b[p]


@njit(**_JIT)
def xor_adler_block(a: np.ndarray, b: np.ndarray, out: np.ndarray, lpos: int, run_lstart: np.ndarray,
                    run_goff: np.ndarray, r: int, total: int) -> tuple[int, int, int]:
    """``out = a ^ b`` over one block of bytes, and the block's change of its tensor's Adler-32 shares.

    The block starts at byte ``lpos`` of its chunk; run ``k`` of the chunk starts at chunk byte
    ``run_lstart[k]`` and sits at tensor byte ``run_goff[k]``; ``r`` is the run holding ``lpos``. Returns
    ``(da, db, r)``: the share deltas mod 65521 and the run holding the block's end, for the next call.
    A byte at tensor position ``g`` changing by ``d`` adds ``d`` to A and ``(total - g) * d`` to B.

    Why two passes: the XOR is one vectorised sweep, and the share deltas then only visit the 8-byte words of
    the XOR that are nonzero (a few percent between RL steps). Folding them into the sweep as per-byte int64
    arithmetic made this the most expensive loop of a delta publish (~10x the XOR alone).
    """
    mod = 65521
    n = a.size
    xor_into(a, b, out)
    da = np.int64(0)
    db = np.int64(0)
    sd = np.int64(0)  # sums over the changed bytes of run r: d, and p * d with p the byte's offset in the block
    spd = np.int64(0)
    last = run_lstart.size - 1
    nxt = run_lstart[r + 1] - lpos if r < last else n  # where run r + 1 starts, in block offsets
    words = out[:n // 8 * 8].view(np.uint64)
    for q in range(words.size + 1):
        if q < words.size:
            if words[q] == 0:
                continue
            p0, p1 = q * 8, q * 8 + 8
            if p1 <= nxt:  # the whole word in run r: no branch per byte (an unchanged byte adds d = 0)
                for p in range(p0, p1):
                    d = np.int64(b[p]) - np.int64(a[p])
                    sd += d
                    spd += np.int64(p) * d
                continue
        else:  # the bytes after the last whole word
            p0, p1 = words.size * 8, n
        for p in range(p0, p1):
            if out[p] == 0:
                continue
            while p >= nxt:  # |spd| < 2^20 * 2^20 * 255 for blocks under 2^20 bytes: exact in int64
                g0 = run_goff[r] + lpos - run_lstart[r]  # tensor byte of block offset 0, on run r's line
                da = (da + sd) % mod
                db = (db + ((total - g0) % mod) * (sd % mod) - spd) % mod
                sd = np.int64(0)
                spd = np.int64(0)
                r += 1
                nxt = run_lstart[r + 1] - lpos if r < last else n
            d = np.int64(b[p]) - np.int64(a[p])
            sd += d
            spd += np.int64(p) * d
    g0 = run_goff[r] + lpos - run_lstart[r]
    da = (da + sd) % mod
    db = (db + ((total - g0) % mod) * (sd % mod) - spd) % mod
    while r < last and run_lstart[r + 1] <= lpos + n - 1:
        r += 1
    return da, db, r


def zero_run_table(min_run: int) -> np.ndarray:
    """Per 8-bit mask of a word's nonzero bytes: first and last nonzero byte, and the start and length of the zero
    run between them if it is longer than ``min_run`` (at most one fits in eight bytes), else length 0."""
    table = np.zeros((256, 4), dtype=np.int64)
    for m in range(1, 256):
        pos = [t for t in range(8) if m >> t & 1]
        table[m, 0], table[m, 1] = pos[0], pos[-1]
        for a, b in zip(pos, pos[1:]):
            if b - a - 1 > min_run:
                table[m, 2], table[m, 3] = a + 1, b - a - 1
    return table


@njit(**_JIT)
def emit_zero_run(seqs: np.ndarray, k: int, lit_start: int, zero_at: int, zeros: int) -> int:
    # Literals up to and including the run's first zero byte, then a match at offset 1 that repeats it.
    seqs[k, 0] = 1
    seqs[k, 1] = zero_at + 1 - lit_start
    seqs[k, 2] = zeros - 1
    seqs[k, 3] = 0
    return k + 1


@njit(**_JIT)
def zero_run_sequences(x: np.ndarray, words: np.ndarray, seqs: np.ndarray, min_run: int, table: np.ndarray) -> int:
    """zstd sequences for a mostly-zero block ``x``: every run of more than ``min_run`` zero bytes becomes one
    match at offset 1; everything else is literals. Returns how many rows of ``seqs`` (``ZSTD_Sequence``:
    offset, literal length, match length, rep) were written; the block's trailing literals are implicit.

    ``words`` is ``x[:len(x) // 8 * 8]`` viewed as little-endian uint64 and ``table`` is
    ``zero_run_table(min_run)``: zero words are skipped eight bytes at a time and a nonzero word costs one table
    lookup. Every literal run is at least one byte long, so offset 1 is always the first repeat code and the
    decoder's repeat history never changes: blocks encoded separately can share one frame.
    """
    n = x.size
    lo7 = np.uint64(0x7F7F7F7F7F7F7F7F)
    high = np.uint64(0x8080808080808080)
    gather = np.uint64(0x0102040810204080)  # moves bit 8j to bit 56 + j
    k = 0
    lit_start = 0
    prev = -1  # last nonzero byte
    for q in range(words.size):
        v = words[q]
        if v == 0:
            continue
        nonzero = (((v & lo7) + lo7) | v) & high  # 0x80 in every nonzero byte
        m = np.int64(((nonzero >> np.uint64(7)) * gather) >> np.uint64(56))
        base = q * 8
        p = base + table[m, 0]
        if p - prev - 1 > min_run:
            k = emit_zero_run(seqs, k, lit_start, prev + 1, p - prev - 1)
            lit_start = p
        if table[m, 3]:
            k = emit_zero_run(seqs, k, lit_start, base + table[m, 2], table[m, 3])
            lit_start = base + table[m, 2] + table[m, 3]
        prev = base + table[m, 1]
    for p in range(words.size * 8, n):
        if x[p] != 0:
            if p - prev - 1 > min_run:
                k = emit_zero_run(seqs, k, lit_start, prev + 1, p - prev - 1)
                lit_start = p
            prev = p
    if n - prev - 1 > min_run:
        k = emit_zero_run(seqs, k, lit_start, prev + 1, n - prev - 1)
    return k
