"""numba kernels for the format's hot loops.

Every kernel is compiled with ``nogil=True``: they run on publisher threads next to the training loop, and a
kernel that held the GIL would stall the trainer's Python code for its whole duration.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_JIT = dict(nogil=True, cache=True)
_MOD = 65521  # Adler-32's modulus


@njit(**_JIT)
def _count_diff(a: np.ndarray, b: np.ndarray) -> int:
    c = 0
    for i in range(a.size):
        if a[i] != b[i]:
            c += 1
    return c


@njit(**_JIT)
def _fill_diff(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> int:
    """Writes the positions into ``out``, never past its end; returns how many it found."""
    j = 0
    for i in range(a.size):
        if a[i] != b[i]:
            if j < out.size:
                out[j] = i
            j += 1
    return j


def diff_positions(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted int64 positions where two equal-length 1-D arrays differ.

    Two passes, a count and then the positions, so that only the changes are allocated. Why the second is
    bounded: arrays written while they are diffed (by another thread) can change the count between the passes,
    and an unchecked pass wrote past its array into the heap, a corruption found only later elsewhere (a fuzz
    abort of this shape was never explained). Now the heap is safe, and a count that moved raises. It is a
    guard, not a detector: a write that leaves the count as it was gives positions of no single state. Nothing
    in the engine writes a slot or the cache while it is diffed (async copies are waited for first)."""
    out = np.empty(_count_diff(a, b), dtype=np.int64)
    if _fill_diff(a, b, out) != out.size:
        raise RuntimeError(f"the arrays changed while they were diffed ({a.size} elements): another thread writes "
                           "one of them")
    return out


@njit(**_JIT)
def scatter_xor(dst: np.ndarray, idx: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
    """``dst[idx[i]] = old[i] ^ new[i]`` (dst pre-zeroed)."""
    for i in range(idx.size):
        dst[idx[i]] = old[i] ^ new[i]


@njit(**_JIT)
def _xor_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    # Separate function over whole arrays so the loop vectorizes (indices start at 0, no offsets).
    for p in range(a.size):
        out[p] = a[p] ^ b[p]


@njit(**_JIT)
def _next_run(r: int, lpos: int, run_lstart: np.ndarray, n: int) -> int:
    """Where run ``r + 1`` starts, in offsets of the block at chunk byte ``lpos`` (``n``: r is the last run)."""
    return run_lstart[r + 1] - lpos if r + 1 < run_lstart.size else n


@njit(**_JIT)
def _fold_run(da: int, db: int, sd: int, spd: int, r: int, lpos: int, run_lstart: np.ndarray,
              run_goff: np.ndarray, total: int) -> tuple[int, int]:
    """Add run r's sums (of d, and of p * d with p a byte's offset in the block) to the share deltas."""
    g0 = run_goff[r] + lpos - run_lstart[r]  # tensor byte of block offset 0, on run r's line
    return (da + sd) % _MOD, (db + ((total - g0) % _MOD) * (sd % _MOD) - spd) % _MOD


@njit(**_JIT)
def _share_bytes(a: np.ndarray, b: np.ndarray, x: np.ndarray, p0: int, p1: int, lpos: int, run_lstart: np.ndarray,
                 run_goff: np.ndarray, total: int, da: int, db: int, sd: int, spd: int, r: int,
                 nxt: int) -> tuple[int, int, int, int, int, int]:
    """The changed bytes of ``x[p0:p1]`` one by one, for bytes where a run may end: the slow path of
    :func:`scan_block`. Returns the updated ``(da, db, sd, spd, r, nxt)``."""
    for p in range(p0, p1):
        if x[p] == 0:
            continue
        while p >= nxt:
            da, db = _fold_run(da, db, sd, spd, r, lpos, run_lstart, run_goff, total)
            sd = spd = np.int64(0)
            r += 1
            nxt = _next_run(r, lpos, run_lstart, x.size)
        d = np.int64(b[p]) - np.int64(a[p])
        sd += d
        spd += np.int64(p) * d
    return da, db, sd, spd, r, nxt


def _lane_table(itemsize: int) -> np.ndarray:
    """Per 8-bit mask of a word's nonzero bytes: how many of its elements of ``itemsize`` bytes are nonzero."""
    t = np.zeros(256, dtype=np.int64)
    for m in range(256):
        t[m] = sum(1 for lane in range(0, 8, itemsize) if (m >> lane) & ((1 << itemsize) - 1))
    return t


LANES = {size: _lane_table(size) for size in (1, 2, 4, 8)}  # scan_block's ``lanes`` per element size
NO_SEQUENCES = np.zeros((0, 4), dtype=np.uint32)  # scan_block's ``seqs`` when only the XOR, count and shares count
NO_TABLE = np.zeros((256, 4), dtype=np.int64)  # scan_block's zero-run table without sequences (never read)


@njit(**_JIT)
def scan_block(a: np.ndarray, b: np.ndarray, x: np.ndarray, lpos: int, run_lstart: np.ndarray, run_goff: np.ndarray,
               r: int, total: int, itemsize: int, lanes: np.ndarray, seqs: np.ndarray, min_run: int,
               table: np.ndarray) -> tuple[int, int, int, int, int]:
    """``x = a ^ b`` over one block of a chunk, then one walk over the XOR's nonzero 8-byte words for the changed
    elements, the block's change of its tensor's Adler-32 shares and (unless ``seqs`` has no rows) the zero-run
    sequences of :func:`zero_run_sequences`. Returns ``(sequences, changed, da, db, r)``.

    The block starts at byte ``lpos`` of its chunk; run ``k`` of the chunk starts at chunk byte
    ``run_lstart[k]`` and sits at tensor byte ``run_goff[k]``; ``r`` is the run holding ``lpos``, and the
    returned ``r`` the run holding the block's end, for the next call. A byte at tensor position ``g`` changing by
    ``d`` adds ``d`` to A and ``(total - g) * d`` to B; ``(da, db)`` are those sums mod 65521. ``x`` must be
    8-byte aligned; ``lanes`` is ``LANES[itemsize]``.

    Why one walk: between RL steps ~95% of the XOR's words are zero, so the cost is the test on each word and
    the work on the few that are not. With the share deltas' int64 arithmetic on every byte and two more passes
    for the count and the zero runs, a 22 MB bf16 shard with 1.3% of its elements changed took 23 ms to encode on
    an Intel Xeon core; with this walk, 9-11. The per-word work is written out here and in
    :func:`zero_run_sequences` rather than shared through a helper: with a helper call that takes arrays on every
    nonzero word, the zero-run walk alone took 1.6x as long (5.2 against 3.2 ms on that shard).

    Why the nonzero words are listed first: a branch per word that is taken at random 5% of the time
    mispredicts on most nonzero words, and a word's eight byte differences, summed one by one, cost more than
    the word's other work. The list is built without a branch, and the sums come from each side's whole word
    (:func:`_byte_sums`). On that shard the scan with its zero runs fell from 6.5 to 4.0 ms, and the whole
    encode (:func:`~fsdp_hotload.arc.seq_delta.encode_chunk`, libzstd included) from 12.0 to 9.2 ms.
    """
    n = a.size
    _xor_into(a, b, x)
    runs = seqs.shape[0] > 0
    k = 0
    lit_start = 0
    prev = -1  # last nonzero byte
    changed = 0
    da = db = sd = spd = np.int64(0)  # sd, spd: run r's sums of d and p * d (p: the byte's offset in the block)
    nxt = _next_run(r, lpos, run_lstart, n)
    nw = n // 8
    words = x[:nw * 8].view(np.uint64)
    wa = a[:nw * 8].view(np.uint64)  # scalar loads only, so a chunk that starts off an 8-byte boundary is fine
    wb = b[:nw * 8].view(np.uint64)
    nonzero, j = _nonzero_words(words)
    for i in range(j):
        q = np.int64(nonzero[i])
        v = words[q]
        m = _nonzero_bytes(v)
        base = q * 8
        changed += lanes[m]
        if base + 8 <= nxt:  # the whole word in run r (an unchanged byte adds d = 0)
            sa, ta = _byte_sums(wa[q])
            sb, tb = _byte_sums(wb[q])
            sd += sb - sa  # |spd| < 2^20 * 2^20 * 255 for blocks under 2^20 bytes: exact
            spd += base * (sb - sa) + tb - ta
        else:
            da, db, sd, spd, r, nxt = _share_bytes(a, b, x, base, base + 8, lpos, run_lstart, run_goff, total,
                                                   da, db, sd, spd, r, nxt)
        if runs:
            p = base + table[m, 0]
            if p - prev - 1 > min_run:
                k = emit_zero_run(seqs, k, lit_start, prev + 1, p - prev - 1)
                lit_start = p
            if table[m, 3]:
                k = emit_zero_run(seqs, k, lit_start, base + table[m, 2], table[m, 3])
                lit_start = base + table[m, 2] + table[m, 3]
            prev = base + table[m, 1]
    tail = words.size * 8
    for p in range(tail, n, itemsize):  # itemsize divides 8, so the tail holds whole elements
        nz = False
        for t in range(p, p + itemsize):
            nz |= x[t] != 0
        changed += nz
    da, db, sd, spd, r, nxt = _share_bytes(a, b, x, tail, n, lpos, run_lstart, run_goff, total, da, db, sd, spd,
                                           r, nxt)
    if runs:
        k = _zero_run_end(x, tail, seqs, k, lit_start, prev, min_run)
    da, db = _fold_run(da, db, sd, spd, r, lpos, run_lstart, run_goff, total)
    while r + 1 < run_lstart.size and run_lstart[r + 1] <= lpos + n - 1:
        r += 1
    return k, changed, da, db, r


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
    """Row ``k`` of ``seqs`` for a run of ``zeros`` zero bytes at ``zero_at``, after literals from ``lit_start``:
    the literals up to and including the run's first zero byte, then a match at offset 1 that repeats it.
    Returns the next row."""
    seqs[k, 0] = 1
    seqs[k, 1] = zero_at + 1 - lit_start
    seqs[k, 2] = zeros - 1
    seqs[k, 3] = 0
    return k + 1


@njit(**_JIT)
def _nonzero_words(words: np.ndarray) -> tuple[np.ndarray, int]:
    """Where the nonzero words are: the first ``count`` entries of the returned array. Every word is written and
    the count moves past the nonzero ones, so there is no branch to mispredict (see :func:`scan_block`)."""
    out = np.empty(words.size, dtype=np.int32)
    count = 0
    for q in range(words.size):
        out[count] = q
        count += words[q] != 0
    return out, count


@njit(**_JIT)
def _byte_sums(w: np.uint64) -> tuple[int, int]:
    """The sum of a little-endian word's eight bytes, and their sum weighted by position (byte j counts j times).

    Both come from 16-bit lanes: the even and the odd bytes, each at most 255, summed by one multiply that adds
    every lane into the top one (at most 8 x 255, or 6 x 510 weighted: no lane overflows into the next)."""
    lanes16 = np.uint64(0x00FF00FF00FF00FF)
    even = w & lanes16
    odd = (w >> np.uint64(8)) & lanes16
    pairs = even + odd  # lane i: bytes 2i and 2i + 1
    total = np.int64((pairs * np.uint64(0x0001000100010001)) >> np.uint64(48))
    # top lane of pairs * (3, 2, 1, 0 from lane 0 up) = sum of i * lane i; byte 2i + 1 counts once more than 2i
    weighted = np.int64((pairs * np.uint64(0x0000000100020003)) >> np.uint64(48))
    odd_sum = np.int64((odd * np.uint64(0x0001000100010001)) >> np.uint64(48))
    return total, 2 * weighted + odd_sum


@njit(**_JIT)
def _nonzero_bytes(v: np.uint64) -> int:
    """8-bit mask of the nonzero bytes of a little-endian word."""
    lo7 = np.uint64(0x7F7F7F7F7F7F7F7F)
    nonzero = (((v & lo7) + lo7) | v) & np.uint64(0x8080808080808080)  # 0x80 in every nonzero byte
    return np.int64(((nonzero >> np.uint64(7)) * np.uint64(0x0102040810204080)) >> np.uint64(56))  # bit 8j -> 56+j


@njit(**_JIT)
def _zero_run_end(x: np.ndarray, start: int, seqs: np.ndarray, k: int, lit_start: int, prev: int,
                  min_run: int) -> int:
    """The bytes from ``start`` (after the last whole word) one by one, then the block's trailing zero run."""
    n = x.size
    for p in range(start, n):
        if x[p] != 0:
            if p - prev - 1 > min_run:
                k = emit_zero_run(seqs, k, lit_start, prev + 1, p - prev - 1)
                lit_start = p
            prev = p
    if n - prev - 1 > min_run:
        k = emit_zero_run(seqs, k, lit_start, prev + 1, n - prev - 1)
    return k


@njit(**_JIT)
def zero_run_sequences(x: np.ndarray, words: np.ndarray, seqs: np.ndarray, min_run: int, table: np.ndarray) -> int:
    """zstd sequences for a mostly-zero block ``x``: every run of more than ``min_run`` zero bytes becomes one
    match at offset 1; everything else is literals. Returns how many rows of ``seqs`` (``ZSTD_Sequence``:
    offset, literal length, match length, rep) were written; the block's trailing literals are implicit.

    ``words`` is ``x[:len(x) // 8 * 8]`` viewed as little-endian uint64 and ``table`` is
    ``zero_run_table(min_run)``: the nonzero words are listed first, without a branch, and each costs one table
    lookup (1.9 against 3.7 ms for a 22 MB bf16 XOR with 1.3% of its elements changed, when every word was
    tested in turn). Every literal run is at least one byte long, so offset 1 is always the first repeat code and
    the decoder's repeat history never changes: blocks encoded separately can share one frame.
    (:func:`scan_block` finds the same sequences while it walks a block for its count and checksum.)
    """
    k = 0
    lit_start = 0
    prev = -1  # last nonzero byte
    nonzero, j = _nonzero_words(words)
    for i in range(j):
        q = np.int64(nonzero[i])
        v = words[q]
        m = _nonzero_bytes(v)
        base = q * 8
        p = base + table[m, 0]
        if p - prev - 1 > min_run:
            k = emit_zero_run(seqs, k, lit_start, prev + 1, p - prev - 1)
            lit_start = p
        if table[m, 3]:
            k = emit_zero_run(seqs, k, lit_start, base + table[m, 2], table[m, 3])
            lit_start = base + table[m, 2] + table[m, 3]
        prev = base + table[m, 1]
    return _zero_run_end(x, words.size * 8, seqs, k, lit_start, prev, min_run)
