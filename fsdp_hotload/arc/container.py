"""The delta file: a safetensors container of per-tensor encoded deltas, and its decoder.

A delta file has the same name and tensor set as the parent file it applies to. Each tensor is stored as a
``U8`` vector holding its chunk payloads back to back; the header's string metadata records, per tensor, the
original dtype and shape, the Adler-32 of the reconstructed bytes, the codec and the chunk table (the box of
each chunk, the byte range of its payload and that payload's CRC-32). docs/FORMAT.md pins the layout byte for byte.

Example::

    blob = encode_delta_file(parent, new, parent_identity="step-000010-ab12cd34")
    rebuilt = apply_delta_file(parent, blob, filename="model-00001-of-00003.safetensors",
                               expected_parent="step-000010-ab12cd34")
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from .adler import combine
from .boxes import Box, check_tiling, gather, scatter
from .codecs import codec_names, element_diff, get_codec
from .dtypes import RawTensor, check_shape, numel
from .errors import ArcError, ChecksumError, FormatError, MismatchError
from .stio import Header, build_header, json_entry, parse_header, parse_json

FORMAT_NAME = "hotload-arc"
FORMAT_VERSION = "1"
CHECKSUM_FORMAT = "alder32"  # sic: the token the Fireworks API uses for Adler-32
K_FORMAT, K_VERSION, K_KIND = "format", "format_version", "kind"
K_PARENT, K_COMPRESSION, K_CHECKSUM, K_TENSORS = (
    "previous_snapshot_identity", "compression_format", "checksum_format", "arc_tensors")
SPACES = ("flat", "shape")
_CHUNK_KEYS = frozenset({"start", "length", "offset", "size", "crc32"})


@dataclass
class TensorDelta:
    """One tensor of a delta file: its identity, its checksum, and its encoded chunks."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    adler32: int
    codec: str
    space: str = "flat"
    # (box, payload bytes) when built for writing; (box, (offset, size, crc32 or None)) into the stored payload
    # when read
    chunks: list[tuple[Box, Any]] = field(default_factory=list)

    @property
    def space_shape(self) -> tuple[int, ...]:
        return (numel(self.shape),) if self.space == "flat" else tuple(self.shape)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the encoded chunks. A delta read by :func:`read_delta_info` holds ``(offset, size, crc32)``
        ranges instead of payloads (which it does not load): their sizes count, not the length of each tuple."""
        return sum(p[1] if isinstance(p, tuple) else len(p) for _, p in self.chunks)


def _check_space(space: str, where: dict[str, str]) -> None:
    if space not in SPACES:
        raise FormatError(f"chunk space {space!r} is not one of {SPACES}", **where)


def delta_header(tensors: Iterable[TensorDelta], *, parent_identity: str,
                 extra_metadata: Mapping[str, str] | None = None) -> bytes:
    """Header bytes of a delta file; checks that each tensor's chunks tile it exactly."""
    return _delta_header(tensors, parent_identity, extra_metadata, None)


def _delta_header(tensors: Iterable[TensorDelta], parent_identity: str, extra_metadata: Mapping[str, str] | None,
                  payloads: list[bytes | np.ndarray] | None) -> bytes:
    """:func:`delta_header`, reading ``tensors`` once and appending their payloads to ``payloads`` in file order.

    Why once, and the table written out tensor by tensor (the same bytes as one ``json.dumps(table,
    sort_keys=True)``): a publisher hands in a generator, so that no object per tensor outlives that tensor's entry
    here; held for a whole file of thousands of tensors, such objects reach the garbage collector's oldest
    generation and set off full collections, which hold the GIL, on the publisher's threads."""
    table: dict[str, str] = {}
    items = []
    codecs: set[str] = set()
    for t in tensors:
        _check_space(t.space, {"tensor": t.name})
        try:
            check_shape(list(t.shape), t.dtype)  # as read_delta_info will
            check_tiling([b for b, _ in t.chunks], t.space_shape)
        except ArcError as exc:
            raise exc.at(tensor=t.name) from None
        chunks, pos = [], 0
        for box, payload in t.chunks:
            chunks.append({**box.to_json(), "offset": pos, "size": len(payload), "crc32": zlib.crc32(payload)})
            pos += len(payload)
            if payloads is not None:
                payloads.append(payload)
        table[t.name] = json_entry(t.name, {"dtype": t.dtype, "shape": list(t.shape), "adler32": int(t.adler32),
                                            "codec": t.codec, "space": t.space, "chunks": chunks}, sort_keys=True)
        items.append((t.name, "U8", (pos,), pos))
        codecs.add(t.codec)
    meta = {K_FORMAT: FORMAT_NAME, K_VERSION: FORMAT_VERSION, K_KIND: "delta", K_PARENT: parent_identity,
            K_COMPRESSION: codecs.pop() if len(codecs) == 1 else "mixed", K_CHECKSUM: CHECKSUM_FORMAT,
            K_TENSORS: "{" + ",".join(table[name] for name in sorted(table)) + "}"}
    if extra_metadata:
        meta.update({k: v for k, v in extra_metadata.items() if k not in meta})
    return build_header(items, meta)


def build_delta_file(tensors: Iterable[TensorDelta], *, parent_identity: str,
                     extra_metadata: Mapping[str, str] | None = None) -> bytes:
    """The whole delta file in memory (payloads are compressed, so this is small). ``tensors`` is read once, so a
    generator of them keeps no more than one tensor's objects alive at a time."""
    payloads: list[bytes | np.ndarray] = []
    header = _delta_header(tensors, parent_identity, extra_metadata, payloads)
    return b"".join([header, *payloads])


def encode_tensor(name: str, parent: RawTensor, new: RawTensor, codec: str = "arc_v2") -> TensorDelta:
    """One whole-tensor chunk (file-level encoding, when one process holds both versions)."""
    if parent.dtype != new.dtype or parent.shape != new.shape:
        raise MismatchError(f"{parent.dtype}{list(parent.shape)} -> {new.dtype}{list(new.shape)}: dtype and shape "
                            "must not change along a chain", tensor=name)
    payload = get_codec(codec).encode(element_diff(parent.data, new.data, new.itemsize))
    return TensorDelta(name, new.dtype, new.shape, new.adler32(), codec, "flat",
                       [(Box.flat(0, new.numel), payload)])


def encode_delta_file(parent: Mapping[str, Any], new: Mapping[str, Any], *, parent_identity: str,
                      codec: str = "arc_v2") -> bytes:
    """Delta file turning the tensors ``parent`` into ``new`` (numpy arrays, CPU torch tensors or RawTensors)."""
    missing, extra = sorted(set(parent) - set(new)), sorted(set(new) - set(parent))
    if missing or extra:
        raise MismatchError(f"tensor sets differ: only in parent {missing}, only in new {extra}")
    deltas = [encode_tensor(n, RawTensor.from_any(parent[n]), RawTensor.from_any(new[n]), codec) for n in new]
    return build_delta_file(deltas, parent_identity=parent_identity)


@dataclass(frozen=True)
class DeltaInfo:
    """What a delta file's header says, checked for internal consistency."""

    parent_identity: str
    compression_format: str
    tensors: dict[str, TensorDelta]  # chunks hold (box, (offset, size, crc32)) placeholders: payloads not read
    header: Header


def is_delta_file(data: bytes | memoryview, *, total_size: int | None = None) -> bool:
    """``data`` needs only the header bytes when ``total_size`` (the file's) is given."""
    try:
        return parse_header(data, total_size=total_size).metadata.get(K_FORMAT) == FORMAT_NAME
    except ArcError:
        return False


def read_delta_info(data: bytes | memoryview, *, filename: str = "<bytes>", total_size: int | None = None
                    ) -> DeltaInfo:
    """Parse and check a delta file's header and chunk tables (no payload is decoded): ``data`` needs only the
    header bytes when ``total_size`` (the file's) is given."""
    header = parse_header(data, filename=filename, total_size=total_size)
    meta = header.metadata
    where = {"file": filename}
    if meta.get(K_FORMAT) != FORMAT_NAME:
        raise FormatError(f"not a delta file (metadata format={meta[K_FORMAT]!r})" if K_FORMAT in meta
                          else f"not a delta file (its metadata has no {K_FORMAT!r} key)", **where)
    if meta.get(K_VERSION) != FORMAT_VERSION:
        raise FormatError(f"format_version {meta[K_VERSION]!r} is not supported (want {FORMAT_VERSION})"
                          if K_VERSION in meta else f"metadata lacks {K_VERSION} (want {FORMAT_VERSION})", **where)
    for key, want in ((K_KIND, "delta"), (K_CHECKSUM, CHECKSUM_FORMAT)):  # alder32: the protocol's spelling
        if meta.get(key) != want:
            raise FormatError(f"metadata {key}={meta.get(key)!r}, want {want!r}"
                              if key in meta else f"metadata lacks {key} (want {want!r})", **where)
    if not meta.get(K_PARENT):
        raise FormatError(f"metadata lacks {K_PARENT}, the snapshot the delta is made against", **where)
    if K_TENSORS not in meta:
        raise FormatError(f"metadata lacks {K_TENSORS}, the delta's tensor table", **where)
    table = parse_json(meta[K_TENSORS], "arc_tensors", file=filename)
    if not isinstance(table, dict):
        raise FormatError("arc_tensors is not an object", **where)
    if set(table) != set(header.entries):
        raise FormatError(f"arc_tensors names {sorted(set(table) ^ set(header.entries))} without stored data "
                          "(or the reverse)", **where)
    tensors: dict[str, TensorDelta] = {}
    for name, info in table.items():
        tw = {"file": filename, "tensor": name}
        try:
            tensors[name] = _parse_tensor(name, info, header.entries[name])
        except ArcError as exc:
            raise exc.at(**tw) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"bad tensor entry: {exc!r}", **tw) from None
    if K_COMPRESSION not in meta:  # every writer of ours sets it: a damaged key name, or a foreign writer
        raise FormatError(f"metadata lacks {K_COMPRESSION} (the codec a signal names)", **where)
    compression = meta[K_COMPRESSION]
    codecs = {t.codec for t in tensors.values()}
    if compression == "mixed":
        wrong = len(codecs) == 1
    else:  # a codec must be every tensor's (or known, with no tensors)
        wrong = codecs != {compression} if codecs else compression not in codec_names()
    if wrong:
        # a damaged or foreign header: what the fleet is told (the signal's compression_format) must be true
        raise FormatError(f"compression_format {compression!r} does not match the tensors' codecs "
                          f"({', '.join(sorted(codecs)) or 'no tensors'})", **where)
    return DeltaInfo(meta[K_PARENT], compression, tensors, header)


_TENSOR_KEYS = ("dtype", "shape", "adler32", "codec", "space")


def _parse_tensor(name: str, info: Any, entry: Any) -> TensorDelta:
    if not isinstance(info, dict):
        raise FormatError("tensor entry is not an object")
    missing = [k for k in _TENSOR_KEYS if k not in info]
    if missing:
        raise FormatError(f"tensor entry lacks {', '.join(missing)}")
    dtype, shape, adler, codec, space = (info[k] for k in _TENSOR_KEYS)
    shape = check_shape(shape, str(dtype))
    if type(adler) is not int or not 0 <= adler < 2**32:
        raise FormatError(f"bad adler32 {adler!r}")
    get_codec(str(codec))
    _check_space(str(space), {})
    if entry.dtype != "U8" or len(entry.shape) != 1:
        raise FormatError(f"payload is stored as {entry.dtype}{list(entry.shape)}, want a U8 vector")
    t = TensorDelta(name, str(dtype), shape, adler, str(codec), str(space))
    chunks = info.get("chunks")
    if not isinstance(chunks, list):
        raise FormatError("chunk table is not a list")
    pos = 0
    for c in chunks:
        box = Box.from_json(c)
        unknown = sorted(set(c) - _CHUNK_KEYS)
        if unknown:  # a corrupt key name ("crc22") must not read as a chunk written before chunks had a CRC-32
            raise FormatError(f"chunk entry has unknown keys {unknown}")
        off, size, crc = c.get("offset"), c.get("size"), c.get("crc32")
        if type(off) is not int or type(size) is not int or off != pos or size < 0:
            raise FormatError(f"chunk payload range offset={off!r} size={size!r} (expected offset {pos})")
        if "crc32" in c and (type(crc) is not int or not 0 <= crc < 2**32):  # absent: written before it was
            raise FormatError(f"bad chunk crc32 {crc!r}")
        pos += size
        t.chunks.append((box, (off, size, crc)))  # the payload range, not its bytes (see TensorDelta.chunks)
    if pos != entry.nbytes:
        raise FormatError(f"chunk payloads cover {pos} bytes of a {entry.nbytes}-byte payload")
    check_tiling([b for b, _ in t.chunks], t.space_shape)
    return t


def apply_tensor(t: TensorDelta, parent: RawTensor, payload: np.ndarray, *, filename: str) -> RawTensor:
    """Rebuild one tensor from its parent and its payload bytes, and verify its Adler-32."""
    where = {"file": filename, "tensor": t.name}
    if parent.dtype != t.dtype or tuple(parent.shape) != t.shape:
        raise MismatchError(f"delta is for {t.dtype}{list(t.shape)}, parent holds {parent.dtype}{list(parent.shape)}",
                            **where)
    size = parent.itemsize
    codec = get_codec(t.codec)
    out = np.empty(parent.nbytes, dtype=np.uint8)
    space = t.space_shape
    for i, (box, (off, n, *rest)) in enumerate(t.chunks):
        crc = rest[0] if rest else None  # None: a file written before chunks carried one
        frame = bytes(payload[off:off + n])
        # Before decoding: one flipped bit of a zstd frame can decode to bytes that change in +-32 pairs, which
        # keep the Adler-32 (found by fuzzing); a CRC-32 catches every error of up to 32 bits in the payload.
        if crc is not None and zlib.crc32(frame) != crc:
            raise ChecksumError(f"the payload of chunk {i} fails its CRC-32 (corrupt in storage or in transit)",
                                **where)
        base = gather(parent.data, box, space, size)
        piece = np.empty(box.numel * size, dtype=np.uint8)
        try:
            codec.decode(frame, np.ascontiguousarray(base), size, piece)
        except ArcError as exc:
            raise exc.at(**where) from None
        scatter(out, piece, box, space, size)
    rebuilt = RawTensor(t.dtype, t.shape, out)
    got = rebuilt.adler32()
    if got != t.adler32:
        # Every chunk that carries a CRC-32 passed it above: with all of them, the payload is intact and the
        # parent's tensor is what differs, and the operator should look at the parent, not at the delta.
        intact = all(len(c) > 2 and c[2] is not None for _, c in t.chunks)
        why = ("; every chunk's payload passed its CRC-32, so the parent's tensor is not the one the delta was made "
               "against (another snapshot, or corrupt)" if intact else
               "; a corrupt payload, or a parent other than the one the delta was made against")
        raise ChecksumError(f"Adler-32 of the rebuilt tensor is {got:#010x}, the encoder recorded "
                            f"{t.adler32:#010x}{why}", **where)
    return rebuilt


def apply_delta_file(parent: Mapping[str, Any], data: bytes | memoryview, *, filename: str = "<bytes>",
                     expected_parent: str | None = None) -> dict[str, RawTensor]:
    """Rebuild the tensors of one file from the parent file's tensors and a delta file; verify every checksum."""
    info = read_delta_info(data, filename=filename)
    if expected_parent is not None and info.parent_identity != expected_parent:
        raise MismatchError(f"delta was made against {info.parent_identity!r}, the parent here is "
                            f"{expected_parent!r}", file=filename)
    missing, extra = sorted(set(parent) - set(info.tensors)), sorted(set(info.tensors) - set(parent))
    if missing or extra:
        raise MismatchError(f"tensor sets differ: missing from delta {missing}, not in parent {extra}", file=filename)
    buf = np.frombuffer(data, dtype=np.uint8)
    out: dict[str, RawTensor] = {}
    for name in parent:  # the parent's order, so a rebuilt file is laid out like the original
        t = info.tensors[name]
        e = info.header.entries[name]
        a = info.header.data_start + e.begin
        out[name] = apply_tensor(t, RawTensor.from_any(parent[name]), buf[a:a + e.nbytes], filename=filename)
    return out


__all__ = ["TensorDelta", "DeltaInfo", "build_delta_file", "delta_header", "encode_tensor", "encode_delta_file",
           "is_delta_file", "read_delta_info", "apply_tensor", "apply_delta_file", "combine"]
