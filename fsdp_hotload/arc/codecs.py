"""Codecs: how one chunk's change against its parent becomes payload bytes, and back.

A codec sees one chunk at a time as raw bytes in box C order, never a container or a file, so new codecs plug
in without touching the container. Encoding starts from an :class:`ElementDiff` (the changed element positions
with their old and new values), because that is what a device-side diff pulls to the host: the dense bytes of
an unchanged tensor never leave the device. Decoding writes the new chunk bytes into a caller-owned buffer and
must bound every allocation by the size the caller expects (payloads are untrusted).

Example::

    codec = get_codec("arc_v2")
    payload = codec.encode(element_diff(parent_bytes, new_bytes, itemsize=2))
    out = np.empty_like(parent_bytes)
    codec.decode(payload, parent_bytes, 2, out)
    assert (out == new_bytes).all()
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np
import zstandard

from .dense import BLOCK_BYTES, DenseDelta, run_tables
from .dtypes import UINT_BY_SIZE
from .errors import FormatError
from .kernels import diff_positions, scatter_xor
from .zstd_seq import encoder_status, one_call_allowed, one_call_status, sequence_encoder


@dataclass(frozen=True)
class ElementDiff:
    """The changed elements of one chunk: sorted positions plus old and new values as unsigned integers."""

    n: int  # elements in the chunk
    itemsize: int  # bytes per element (1, 2, 4 or 8)
    idx: np.ndarray  # int64, strictly increasing, < n
    old: np.ndarray  # uint{8*itemsize}, parent values at idx
    new: np.ndarray  # uint{8*itemsize}, new values at idx

    @property
    def changed(self) -> int:
        return int(self.idx.size)

    def check(self) -> None:
        """Validate shapes and dtypes (diffs can come from a device path; catch mistakes at the boundary)."""
        want = UINT_BY_SIZE.get(self.itemsize)
        if want is None:
            raise FormatError(f"unsupported element size {self.itemsize}")
        if self.idx.dtype != np.int64 or self.old.dtype != want or self.new.dtype != want:
            raise FormatError("ElementDiff arrays have the wrong dtypes")
        if not (self.idx.shape == self.old.shape == self.new.shape) or self.idx.ndim != 1:
            raise FormatError("ElementDiff arrays differ in length")


def element_diff(parent: np.ndarray, new: np.ndarray, itemsize: int) -> ElementDiff:
    """Host-side diff of two chunks given as flat uint8 byte arrays of equal length (numba, GIL released)."""
    if parent.shape != new.shape or parent.dtype != np.uint8 or new.dtype != np.uint8:
        raise FormatError("element_diff needs two flat uint8 arrays of equal length")
    u = UINT_BY_SIZE[itemsize]
    a = np.ascontiguousarray(parent).view(u)
    b = np.ascontiguousarray(new).view(u)
    idx = diff_positions(a, b)
    return ElementDiff(int(a.size), itemsize, idx, a[idx], b[idx])


class Codec(Protocol):
    """What a chunk codec provides. ``name`` is recorded per tensor in the container."""

    name: str

    def encode(self, diff: ElementDiff) -> bytes:
        """Payload bytes for one chunk's change."""
        ...

    def decode(self, payload: bytes, parent: np.ndarray, itemsize: int, out: np.ndarray) -> None:
        """Write the new chunk bytes into ``out`` (flat uint8, same length as ``parent``).

        Raise FormatError for any malformed payload; never allocate more than ``len(parent)`` bytes of output.
        """
        ...


_REGISTRY: dict[str, Callable[[], Codec]] = {}


def register_codec(name: str, factory: Callable[[], Codec]) -> None:
    """Make a codec available by name (used by the container on read, and by config on write)."""
    _REGISTRY[name] = factory


def get_codec(name: str) -> Codec:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise FormatError(f"unknown codec {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None
    return factory()


def codec_names() -> list[str]:
    return sorted(_REGISTRY)


ZSTD_WINDOW_FLOOR = 1 << 23  # 8 MiB: the largest window of zstd levels 1-19 (levels 20-22 and --long go higher)


def zstd_window_limit(size: int) -> int:
    """The largest window a frame of ``size`` content bytes may declare: ``size`` rounded up to a power of two, and
    never less than 8 MiB.

    The decoder reserves the declared window before it sees any content, and libzstd alone would accept up to
    128 MiB for a one-byte chunk. A frame never needs more than its content, but an encoder that streams without
    knowing the size declares its level's window (up to 8 MiB for levels 1-19); such frames are valid arc_v2
    payloads from other writers, so the bound never goes below that.
    """
    return min(max(1 << max(size - 1, 0).bit_length(), ZSTD_WINDOW_FLOOR), 1 << zstandard.WINDOWLOG_MAX)


def zstd_decompress_exact(payload: bytes, size: int, what: str = "payload") -> bytes:
    """Decompress a payload that must be exactly one zstd frame whose content is exactly ``size`` bytes.

    The frame header's declared size and window are checked before anything is allocated, so a hostile header
    cannot make us allocate or reserve more than the chunk we expect. Nothing may follow the frame: not a second
    frame, not padding.
    """
    if bytes(payload[:4]) != zstandard.FRAME_HEADER:
        raise FormatError(f"{what} is not a zstd frame (no frame magic)")
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what} is not a zstd frame: {exc}") from None
    declared = params.content_size
    if declared not in (size, zstandard.CONTENTSIZE_UNKNOWN):
        raise FormatError(f"{what} declares {declared} bytes, {size} expected")
    limit = zstd_window_limit(size)
    if params.window_size > limit:
        raise FormatError(f"{what} declares a {params.window_size}-byte window, more than its {size} bytes need "
                          f"(at most {limit})")
    dctx = zstandard.ZstdDecompressor(max_window_size=limit)
    if declared == size and size:
        try:
            return _exact(dctx.decompress(payload, allow_extra_data=False), size, what)
        except zstandard.ZstdError as exc:
            try:  # decoding it again, with bytes after the frame allowed, tells those apart from a bad frame
                _exact(dctx.decompress(payload), size, what)
            except zstandard.ZstdError:
                raise FormatError(f"{what} is corrupt: {exc}") from None
            raise FormatError(f"{what} has bytes after its zstd frame (a payload is exactly one frame)") from None
    try:
        if declared != 0:
            # No content size: a buffer of size + 1 bounds the output and tells a frame one byte too long.
            _exact(dctx.decompress(payload, max_output_size=size + 1), size, what)
        # The frame now decodes to `size` bytes (libzstd holds a frame to its declared size, here 0), so streaming
        # it is bounded too, and shows where it ends: decompress() returns b"" for a frame that declares 0 bytes
        # without reading it, and does not look for bytes after a frame without a content size.
        dobj = dctx.decompressobj(read_across_frames=False)
        out = dobj.decompress(payload)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{what} is corrupt, truncated or longer than {size} bytes: {exc}") from None
    if not dobj.eof:
        raise FormatError(f"{what} is a truncated zstd frame")
    if dobj.unused_data:
        raise FormatError(f"{what} has bytes after its zstd frame ({len(dobj.unused_data)}; a payload is exactly "
                          "one frame)")
    return _exact(out, size, what)


def _exact(out: bytes, size: int, what: str) -> bytes:
    if len(out) != size:
        raise FormatError(f"{what} decompresses to {len(out)} bytes, {size} expected")
    return out


class ArcV2:
    """``arc_v2``: XOR of the raw little-endian bytes against the parent, as one zstd frame per chunk.

    The frame records its content size. It is built from a stream of XOR blocks, so no chunk-sized XOR is ever
    made: :meth:`encode_xor_blocks` takes blocks straight from a one-pass host scan
    (:class:`~fsdp_hotload.arc.dense.DenseDelta`), and :meth:`encode` rebuilds them from a sparse diff (the
    device path: zeros plus the changed elements; with the sequence encoder in one GIL-free call per chunk,
    :func:`~fsdp_hotload.arc.seq_delta.encode_sparse_chunk`). An unchanged chunk costs a few bytes. The one-call
    path reserves room for the worst frame (every block stored raw: the chunk's size) and writes only the frame
    into it, so the memory it touches is the frame's; the reservation itself is virtual memory, which a host with
    strict overcommit (``vm.overcommit_memory=2``) counts in full, per encode thread.

    Two encoders write the frame: ``sequences`` (zero runs found by a numba kernel, entropy-coded by libzstd;
    smaller and cheaper, see :mod:`~fsdp_hotload.arc.zstd_seq`) where the system's libzstd allows it, else
    ``stream`` (python-zstandard's level-1 compressor). Both decode to the same bytes with any zstd decoder.
    ``encoder="auto"`` (the default) takes the first available; ``HOTLOAD_ARC_ENCODER`` overrides the default.

    Example::

        codec = ArcV2()
        parent, new = old_bf16.view(np.uint8), new_bf16.view(np.uint8)   # one chunk's bytes, same length
        payload = codec.encode_xor_blocks([np.bitwise_xor(parent, new)], parent.size)
        out = np.empty_like(parent)
        codec.decode(payload, parent, 2, out)                            # out equals new, byte for byte
    """

    name = "arc_v2"
    block_bytes = BLOCK_BYTES

    def __init__(self, level: int = 1, encoder: str | None = None) -> None:
        # level 3 gains nothing on XOR data and is ~10% slower
        self.level = level
        self._choice = encoder
        if encoder is not None:  # an explicit choice is checked at once; the environment's when first encoding
            self._choose()

    def __getattr__(self, name: str) -> Any:
        """The encoder is chosen when first needed: decoding never reads ``HOTLOAD_ARC_ENCODER``, so a setting
        that only encoders care about (a typo, ``sequences`` on a host without libzstd 1.5) cannot fail it."""
        if name in ("_seq", "encoder", "encoder_info"):
            self._choose()
            return object.__getattribute__(self, name)
        raise AttributeError(name)

    def _choose(self) -> None:
        encoder, level = self._choice, self.level
        choice = encoder or os.environ.get("HOTLOAD_ARC_ENCODER", "auto")
        if choice not in ("auto", "sequences", "stream"):
            source = "" if encoder else " (HOTLOAD_ARC_ENCODER)"
            raise FormatError(f"arc_v2 encoder {choice!r}{source}: expected auto, sequences or stream")
        one_call_allowed()  # the other switch, checked here too: the first delta would fail in the background
        self._seq = sequence_encoder(level) if choice != "stream" else None
        if choice == "sequences" and self._seq is None:
            raise FormatError(f"arc_v2 encoder 'sequences' is unavailable: {encoder_status()}")
        self.encoder = "sequences" if self._seq is not None else "stream"
        if self._seq is not None:
            self.encoder_info = f"sequences via {encoder_status()}"
        elif choice == "stream":
            self.encoder_info = "stream (chosen)"
        else:
            self.encoder_info = f"stream (sequence encoder unavailable: {encoder_status()})"

    def encode_xor_blocks(self, blocks: Iterable[Any], nbytes: int) -> bytes:
        """One frame from XOR blocks that add up to ``nbytes`` (each consumed before the next is produced)."""
        if self._seq is not None:
            return self._seq.encode(blocks, nbytes)
        cobj = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compressobj(size=nbytes)
        out = [cobj.compress(blk) for blk in blocks]
        out.append(cobj.flush())
        return b"".join(out)

    def encode_delta(self, parent: np.ndarray, new: np.ndarray, itemsize: int,
                     tables: tuple[np.ndarray, np.ndarray], total: int) -> tuple[bytes, int, tuple[int, int]]:
        """A host chunk's payload straight from its parent and new bytes (flat uint8), with its changed elements
        and Adler-32 share delta; ``tables`` and ``total`` as for :class:`~fsdp_hotload.arc.dense.DenseDelta`.
        The sequence encoder does it in one GIL-free call (:mod:`~fsdp_hotload.arc.seq_delta`)."""
        if self._seq is not None:
            return self._seq.encode_delta(parent, new, itemsize, tables, total)
        scan = DenseDelta(parent, new, itemsize, tables, total)
        return self.encode_xor_blocks(scan.blocks(), parent.size), scan.changed, scan.parts_delta

    def warm_up(self) -> None:
        """Load, or compile on a cold numba cache, everything :meth:`encode_delta` runs, and decide its path."""
        x = np.zeros(64, dtype=np.uint8)
        self.encode_delta(x, x, 2, run_tables([(0, 32)], 2), x.size)

    def delta_path(self) -> str:
        """How :meth:`encode_delta` works in this process (decided, and compiled, when first needed)."""
        return one_call_status()[1] if self._seq is not None else "block by block (stream encoder)"

    def encode(self, diff: ElementDiff) -> bytes:
        diff.check()
        if self._seq is not None:  # one GIL-free call per chunk where the sequence encoder has it
            frame = self._seq.encode_sparse(diff.idx, diff.old, diff.new, diff.n * diff.itemsize, diff.itemsize)
            if frame is not None:
                return frame
        _check_positions(diff)
        return self.encode_xor_blocks(_xor_blocks_from_diff(diff, self.block_bytes), diff.n * diff.itemsize)

    def decode(self, payload: bytes, parent: np.ndarray, itemsize: int, out: np.ndarray) -> None:
        raw = zstd_decompress_exact(payload, parent.size, "arc_v2 payload")
        np.bitwise_xor(parent, np.frombuffer(raw, dtype=np.uint8), out=out)


def _check_positions(diff: ElementDiff) -> None:
    """Refuse positions that are not strictly increasing or fall outside the chunk, as the one-call kernel does.

    Why: positions come from a device diff, and :func:`_xor_blocks_from_diff` trusts them: the numba scatter does
    not check bounds (position ``n`` of a partial last block is written past the block buffer), and the others
    would be dropped or misplaced, giving a frame that decodes to bytes the trainer never had.
    """
    idx = diff.idx
    if idx.size and (idx[0] < 0 or idx[-1] >= diff.n or not bool(np.all(idx[1:] > idx[:-1]))):
        raise FormatError("sparse delta positions are not increasing, or fall outside the chunk")


def _xor_blocks_from_diff(diff: ElementDiff, block_bytes: int) -> Iterator[memoryview]:
    per = max(block_bytes // diff.itemsize, 1)
    buf = np.empty(min(per, max(diff.n, 1)), dtype=UINT_BY_SIZE[diff.itemsize])
    bounds = np.searchsorted(diff.idx, np.arange(0, diff.n + per, per, dtype=np.int64))
    for k, s in enumerate(range(0, diff.n, per)):
        e = min(diff.n, s + per)
        blk = buf[:e - s]
        blk[:] = 0
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        if hi > lo:
            scatter_xor(blk, diff.idx[lo:hi] - s, diff.old[lo:hi], diff.new[lo:hi])
        yield blk.view(np.uint8).data


register_codec("arc_v2", ArcV2)
