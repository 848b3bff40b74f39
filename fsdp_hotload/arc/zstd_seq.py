"""One zstd frame for XOR data, from zero-run sequences we find ourselves (libzstd's ``ZSTD_compressSequences``).

Why: the XOR of two nearby RL snapshots is ~97% zero bytes, with the changes scattered one or two bytes at a
time. zstd's fastest match finder spends most of its time rediscovering those zero runs and still misses the
short ones. A numba kernel finds every run exactly, eight bytes at a time (:func:`kernels.zero_run_sequences`),
and libzstd only entropy-codes the result. On RL-like bf16 steps (0.7-10% of elements changed) payloads are
1.3-1.5x smaller than zstd level 1's on the same XOR, and the trainer's host path spends about a quarter less
CPU (24 -> 18 ms for a 22 MB shard at 2.75%; ``benchmarks/codec.py`` measures both). The output is an ordinary
zstd frame: any decoder reads it, and it decodes to the same bytes as the streaming path.

How: each XOR block (at most 128 KB, the format's block size limit) is compressed as a frame of its own; its
blocks are then appended to one frame header that declares the chunk's size. That is valid because every match
is at offset 1 behind a literal, so the decoder's repeat-offset history is the same at the start of every block,
and a block that opens a frame never refers to the previous block's entropy tables.

libzstd comes from the system (``libzstd.so.1``, or ``HOTLOAD_LIBZSTD=/path/to/libzstd.so``); the sequence API
is libzstd's experimental one, so it is used only from version 1.5.0 on and after a round-trip self-test at
load. Otherwise :func:`sequence_encoder` returns ``None`` with the reason in :func:`encoder_status`, and the
codec keeps to the streaming path. ``HOTLOAD_ARC_ENCODER=stream`` makes :class:`~fsdp_hotload.arc.codecs.ArcV2`
keep to it anyway.

Example::

    enc = sequence_encoder()
    if enc is not None:
        frame = enc.encode([xor_block_1, xor_block_2], nbytes=len(xor_block_1) + len(xor_block_2))
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
import weakref
from typing import Any, Iterable

import numpy as np

from . import seq_delta
from .dense import DenseDelta, run_tables
from .errors import FormatError
from .kernels import LANES, zero_run_sequences, zero_run_table

MAX_BLOCK = seq_delta.MAX_BLOCK  # zstd's largest block: one constant for the kernels and the buffers sized here
MIN_RUN = 4  # shorter zero runs stay literals: a sequence costs more than a few Huffman-coded zeros
_TABLE = zero_run_table(MIN_RUN)
_WINDOW_LOG = 17  # matches are all at offset 1; the window only has to hold one block

# ZSTD_cParameter values (zstd.h; stable across 1.5.x)
_C_LEVEL, _C_MIN_MATCH, _C_CONTENT_SIZE, _C_CHECKSUM, _C_DICT_ID = 100, 105, 200, 201, 202
_C_VALIDATE_SEQUENCES = 1009  # ZSTD_c_experimentalParam12
_C_BLOCK_SPLITTER = 1010  # ZSTD_c_experimentalParam13: useBlockSplitter (1.5.1+), splitAfterSequences (1.5.7)


def _load_libzstd() -> tuple[Any, str]:
    lib, name, error = None, "", "not found"
    # The usual soname first (no subprocess); ctypes.util.find_library runs ldconfig or a compiler to search.
    for find in ([lambda: os.environ["HOTLOAD_LIBZSTD"]] if os.environ.get("HOTLOAD_LIBZSTD")
                 else [lambda: "libzstd.so.1", lambda: ctypes.util.find_library("zstd")]):
        name = find() or ""
        try:
            lib = ctypes.CDLL(name) if name else None  # CDLL: every call releases the GIL
        except OSError as exc:
            error = str(exc)
        if lib is not None:
            break
    if lib is None:
        return None, f"libzstd not loadable ({error}); install libzstd1 or set HOTLOAD_LIBZSTD"
    try:
        lib.ZSTD_versionNumber.restype = ctypes.c_uint
        version = int(lib.ZSTD_versionNumber())
        if not 10500 <= version < 20000:
            return None, f"{name} is libzstd {version}; the sequence API needs 1.5 or a newer 1.x"
        lib.ZSTD_createCCtx.restype = ctypes.c_void_p
        lib.ZSTD_freeCCtx.argtypes = [ctypes.c_void_p]
        lib.ZSTD_CCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.ZSTD_CCtx_setParameter.restype = ctypes.c_size_t
        lib.ZSTD_compressSequences.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                               ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
        lib.ZSTD_compressSequences.restype = ctypes.c_size_t
        lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
        lib.ZSTD_isError.restype = ctypes.c_uint
        lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
        lib.ZSTD_getErrorName.restype = ctypes.c_char_p
    except AttributeError as exc:
        return None, f"{name} lacks the sequence API ({exc})"
    return lib, f"{name} (libzstd {version // 10000}.{version // 100 % 100}.{version % 100})"


def frame_header(nbytes: int) -> bytes:
    """A zstd frame header with content size ``nbytes``, no checksum and no dictionary, laid out as libzstd lays
    it out: a frame that fits in the 128 KB window is single-segment (the window is the content), else it
    declares the window."""
    magic = b"\x28\xb5\x2f\xfd"
    if nbytes <= 1 << _WINDOW_LOG:
        if nbytes < 256:
            return magic + bytes([0x20, nbytes])
        if nbytes < 65536 + 256:
            return magic + bytes([0x60]) + (nbytes - 256).to_bytes(2, "little")
        return magic + bytes([0xA0]) + nbytes.to_bytes(4, "little")
    window = bytes([(_WINDOW_LOG - 10) << 3])
    if nbytes < 1 << 32:
        return magic + bytes([0x80]) + window + nbytes.to_bytes(4, "little")
    return magic + bytes([0xC0]) + window + nbytes.to_bytes(8, "little")


_BAD_FRAME = ("libzstd wrote a frame with a checksum, dictionary id, reserved block, truncation or a block larger "
              "than its input")


class _ThreadState:
    """One compression context and scratch buffers per thread (publishers encode concurrently)."""

    def __init__(self, lib: Any, level: int) -> None:
        self.lib = lib
        self.cctx = lib.ZSTD_createCCtx()
        if not self.cctx:
            raise MemoryError("ZSTD_createCCtx failed")
        # Not at exit: a daemon encode thread may still be inside a call on this context then.
        weakref.finalize(self, lib.ZSTD_freeCCtx, self.cctx).atexit = False
        for param, value in ((_C_LEVEL, level), (_C_MIN_MATCH, 3), (_C_CONTENT_SIZE, 0), (_C_CHECKSUM, 0),
                             (_C_DICT_ID, 0), (_C_VALIDATE_SEQUENCES, 1)):
            self.check(lib.ZSTD_CCtx_setParameter(self.cctx, param, value), f"setting parameter {param}")
        lib.ZSTD_CCtx_setParameter(self.cctx, _C_BLOCK_SPLITTER, 2)  # off where libzstd has one: one block out
        self.seqs = np.empty((MAX_BLOCK // (MIN_RUN + 1) + 2, 4), dtype=np.uint32)  # ZSTD_Sequence rows
        self.dst = np.empty(MAX_BLOCK + (MAX_BLOCK >> 7) + 512, dtype=np.uint8)
        self.aligned = np.empty(MAX_BLOCK, dtype=np.uint8)
        self.xor = np.empty(MAX_BLOCK, dtype=np.uint8)  # encode_delta's XOR block (8-byte aligned)
        self.seqs_ptr, self.dst_ptr, self.aligned_ptr = self.seqs.ctypes.data, self.dst.ctypes.data, \
            self.aligned.ctypes.data

    def check(self, rc: int, what: str) -> int:
        if self.lib.ZSTD_isError(rc):
            raise FormatError(f"libzstd failed {what}: {self.lib.ZSTD_getErrorName(rc).decode()}")
        return rc


class SequenceEncoder:
    """Encodes XOR blocks into one zstd frame through ``ZSTD_compressSequences`` (see the module docstring)."""

    def __init__(self, lib: Any, level: int = 1, one_call: bool | None = None) -> None:
        self.lib = lib
        self.level = level
        # encode_delta in one compiled call (seq_delta) or block by block; None: as one_call_status() decides
        self.one_call = one_call
        self._local = threading.local()

    def _state(self) -> _ThreadState:
        st = getattr(self._local, "state", None)
        if st is None:
            st = self._local.state = _ThreadState(self.lib, self.level)
        return st

    def encode(self, blocks: Iterable[Any], nbytes: int) -> bytes:
        """One frame whose content is the concatenation of ``blocks`` (buffers of bytes, ``nbytes`` in all).

        Each block is consumed before the next is requested, so a producer may reuse one buffer.
        """
        st = self._state()
        out = bytearray(frame_header(nbytes))
        seen = 0
        last = None  # offset in ``out`` of the newest block header, whose last-block bit is cleared on the next
        for blk in blocks:
            x = np.frombuffer(blk, dtype=np.uint8)
            for s in range(0, x.size, MAX_BLOCK):
                if last is not None:
                    out[last] &= 0xFE
                last = self._append(st, x[s:s + MAX_BLOCK], out)
            seen += x.size
        if seen != nbytes:
            raise FormatError(f"XOR blocks add up to {seen} bytes, {nbytes} announced")
        if last is None:  # empty chunk: one empty raw block
            out += b"\x01\x00\x00"
        return bytes(out)

    def encode_delta(self, parent: np.ndarray, new: np.ndarray, itemsize: int,
                     tables: tuple[np.ndarray, np.ndarray], total: int) -> tuple[bytes, int, tuple[int, int]]:
        """The frame of ``parent ^ new`` (flat uint8 chunks), its changed elements and Adler-32 share delta.

        ``tables`` and ``total`` are as for :class:`~fsdp_hotload.arc.dense.DenseDelta`, whose block path this
        replaces when ``one_call`` is set (same frame bytes, one GIL-free call per chunk).
        """
        if not self._one_call():
            scan = DenseDelta(parent, new, itemsize, tables, total, scratch=self._state().xor)
            frame = self.encode(scan.blocks(), parent.size)
            return frame, scan.changed, scan.parts_delta
        if parent.shape != new.shape or parent.dtype != np.uint8 or new.dtype != np.uint8 or parent.ndim != 1:
            raise FormatError("encode_delta needs two flat uint8 arrays of equal length")
        if itemsize not in LANES or parent.size % itemsize:  # as DenseDelta refuses: the count would be wrong
            raise FormatError(f"a chunk of {parent.size} bytes is not whole elements of {itemsize} bytes")
        st = self._state()
        out, head_len = _frame_buffer(parent.size)
        end, status, changed, da, db = seq_delta.encode_chunk(
            np.ascontiguousarray(parent), np.ascontiguousarray(new), itemsize, tables[0], tables[1], total, st.xor,
            st.seqs, st.dst, st.cctx, _TABLE, LANES[itemsize], MIN_RUN, out, head_len)
        return _finish(st, out, end, status), int(changed), (int(da), int(db))

    def _one_call(self) -> bool:
        if self.one_call is None:
            self.one_call = one_call_status()[0]
        elif self.one_call and not seq_delta.exposed:
            ok, why = one_call_status()
            if not ok:
                raise FormatError(f"one call per chunk is unavailable: {why}")
        return self.one_call

    def encode_sparse(self, idx: np.ndarray, old: np.ndarray, new: np.ndarray, nbytes: int, itemsize: int
                      ) -> bytes | None:
        """The frame of an ``nbytes`` chunk that changed only at elements ``idx`` (sorted int64) from ``old`` to
        ``new`` (the device diff's output), in one GIL-free call; ``None`` where chunks are encoded block by
        block (the caller then builds the XOR blocks itself). Same frame bytes as :meth:`encode` of the XOR."""
        if not self._one_call():
            return None
        if itemsize not in LANES or nbytes % itemsize:
            raise FormatError(f"a chunk of {nbytes} bytes is not whole elements of {itemsize} bytes")
        st = self._state()
        out, head_len = _frame_buffer(nbytes)
        end, status = seq_delta.encode_sparse_chunk(idx, old, new, nbytes, itemsize, st.xor, st.seqs, st.dst,
                                                    st.cctx, MIN_RUN, out, head_len)
        return _finish(st, out, end, status)

    def _append(self, st: _ThreadState, x: np.ndarray, out: bytearray) -> int:
        ptr = x.ctypes.data
        if ptr % 8:
            st.aligned[:x.size] = x
            x = st.aligned[:x.size]
            ptr = st.aligned_ptr
        k = zero_run_sequences(x, x[:x.size // 8 * 8].view(np.uint64), st.seqs, MIN_RUN, _TABLE)
        rc = st.check(self.lib.ZSTD_compressSequences(st.cctx, st.dst_ptr, st.dst.size, st.seqs_ptr, k, ptr, x.size),
                      "compressing sequences")
        head = seq_delta._single_block(st.dst, rc)
        if head == -2:
            raise FormatError(_BAD_FRAME)
        at = len(out)
        if head >= 0:
            out += st.dst[head:rc].data
        else:  # libzstd split it: store the block raw instead, which leaves the decoder's state untouched
            out += ((x.size << 3) | 1).to_bytes(3, "little")
            out += x.data
        return at


def _frame_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    """Room for a one-call frame of ``nbytes`` of content (at worst every block raw), its header written."""
    head = frame_header(nbytes)
    out = np.empty(len(head) + nbytes + 3 * (nbytes // MAX_BLOCK + 1), dtype=np.uint8)
    out[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    return out, len(head)


def _finish(st: _ThreadState, out: np.ndarray, end: int, status: int) -> bytes:
    """The frame a compiled call wrote, or its status as an error."""
    if status == seq_delta.ZSTD_FAILED:
        st.check(int(end) & 0xFFFFFFFFFFFFFFFF, "compressing sequences")
    if status == seq_delta.BAD_INPUT:
        raise FormatError("sparse delta positions are not increasing, or fall outside the chunk")
    if status:
        raise FormatError(_BAD_FRAME)
    return out[:end].tobytes()


_ENCODER: SequenceEncoder | None = None
_REASON = ""
_LOCK = threading.Lock()
_LOADED = False


def _self_test(enc: SequenceEncoder) -> str:
    import zstandard

    rng = np.random.default_rng(7)
    data = np.zeros(3 * MAX_BLOCK + 1234, dtype=np.uint8)
    hits = rng.integers(0, data.size, size=data.size // 40)
    data[hits] = rng.integers(1, 256, size=hits.size, dtype=np.uint8)
    data[:5] = 9
    data[-3000:] = 0
    frame = enc.encode([data[:MAX_BLOCK + 10], data[MAX_BLOCK + 10:]], data.size)
    back = zstandard.ZstdDecompressor().decompress(frame, max_output_size=data.size)
    return "" if back == data.tobytes() else "self-test round trip differs"


def sequence_encoder(level: int = 1) -> SequenceEncoder | None:
    """The process's sequence encoder, or ``None`` (the reason is in :func:`encoder_status`)."""
    global _ENCODER, _REASON, _LOADED
    with _LOCK:
        if not _LOADED:
            _LOADED = True
            if sys.byteorder != "little":
                _REASON = "the zero-run kernel reads little-endian words"
            else:
                lib, _REASON = _load_libzstd()
                if lib is not None:
                    enc = SequenceEncoder(lib)
                    try:
                        failed = _self_test(enc)
                    except Exception as exc:  # noqa: BLE001 - any failure means: use the stream encoder
                        failed = f"self-test failed: {exc!r}"
                    if failed:
                        _REASON = f"{_REASON}: {failed}"
                    else:
                        _ENCODER = enc
    if _ENCODER is None:
        return None
    if level == _ENCODER.level:
        return _ENCODER
    return SequenceEncoder(_ENCODER.lib, level)


_ONE_CALL: bool | None = None  # decided once per process, at the first delta (see one_call_status)
_ONE_CALL_REASON = ""


def one_call_allowed() -> bool:
    """False where ``HOTLOAD_ARC_ONE_CALL=0`` turns the one-call path off. Any value but ``0`` and ``1`` is a
    FormatError naming the variable: only ``0`` turned it off, so ``false`` or ``off`` kept it on in silence."""
    value = os.environ.get("HOTLOAD_ARC_ONE_CALL", "1").strip()
    if value not in ("0", "1"):
        raise FormatError(f"HOTLOAD_ARC_ONE_CALL={value!r}: expected 0 (encode block by block) or 1 (one compiled "
                          "call per chunk, the default)")
    return value == "1"


def one_call_status() -> tuple[bool, str]:
    """Whether delta chunks are encoded in one compiled call (:mod:`~fsdp_hotload.arc.seq_delta`), and why not.

    Decided once, at the first use: that call loads the kernel, or compiles it (seconds without numba's disk
    cache), so it is not made where the codec is built but by the publisher's warm-up thread (``ArcV2.warm_up``)
    or the first delta. The kernel is used only if its frame equals the block path's on a sample.
    ``HOTLOAD_ARC_ONE_CALL=0`` turns it off.
    """
    global _ONE_CALL, _ONE_CALL_REASON
    enc = sequence_encoder()
    with _LOCK:
        if _ONE_CALL is None:
            if enc is None:
                _ONE_CALL, _ONE_CALL_REASON = False, "block by block (no sequence encoder)"
            elif not one_call_allowed():
                _ONE_CALL, _ONE_CALL_REASON = False, "block by block (HOTLOAD_ARC_ONE_CALL=0)"
            else:
                _ONE_CALL, _ONE_CALL_REASON = _try_one_call(enc.lib)
    return _ONE_CALL, _ONE_CALL_REASON


def _try_one_call(lib: Any) -> tuple[bool, str]:
    rng = np.random.default_rng(11)
    parent = rng.integers(0, 256, size=2 * MAX_BLOCK + 4098, dtype=np.uint8)
    new = parent.copy()
    hits = rng.integers(0, new.size, size=new.size // 50)
    new[hits] ^= rng.integers(1, 256, size=hits.size, dtype=np.uint8)
    tables = run_tables([(0, new.size // 2)], 2)
    try:
        clash = seq_delta.expose_library(lib)
        if clash:
            return False, f"block by block ({clash})"
        want = SequenceEncoder(lib, one_call=False).encode_delta(parent, new, 2, tables, new.size)
        got = SequenceEncoder(lib, one_call=True).encode_delta(parent, new, 2, tables, new.size)
        # the sparse call on the same change, as the device diff hands it over
        a, b = parent.view(np.uint16), new.view(np.uint16)
        idx = np.flatnonzero(a != b).astype(np.int64)
        sparse = SequenceEncoder(lib, one_call=True).encode_sparse(idx, a[idx], b[idx], new.size, 2)
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the block path
        return False, f"block by block (one call per chunk failed: {exc!r})"
    if got != want or sparse != want[0]:
        return False, "block by block (one call per chunk differs from it)"
    return True, "one call per chunk"


def encoder_status() -> str:
    """Which library the sequence encoder uses, or why :func:`sequence_encoder` returns ``None``."""
    sequence_encoder()
    return _REASON
