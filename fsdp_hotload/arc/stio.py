"""Strict safetensors reading and streaming writing.

We parse safetensors ourselves instead of through the ``safetensors`` package for two reasons: every byte we
read from a bucket is untrusted and each bound must be checked with an error that names the file and tensor,
and the publisher writes multi-GB files piece by piece without assembling them in memory. The layout is the
public safetensors one (8-byte little-endian header length, JSON header padded with spaces to 8 bytes, packed
data), and tests check that the ``safetensors`` package reads what we write and vice versa.

Example::

    blob = save_file({"w": RawTensor.from_any(np.ones(3, np.float32))}, {"note": "x"})
    tensors = load_file(blob, filename="model-00001.safetensors")
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Mapping, Sequence

import numpy as np

from .dtypes import DTYPES, RawTensor, check_shape, numel
from .errors import FormatError

MAX_HEADER_BYTES = 100_000_000  # the safetensors reference reader refuses longer headers (MAX_HEADER_SIZE)
#: ``__metadata__`` key of the checksums of a full snapshot's file: each tensor's Adler-32 (as arc_v2 checks a
#: delta's tensors), 8 hex digits per tensor, in the order of the tensors' data. Why: a full snapshot had no
#: checksum anywhere, so a bit flipped in storage or in transit was served, and blamed on the next delta. Other
#: readers ignore the key (safetensors metadata is a free string map).
CHECKSUM_KEY = "hotload_adler32"


@dataclass(frozen=True)
class Entry:
    """One tensor's header entry: name, dtype code, shape and byte range inside the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    entries: dict[str, Entry]  # in data order
    metadata: dict[str, str]
    data_start: int  # offset of the data section inside the file


def parse_json(text: bytes | str, what: str, *, file: str | None = None) -> Any:
    """``json.loads`` of untrusted text (bytes must be UTF-8), where every failure is a FormatError naming ``what``.

    Besides malformed JSON, the decoder raises RecursionError on deeply nested arrays or objects and a plain
    ValueError on an integer longer than Python's digit limit; callers only expect format errors.
    """
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except RecursionError:
        raise FormatError(f"{what} is not JSON we read: nested too deeply", file=file) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the integer digit limit
        raise FormatError(f"{what} is not JSON: {exc}", file=file) from None


def parse_header(data: bytes | memoryview, *, filename: str = "<bytes>", total_size: int | None = None) -> Header:
    """Parse and check a safetensors header. ``data`` needs only the header bytes when ``total_size`` is given."""
    size = len(data) if total_size is None else total_size
    if size < 8 or len(data) < 8:
        raise FormatError("file is shorter than the 8-byte header length", file=filename)
    hlen = int.from_bytes(bytes(data[:8]), "little")
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size or 8 + hlen > len(data):
        raise FormatError(f"header length {hlen} exceeds the file ({size} bytes): not a safetensors file, or one "
                          "cut short", file=filename)
    raw = parse_json(bytes(data[8:8 + hlen]), "header", file=filename)
    if not isinstance(raw, dict):
        raise FormatError("header is not a JSON object", file=filename)
    meta = raw.pop("__metadata__", None)  # absent or null: none; [], 0 or "" are not a mapping
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise FormatError("__metadata__ must map strings to strings", file=filename)
    entries: list[Entry] = []
    for name, info in raw.items():
        if not isinstance(info, dict):
            raise FormatError("header entry is not an object", file=filename, tensor=name)
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
        if missing:  # a flipped bit in a key name reads as a missing key, not as a bad value None
            raise FormatError(f"header entry lacks {', '.join(missing)} (a damaged header?)", file=filename,
                              tensor=name)
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(f"unsupported dtype {dtype!r}", file=filename, tensor=name)
        try:
            shape = check_shape(shape, dtype)
        except FormatError as exc:
            raise exc.at(file=filename, tensor=name) from None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise FormatError(f"bad data_offsets {offs!r}", file=filename, tensor=name)
        begin, end = offs
        want = numel(shape) * DTYPES[dtype][0]
        if end < begin or end - begin != want:
            raise FormatError(f"data_offsets {offs} hold {end - begin} bytes, shape needs {want}", file=filename,
                              tensor=name)
        entries.append(Entry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise FormatError(f"data_offsets start at {e.begin}, expected {pos} (gap or overlap)", file=filename,
                              tensor=e.name)
        pos = e.end
    data_start = 8 + hlen
    if data_start + pos != size:
        raise FormatError(f"data section is {size - data_start} bytes, header describes {pos}", file=filename)
    return Header({e.name: e for e in entries}, dict(meta), data_start)


def checksum_text(sums: Sequence[int]) -> str:
    """The :data:`CHECKSUM_KEY` value for tensors whose Adler-32 sums are ``sums``, in data order."""
    return "".join(f"{s & 0xFFFFFFFF:08x}" for s in sums)


def check_checksums(header: Header, data: bytes | memoryview, *, filename: str = "<bytes>",
                    required: bool = False) -> bool:
    """Check every tensor of a full file against :data:`CHECKSUM_KEY`; False where the file has none (a file this
    library did not write), which ``required`` refuses. A mismatch raises a FormatError naming the tensor."""
    text = header.metadata.get(CHECKSUM_KEY)
    if text is None:
        if required:
            raise FormatError(f"__metadata__ has no {CHECKSUM_KEY!r} (the checksums every full snapshot file this "
                              "library writes carries): the header was damaged, or another tool wrote the file",
                              file=filename)
        return False
    entries = list(header.entries.values())
    if len(text) != 8 * len(entries) or not all(c in "0123456789abcdef" for c in text):
        raise FormatError(f"__metadata__[{CHECKSUM_KEY!r}] is not 8 hex digits for each of the {len(entries)} "
                          "tensors", file=filename)
    view = memoryview(data)
    for i, e in enumerate(entries):
        got = zlib.adler32(view[header.data_start + e.begin:header.data_start + e.end]) & 0xFFFFFFFF
        if got != int(text[8 * i:8 * i + 8], 16):
            raise FormatError(f"Adler-32 {got:08x} differs from the file's checksum {text[8 * i:8 * i + 8]}: its "
                              "bytes changed after it was written (storage or transfer)", file=filename, tensor=e.name)
    return True


def load_file(data: bytes | memoryview, *, filename: str = "<bytes>",
              require_checksums: bool = False) -> dict[str, RawTensor]:
    """All tensors of a safetensors blob as RawTensors viewing ``data`` (no copy); their checksums are checked
    where the file has them (see :func:`check_checksums`)."""
    header = parse_header(data, filename=filename)
    check_checksums(header, data, filename=filename, required=require_checksums)
    buf = np.frombuffer(data, dtype=np.uint8)
    out: dict[str, RawTensor] = {}
    for e in header.entries.values():
        a = header.data_start + e.begin
        out[e.name] = RawTensor(e.dtype, e.shape, buf[a:a + e.nbytes])
    return out



def data_order(dtypes: Mapping[str, str]) -> list[str]:
    """The order to write tensors ``{name: dtype code}`` in: largest item size first, the given order otherwise.

    Why: the header is padded to 8 bytes, so with this order every tensor starts at a multiple of its own item
    size (the reference safetensors writer orders by dtype for the same reason). Readers that view the file's
    bytes as typed arrays without copying (memory maps, ``torch.frombuffer``) need that; one F32 tensor after a
    BF16 tensor of odd length would otherwise start at an unaligned offset. Files of one dtype keep their order.
    """
    return sorted(dtypes, key=lambda name: -DTYPES[dtypes[name]][0])


def json_entry(key: str, value: object, sort_keys: bool = False) -> str:
    """``"key":value`` as ``json.dumps`` of a dict holding it writes it (compact separators)."""
    return json.dumps(key) + ":" + json.dumps(value, separators=(",", ":"), sort_keys=sort_keys)


def build_header(items: Sequence[tuple[str, str, Sequence[int], int]], metadata: Mapping[str, str] | None) -> bytes:
    """Header bytes (length prefix included) for tensors ``(name, dtype, shape, nbytes)`` written in that order.

    The order must keep every tensor aligned to its item size (use :func:`data_order`); a FormatError names the
    first tensor that would not be.
    """
    # Each entry is written out as it is checked, not kept as a dict until one json.dumps of them all: a file of
    # thousands of tensors then held a few objects per tensor, which lived long enough to reach the garbage
    # collector's oldest generation and set off full collections (they hold the GIL) on the publisher's threads.
    entries: list[str] = []
    if metadata:
        entries.append(json_entry("__metadata__", {str(k): str(v) for k, v in metadata.items()}))
    names: set[str] = set()
    pos = 0
    for name, dtype, shape, nbytes in items:
        if name == "__metadata__":  # readers take this key for the string map, with or without metadata here
            raise FormatError("'__metadata__' is reserved by safetensors and cannot name a tensor", tensor=name)
        if name in names:
            raise FormatError("duplicate tensor name", tensor=name)
        names.add(name)
        if dtype not in DTYPES:
            raise FormatError(f"unsupported dtype {dtype!r}", tensor=name)
        try:  # a shape that parse_header would refuse: every reader of ours would refuse the file
            check_shape([int(s) for s in shape], dtype)
        except FormatError as exc:
            raise exc.at(tensor=name) from None
        if pos % DTYPES[dtype][0]:
            raise FormatError(f"{dtype} data would start at byte {pos} of the data section, not a multiple of its "
                              f"item size; write tensors in data_order()", tensor=name)
        entries.append(json_entry(name, {"dtype": dtype, "shape": [int(s) for s in shape],
                                     "data_offsets": [pos, pos + int(nbytes)]}))
        pos += int(nbytes)
    text = ("{" + ",".join(entries) + "}").encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:  # no reader would load the file
        raise FormatError(f"header of {len(items)} tensors is {len(text)} bytes, more than safetensors reads "
                          f"({MAX_HEADER_BYTES}); put fewer tensors in one file")
    return len(text).to_bytes(8, "little") + text


def write_file(out: BinaryIO, tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None = None, *,
               checksums: bool = True) -> int:
    """Stream a safetensors file to ``out``; returns bytes written. Tensors are written in :func:`data_order`, with
    their checksums (:data:`CHECKSUM_KEY`, computed here) unless ``checksums`` is False; one in ``metadata`` is
    never written as given (it would not match)."""
    names = data_order({n: t.dtype for n, t in tensors.items()})
    meta = {k: v for k, v in (metadata or {}).items() if k != CHECKSUM_KEY}
    if checksums:
        meta[CHECKSUM_KEY] = checksum_text([zlib.adler32(tensors[n].data) for n in names])
    header = build_header([(n, tensors[n].dtype, tensors[n].shape, tensors[n].nbytes) for n in names], meta)
    out.write(header)
    total = len(header)
    for t in (tensors[n] for n in names):
        out.write(memoryview(t.data))
        total += t.nbytes
    return total


def save_file(tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors blob in memory (for small files and tests; prefer :func:`write_file` for large ones)."""
    import io

    bio = io.BytesIO()
    write_file(bio, {n: RawTensor.from_any(t) for n, t in tensors.items()}, metadata)
    return bio.getvalue()

