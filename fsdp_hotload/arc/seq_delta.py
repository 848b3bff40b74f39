"""A host delta chunk in one compiled call: XOR, changed count, Adler-32 share delta, zero runs and libzstd.

Why: the trainer's host path (:class:`~fsdp_hotload.arc.dense.DenseDelta` feeding
:class:`~fsdp_hotload.arc.zstd_seq.SequenceEncoder`) went back to Python for every 128 KB block: a generator
step, slices, a count, two numba dispatches, a ctypes call and frame parsing, each retaking the GIL the trainer
needs. A 22 MB shard is ~170 blocks. Here one ``nogil`` numba call walks a whole chunk and calls
``ZSTD_compressSequences`` itself (an external symbol of the system libzstd, resolved by name, so the compiled
code can still be cached on disk). The frame it writes is byte for byte the one the block path writes. In the
2-rank CPU benchmark the encode of a delta took 27-35 ms instead of 44-48 (``benchmarks/RESULTS.md``).

Only :mod:`~fsdp_hotload.arc.zstd_seq` calls into this module, after libzstd loaded and passed its self-test; it
makes the library's symbols visible to compiled code first, and checks they are its own (:func:`expose_library`).

Example::

    frame_len, status, changed, da, db = encode_chunk(parent, new, 2, lstart, goff, total, scratch, seqs, dst,
                                                      cctx, table, LANES[2], 4, out, header_len)
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types

from .kernels import emit_zero_run, scan_block

_MOD = 65521
MAX_BLOCK = 1 << 17
# Pointers travel as uintp: the same register and width as a C pointer on the 64-bit ABIs numba targets.
_compress_sequences = types.ExternalFunction(
    "ZSTD_compressSequences",
    types.uintp(types.uintp, types.uintp, types.uintp, types.uintp, types.uintp, types.uintp, types.uintp))
_is_error = types.ExternalFunction("ZSTD_isError", types.uint32(types.uintp))

# status codes of encode_chunk (0 = ok)
ZSTD_FAILED = 1  # libzstd returned an error code (returned in place of the frame length)
BAD_FRAME = 2  # a frame this module does not expect (checksum, dictionary, reserved, truncated or oversized)
BAD_INPUT = 3  # encode_sparse_chunk: positions not increasing, or outside the chunk


def expose_library(lib: Any) -> str:
    """Make libzstd's symbols resolvable by compiled code (``lib``: the ``ctypes.CDLL`` that ``zstd_seq`` checked).

    Returns "" when the symbols compiled code will call are that library's own, else why not (another libzstd
    loaded into the process first would win the lookup by name)."""
    import ctypes

    from llvmlite import binding

    global exposed
    binding.load_library_permanently(lib._name)
    for sym in ("ZSTD_compressSequences", "ZSTD_isError"):
        ours = ctypes.cast(getattr(lib, sym), ctypes.c_void_p).value
        found = binding.address_of_symbol(sym)
        if found != ours:
            return f"{sym} resolves to {found!r}, not {lib._name}'s {ours!r}"
    exposed = True
    return ""


exposed = False  # set by expose_library: until then encode_chunk's calls into libzstd would jump to address 0


@njit(nogil=True, cache=True)
def _single_block(frame: np.ndarray, end: int) -> int:
    """Where a one-block zstd frame's block starts, -1 if it holds several blocks, -2 if it is not as expected."""
    fhd = np.int64(frame[4])
    if fhd & 0x07:  # checksum or dictionary id
        return -2
    single = (fhd >> 5) & 1
    fcs = fhd >> 6
    fcs_bytes = 1 if fcs == 0 and single else (0 if fcs == 0 else (2 if fcs == 1 else (4 if fcs == 2 else 8)))
    head = 5 + (0 if single else 1) + fcs_bytes
    if head + 3 > end:
        return -2
    b0 = np.int64(frame[head])
    size = (b0 | np.int64(frame[head + 1]) << 8 | np.int64(frame[head + 2]) << 16) >> 3
    kind = (b0 >> 1) & 3
    if kind == 3:
        return -2
    nxt = head + 3 + (1 if kind == 1 else size)
    if b0 & 1:
        return head if nxt == end else -2
    return -1 if nxt < end else -2


@njit(nogil=True, cache=True)
def encode_chunk(parent: np.ndarray, new: np.ndarray, itemsize: int, run_lstart: np.ndarray, run_goff: np.ndarray,
                 total: int, scratch: np.ndarray, seqs: np.ndarray, dst: np.ndarray, cctx: int, table: np.ndarray,
                 lanes: np.ndarray, min_run: int, out: np.ndarray, header_len: int) -> tuple[int, int, int, int, int]:
    """The blocks of one arc_v2 frame for ``parent ^ new``, appended to ``out[:header_len]`` (the frame header).

    Returns ``(frame_len, status, changed, da, db)``: the frame's length in ``out``, 0 or an error status (then
    ``frame_len`` is libzstd's error code for ``ZSTD_FAILED``), the changed elements of ``itemsize`` bytes, and
    the chunk's Adler-32 share delta (see :func:`~fsdp_hotload.arc.kernels.scan_block` for the run tables;
    ``lanes`` is ``kernels.LANES[itemsize]``). ``out`` needs ``header_len + n + 3 * (n // MAX_BLOCK + 1)`` bytes;
    ``scratch`` one block of 8-byte aligned bytes; ``seqs`` and ``dst`` as
    :class:`~fsdp_hotload.arc.zstd_seq.SequenceEncoder` sizes them.
    """
    n = parent.size
    pos = header_len
    last = -1
    changed = 0
    da = np.int64(0)
    db = np.int64(0)
    r = 0
    cctx_p = np.uintp(cctx)
    seqs_p = seqs.ctypes.data
    for s in range(0, n, MAX_BLOCK):
        e = min(n, s + MAX_BLOCK)
        x = scratch[:e - s]
        k, c, a, b, r = scan_block(parent[s:e], new[s:e], x, s, run_lstart, run_goff, r, total, itemsize, lanes,
                                   seqs, min_run, table)
        da = (da + a) % _MOD
        db = (db + b) % _MOD
        changed += c
        pos, last, status = _put_block(x, k, cctx_p, dst, seqs_p, out, pos, last)
        if status:
            return pos, status, changed, da, db
    return _end_frame(out, pos, last), 0, changed, da, db


@njit(nogil=True, cache=True)
def encode_sparse_chunk(idx: np.ndarray, old: np.ndarray, new: np.ndarray, n: int, itemsize: int,
                        scratch: np.ndarray, seqs: np.ndarray, dst: np.ndarray, cctx: int, min_run: int,
                        out: np.ndarray, header_len: int) -> tuple[int, int]:
    """The blocks of one arc_v2 frame for an ``n``-byte chunk whose XOR is zero except at the elements ``idx``
    (sorted, strictly increasing), which changed from ``old`` to ``new`` (unsigned ints of ``itemsize`` bytes).

    The device diff's counterpart of :func:`encode_chunk`: each block's XOR is scattered into ``scratch`` (zero
    outside the changes, cleared again after the block) and its zero runs are found from the changes themselves,
    so the work grows with the changes, not with the block's zero bytes, and no chunk-sized buffer is needed. The
    sequences are the ones :func:`~fsdp_hotload.arc.kernels.zero_run_sequences` finds in the block: a 22 MB bf16
    chunk with 1.3% of its elements changed took 7.4 ms, against 9.2 with that walk (10.9 before it listed the
    nonzero words first). Returns ``(frame_len, status)`` as :func:`encode_chunk` does, with
    ``BAD_INPUT`` for positions that are not increasing or out of range. Buffers as for :func:`encode_chunk`.
    """
    pos = header_len
    last = -1
    cctx_p = np.uintp(cctx)
    seqs_p = seqs.ctypes.data
    scratch[:] = 0
    j = 0
    prev = -1
    for s in range(0, n, MAX_BLOCK):
        e = min(n, s + MAX_BLOCK)
        x = scratch[:e - s]
        j0 = j
        lim = (e + itemsize - 1) // itemsize  # elements that start before e: idx * itemsize could overflow
        k = 0
        lit_start = 0
        last_nz = -1  # the block's last nonzero byte so far
        while j < idx.size and idx[j] < lim:
            p = idx[j] * itemsize - s
            if idx[j] <= prev or p < 0:
                return pos, BAD_INPUT
            prev = idx[j]
            v = np.uint64(old[j] ^ new[j])
            for t in range(itemsize):
                byte = np.uint8((v >> np.uint64(8 * t)) & np.uint64(0xFF))
                x[p + t] = byte
                if byte:  # the zero runs from the changes alone, as zero_run_sequences finds them in x
                    if p + t - last_nz - 1 > min_run:
                        k = emit_zero_run(seqs, k, lit_start, last_nz + 1, p + t - last_nz - 1)
                        lit_start = p + t
                    last_nz = p + t
            j += 1
        if x.size - last_nz - 1 > min_run:
            k = emit_zero_run(seqs, k, lit_start, last_nz + 1, x.size - last_nz - 1)
        pos, last, status = _put_block(x, k, cctx_p, dst, seqs_p, out, pos, last)
        if status:
            return pos, status
        for q in range(j0, j):
            p = idx[q] * itemsize - s
            for t in range(itemsize):
                x[p + t] = 0
    if j != idx.size:
        return pos, BAD_INPUT
    return _end_frame(out, pos, last), 0


@njit(nogil=True, cache=True)
def _put_block(x: np.ndarray, k: int, cctx_p: Any, dst: np.ndarray, seqs_p: Any, out: np.ndarray, pos: int,
               last: int) -> tuple[int, int, int]:
    """Compress block ``x`` from its ``k`` sequences and append it to ``out`` at ``pos`` (clearing the last-block
    bit of the block at ``last``). Returns ``(pos, last, status)``; for ``ZSTD_FAILED``, ``pos`` is libzstd's
    error code."""
    m = x.size
    rc = _compress_sequences(cctx_p, dst.ctypes.data, np.uintp(dst.size), seqs_p, np.uintp(k), x.ctypes.data,
                             np.uintp(m))
    if _is_error(rc):
        return np.int64(rc), last, ZSTD_FAILED
    head = _single_block(dst, np.int64(rc))
    if head == -2:
        return pos, last, BAD_FRAME
    if last >= 0:
        out[last] &= 0xFE  # the previous block is no longer the frame's last
    last = pos
    if head >= 0:
        length = np.int64(rc) - head
        if pos + length > out.size:  # a compressed block larger than the raw one: never written by libzstd
            return pos, last, BAD_FRAME
        out[pos:pos + length] = dst[head:head + length]
        pos += length
    else:  # libzstd split it: store the block raw, which leaves the decoder's state untouched
        h = (m << 3) | 1
        out[pos] = h & 0xFF
        out[pos + 1] = (h >> 8) & 0xFF
        out[pos + 2] = (h >> 16) & 0xFF
        out[pos + 3:pos + 3 + m] = x
        pos += 3 + m
    return pos, last, 0


@njit(nogil=True, cache=True)
def _end_frame(out: np.ndarray, pos: int, last: int) -> int:
    if last < 0:  # empty chunk: one empty raw block
        out[pos] = 1
        out[pos + 1] = 0
        out[pos + 2] = 0
        pos += 3
    return pos
