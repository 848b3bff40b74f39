"""Format layer: round trips, golden container bytes, strictness on corrupt input, Adler-32 parts."""
from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_hotload.arc import (Box, ChecksumError, FormatError, MismatchError, RawTensor, TensorDelta,
                              apply_delta_file, apply_tensor, build_delta_file, codec_names, element_diff,
                              encode_delta_file, get_codec, is_delta_file, load_file, read_delta_info, save_file)
from fsdp_hotload.arc.adler import add_parts, chunk_parts, combine, global_elements, segment_parts, update_parts
from fsdp_hotload.arc import boxes as boxes_mod
from fsdp_hotload.arc.boxes import check_tiling, gather, scatter
from fsdp_hotload.arc.codecs import ArcV2, zstd_decompress_exact, zstd_window_limit
from fsdp_hotload.arc.dense import DenseDelta, box_run_tables, run_tables
from fsdp_hotload.arc.folder import verify_paths, weight_files
from fsdp_hotload.arc.stio import CHECKSUM_KEY, build_header, parse_header
from fsdp_hotload.arc.zstd_seq import SequenceEncoder, sequence_encoder

ENCODERS = ["stream"] + (["sequences"] if sequence_encoder() is not None else [])  # arc_v2 writers

TORCH_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
                torch.int32, torch.int64, torch.bool]
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        TORCH_DTYPES.append(getattr(torch, _name))
CODECS = ["arc_v2", "arc_sparse_v1"]


def _bytes_of(t: torch.Tensor) -> bytes:
    return bytes(RawTensor.from_any(t).data)


def _random_tensor(rng: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * size, dtype=np.uint8)
    if dtype == torch.bool:
        raw = raw & 1
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _mutate(rng: np.random.Generator, t: torch.Tensor, density: float) -> torch.Tensor:
    raw = RawTensor.from_any(t).data.copy()
    size = t.element_size()
    n = t.numel()
    if n:
        mask = rng.random(n) < density
        if density > 0:
            mask[[0, -1]] = rng.random(2) < 0.5 + density / 2  # exercise first/last element
        elems = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
        flip = rng.integers(1, 255, size=int(mask.sum()), dtype=np.uint8).astype(elems.dtype)
        elems[mask] ^= flip if t.dtype != torch.bool else np.ones_like(flip)
    return torch.from_numpy(raw).view(t.dtype).reshape(t.shape) if n else t.clone()


shapes = st.one_of(st.just(()), st.just((0,)), st.just((3, 0)),
                   st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple))


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(TORCH_DTYPES), shape=shapes, density=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
       seed=st.integers(0, 2**31))
def test_file_round_trip(codec: str, dtype: torch.dtype, shape: tuple[int, ...], density: float, seed: int) -> None:
    if codec not in codec_names():
        pytest.skip(f"{codec} not registered")
    rng = np.random.default_rng(seed)
    parent = {"a": _random_tensor(rng, dtype, shape), "b": _random_tensor(rng, torch.bfloat16, (5, 3))}
    new = {k: _mutate(rng, v, density) for k, v in parent.items()}
    blob = encode_delta_file(parent, new, parent_identity="p-1", codec=codec)
    out = apply_delta_file(parent, blob, filename="f.safetensors", expected_parent="p-1")
    for k in new:
        assert bytes(out[k].data) == _bytes_of(new[k]), k
        assert out[k].shape == tuple(new[k].shape)


@st.composite
def tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], str, list[Box]]:
    """A shape and a random exact tiling: flat ranges, or a grid of boxes split along every dimension."""
    shape = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    if draw(st.booleans()):
        n = int(np.prod(shape))
        cuts = sorted(set(draw(st.lists(st.integers(0, n), max_size=4))) | {0, n})
        return shape, "flat", [Box.flat(a, b - a) for a, b in zip(cuts, cuts[1:])] + [Box.flat(n, 0)]
    splits = []
    for dim in shape:
        cuts = sorted(set(draw(st.lists(st.integers(1, dim), max_size=2))) | {0, dim})
        splits.append(list(zip(cuts, cuts[1:])))
    boxes = [Box(tuple(a for a, _ in combo), tuple(b - a for a, b in combo)) for combo in _product(splits)]
    return shape, "shape", boxes


def _product(lists: list[list[tuple[int, int]]]) -> list[tuple[tuple[int, int], ...]]:
    out: list[tuple[tuple[int, int], ...]] = [()]
    for options in lists:
        out = [prev + (o,) for prev in out for o in options]
    return out


@pytest.mark.parametrize("codec", CODECS)
@settings(max_examples=40, deadline=None)
@given(tiling=tilings(), density=st.sampled_from([0.0, 0.05, 0.5, 1.0]), seed=st.integers(0, 2**31))
def test_chunked_round_trip_and_checksum_parts(codec: str, tiling: tuple[tuple[int, ...], str, list[Box]],
                                               density: float, seed: int) -> None:
    """Chunks encoded separately (as ranks do) rebuild exactly; per-chunk Adler-32 shares, updated from the sparse
    changes alone, combine into the tensor's checksum."""
    if codec not in codec_names():
        pytest.skip(f"{codec} not registered")
    shape, space, boxes = tiling
    rng = np.random.default_rng(seed)
    parent = RawTensor.from_any(_random_tensor(rng, torch.bfloat16, shape))
    new = RawTensor.from_any(_mutate(rng, parent.to_torch(), density))
    sp = (parent.numel,) if space == "flat" else shape
    total = parent.nbytes
    chunks, parts = [], []
    for box in boxes:
        old_c = np.ascontiguousarray(gather(parent.data, box, sp, 2))
        new_c = np.ascontiguousarray(gather(new.data, box, sp, 2))
        diff = element_diff(old_c, new_c, 2)
        chunks.append((box, get_codec(codec).encode(diff)))
        shares = update_parts(chunk_parts(old_c, box, sp, 2, total), global_elements(diff.idx, box, sp),
                              diff.old, diff.new, 2, total)
        assert shares == chunk_parts(new_c, box, sp, 2, total)
        parts.append(shares)
    assert combine(parts, total) == zlib.adler32(bytes(new.data))
    td = TensorDelta("w", "BF16", shape, combine(parts, total), codec, space, chunks)
    blob = build_delta_file([td], parent_identity="p")
    out = apply_delta_file({"w": parent}, blob)
    assert bytes(out["w"].data) == bytes(new.data)


def _box_elements(box: Box, sp: tuple[int, ...]) -> np.ndarray:
    """Flat positions of a box's elements in box C order, by slicing an index map (the oracle for the runs)."""
    return np.arange(int(np.prod(sp)), dtype=np.int64).reshape(sp)[tuple(slice(s, s + n) for s, n in
                                                                         zip(box.start, box.length))].reshape(-1)


@settings(max_examples=60, deadline=None)
@given(tiling=tilings(), itemsize=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31))
def test_gather_scatter_and_runs_follow_the_box(tiling: tuple[tuple[int, ...], str, list[Box]], itemsize: int,
                                                seed: int) -> None:
    """gather reads a box's bytes in box C order and scatter writes exactly those bytes back (they work on strided
    views, so that a box one column wide is not a Python loop over its elements); Box.run_offsets lists the same
    elements as contiguous runs of one length, which the checksum shares and a delta's run tables are built on."""
    shape, space, boxes = tiling
    sp = (int(np.prod(shape)),) if space == "flat" else shape
    full = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * itemsize, dtype=np.uint8)
    out = np.zeros_like(full)
    for box in boxes:
        elements = _box_elements(box, sp)
        offs, n = box.run_offsets(sp)
        assert offs.dtype == np.int64 and offs.size * n == elements.size
        runs = [o + np.arange(n, dtype=np.int64) for o in offs]
        assert np.array_equal(np.concatenate(runs) if runs else np.zeros(0, np.int64), elements)
        tables = box_run_tables(box, sp, itemsize)
        for got_t, want_t in zip(tables, run_tables([(int(o), n) for o in offs], itemsize)):
            assert np.array_equal(got_t, want_t)
        want = full.reshape(-1, itemsize)[elements].reshape(-1)
        got = gather(full, box, sp, itemsize)
        assert bytes(got) == bytes(want)
        scatter(out, got.copy(), box, sp, itemsize)
    assert bytes(out) == bytes(full)


@pytest.mark.parametrize("shape,box", [
    ((3, 70_001), Box((0, 1), (3, 70_000))),         # runs longer than the kernel's 64 KiB summing block
    ((1, 300_000), Box((0, 0), (1, 300_000))),       # one run of several blocks
    ((4096, 8), Box((0, 3), (4096, 1))),             # one column: a run per element
    ((5, 6, 7), Box((1, 2, 3), (3, 4, 4))),          # three dimensions, none spanned fully
])
def test_chunk_parts_match_zlib_run_by_run(shape: tuple[int, ...], box: Box) -> None:
    """The one-pass share kernel against zlib's Adler-32 of each run, placed by ``segment_parts``, for long runs,
    runs of one element and a tensor beyond 4 GiB (its position weights need reducing before they multiply)."""
    rng = np.random.default_rng(7)
    full = rng.integers(0, 256, int(np.prod(shape)) * 2, dtype=np.uint8)
    chunk = gather(full, box, shape, 2)
    offs, n = box.run_offsets(shape)
    for total in (full.size, full.size + (5 << 32) + 3):
        a = b = 0
        for r, o in enumerate(offs):
            sa, sb = segment_parts(chunk[r * n * 2:(r + 1) * n * 2], int(o) * 2, total)
            a, b = (a + sa) % 65521, (b + sb) % 65521
        assert chunk_parts(chunk, box, shape, 2, total) == (a, b)
        assert chunk_parts(bytes(chunk), box, shape, 2, total) == (a, b)
    with pytest.raises(ValueError, match="-byte chunk for a box of"):
        chunk_parts(chunk[:-2], box, shape, 2, full.size)


@settings(max_examples=60, deadline=None)
@given(tiling=tilings(), dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8, torch.int64]),
       density=st.sampled_from([0.0, 0.05, 0.5, 1.0]), block=st.sampled_from([8, 16, 64, 1 << 17]),
       encoder=st.sampled_from(ENCODERS), seed=st.integers(0, 2**31))
def test_one_pass_host_delta(tiling: tuple[tuple[int, ...], str, list[Box]], dtype: torch.dtype, density: float,
                             block: int, encoder: str, seed: int) -> None:
    """The trainer's host path: one pass per chunk gives the same arc_v2 payload bytes as the diff path, the
    changed count, and Adler-32 shares that combine into the new tensor's checksum, for boxes whose runs cross
    block boundaries."""
    shape, space, boxes = tiling
    rng = np.random.default_rng(seed)
    parent = RawTensor.from_any(_random_tensor(rng, dtype, shape))
    new = RawTensor.from_any(_mutate(rng, parent.to_torch(), density))
    size = parent.to_torch().element_size()
    sp = (parent.numel,) if space == "flat" else shape
    total = parent.nbytes
    codec = ArcV2(encoder=encoder)
    parts = []
    for box in boxes:
        old_c = np.ascontiguousarray(gather(parent.data, box, sp, size))
        new_c = np.ascontiguousarray(gather(new.data, box, sp, size))
        scan = DenseDelta(old_c, new_c, size, box_run_tables(box, sp, size), total, block_bytes=block)
        payload = codec.encode_xor_blocks(scan.blocks(), old_c.size)
        diff = element_diff(old_c, new_c, size)
        assert zstandard.decompress(payload) == zstandard.decompress(codec.encode(diff))
        out = np.empty_like(old_c)
        codec.decode(payload, old_c, size, out)
        assert bytes(out) == bytes(new_c)
        assert scan.changed == diff.changed
        # what the publisher calls: the same XOR, count and share delta (one compiled call with libzstd)
        one, changed, delta = codec.encode_delta(old_c, new_c, size, box_run_tables(box, sp, size), total)
        assert zstandard.decompress(one) == zstandard.decompress(payload)
        assert (changed, delta) == (diff.changed, scan.parts_delta)
        parts.append(add_parts(chunk_parts(old_c, box, sp, size, total), scan.parts_delta))
        assert parts[-1] == chunk_parts(new_c, box, sp, size, total)
    assert combine(parts, total) == zlib.adler32(bytes(new.data))


def test_tiling_errors() -> None:
    with pytest.raises(FormatError, match="overlap"):
        check_tiling([Box.flat(0, 6), Box.flat(4, 4)], (10,))
    with pytest.raises(FormatError, match="cover"):
        check_tiling([Box.flat(0, 6)], (10,))
    with pytest.raises(FormatError, match="exceeds"):
        check_tiling([Box((0, 0), (2, 5)), Box((2, 0), (2, 5))], (3, 5))
    with pytest.raises(FormatError, match="overlap"):
        check_tiling([Box((0, 0), (3, 3)), Box((0, 2), (3, 2))], (3, 5))


def _golden_delta() -> tuple[dict[str, RawTensor], bytes]:
    parent = {"w": RawTensor.from_any(np.arange(8, dtype=np.float32)),
              "b": RawTensor.from_any(np.zeros((2, 2), dtype=np.int16))}
    new_w = np.arange(8, dtype=np.float32)
    new_w[3] = -1.5
    new = {"w": RawTensor.from_any(new_w), "b": parent["b"]}
    return parent, encode_delta_file(parent, new, parent_identity="step-000001-0a0b0c0d", codec="arc_v2")


def test_golden_container_header() -> None:
    """Pins the container layout: any change here is a wire-format change and must bump format_version."""
    _, blob = _golden_delta()
    header = parse_header(blob)
    hlen = int.from_bytes(blob[:8], "little")
    assert hlen % 8 == 0
    meta = header.metadata
    assert {k: v for k, v in meta.items() if k != "arc_tensors"} == {
        "format": "hotload-arc", "format_version": "1", "kind": "delta",
        "previous_snapshot_identity": "step-000001-0a0b0c0d", "compression_format": "arc_v2",
        "checksum_format": "alder32"}
    new_w = np.arange(8, dtype=np.float32)
    new_w[3] = -1.5
    table = json.loads(meta["arc_tensors"])
    assert table["w"]["adler32"] == zlib.adler32(new_w.tobytes())
    assert table["b"]["adler32"] == zlib.adler32(bytes(8))
    assert {k: v for k, v in table["w"].items() if k != "chunks"} == {
        "adler32": zlib.adler32(new_w.tobytes()), "codec": "arc_v2", "dtype": "F32", "shape": [8], "space": "flat"}
    assert [dict(c, size=None, crc32=None) for c in table["w"]["chunks"]] == [
        {"start": [0], "length": [8], "offset": 0, "size": None, "crc32": None}]
    # Tensors are stored as U8 vectors in write order, payload = one zstd frame of the XOR bytes.
    assert [(e.name, e.dtype) for e in header.entries.values()] == [("w", "U8"), ("b", "U8")]
    e = header.entries["w"]
    frame = blob[header.data_start + e.begin:header.data_start + e.end]
    assert table["w"]["chunks"][0]["crc32"] == zlib.crc32(frame)  # of the payload: CRC-32 as zlib computes it
    xor = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=np.uint8)
    expected = np.bitwise_xor(np.arange(8, dtype=np.float32).view(np.uint8), new_w.view(np.uint8))
    assert xor.tobytes() == expected.tobytes()
    assert hashlib.sha256(blob[8:8 + hlen]).hexdigest() == hashlib.sha256(
        _golden_header_bytes(blob)).hexdigest()


def _golden_header_bytes(blob: bytes) -> bytes:
    """The header exactly as the format doc describes it, rebuilt independently from the spec."""
    header = parse_header(blob)
    meta = dict(header.metadata)
    ents = list(header.entries.values())
    doc = {"__metadata__": meta}
    for e in ents:
        doc[e.name] = {"dtype": "U8", "shape": [e.nbytes], "data_offsets": [e.begin, e.end]}
    text = json.dumps(doc, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def test_safetensors_interop() -> None:
    """The safetensors package reads our containers, and we read its files."""
    _, blob = _golden_delta()
    loaded = safetensors.numpy.load(blob)
    assert set(loaded) == {"w", "b"} and loaded["w"].dtype == np.uint8
    t = {"x": torch.randn(3, 4).bfloat16(), "y": torch.arange(5)}
    from safetensors.torch import save as st_save
    ours = load_file(st_save(t))
    assert bytes(ours["x"].data) == _bytes_of(t["x"]) and ours["y"].dtype == "I64"
    back = safetensors.numpy.load(save_file({"y": RawTensor.from_any(np.arange(3))}, {"k": "v"}))
    assert back["y"].tolist() == [0, 1, 2]


def test_a_full_file_carries_checksums_that_refuse_any_flipped_bit() -> None:
    """A full snapshot's file had no checksum: one bit flipped in storage or transit was loaded and served."""
    rng = np.random.default_rng(3)
    tensors = {"a": RawTensor.from_any(rng.standard_normal((3, 5)).astype(np.float32)),
               "b": RawTensor("BF16", (7,), rng.integers(0, 256, 14, dtype=np.uint8)),
               "empty": RawTensor("BF16", (0, 4), np.empty(0, np.uint8))}
    blob = save_file(tensors, {"format": "pt"})
    header = parse_header(blob)
    sums = header.metadata[CHECKSUM_KEY]
    assert header.metadata["format"] == "pt" and len(sums) == 8 * len(tensors)
    assert [int(sums[i:i + 8], 16) for i in range(0, len(sums), 8)] == [
        zlib.adler32(tensors[e.name].data) for e in header.entries.values()]
    assert {n: bytes(t.data) for n, t in load_file(blob, require_checksums=True).items()} == {
        n: bytes(t.data) for n, t in tensors.items()}
    for pos in range(header.data_start, len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= 1 << (pos % 8)
        with pytest.raises(FormatError, match="differs from the file's checksum") as info:
            load_file(bytes(bad), filename="f")
        owner = next(e.name for e in header.entries.values() if e.begin <= pos - header.data_start < e.end)
        assert info.value.tensor == owner
    bare = build_header([(e.name, e.dtype, e.shape, e.nbytes) for e in header.entries.values()], {"format": "pt"})
    unchecked = bare + blob[header.data_start:]
    assert set(load_file(unchecked)) == set(tensors)  # another writer's file: nothing to check
    with pytest.raises(FormatError, match=f"has no '{CHECKSUM_KEY}'"):
        load_file(unchecked, require_checksums=True)  # ours always has them: a damaged key must not pass
    for value in (sums[:-1], "z" + sums[1:]):
        with pytest.raises(FormatError, match="8 hex digits"):
            load_file(_corrupt_header(blob, lambda d: d["__metadata__"].update({CHECKSUM_KEY: value})))


def _corrupt_header(blob: bytes, edit) -> bytes:  # type: ignore[no-untyped-def]
    hlen = int.from_bytes(blob[:8], "little")
    doc = json.loads(blob[8:8 + hlen])
    edit(doc)
    text = json.dumps(doc).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + blob[8 + hlen:]


def _edit_table(fn):  # type: ignore[no-untyped-def]
    def edit(doc: dict) -> None:
        table = json.loads(doc["__metadata__"]["arc_tensors"])
        fn(table)
        doc["__metadata__"]["arc_tensors"] = json.dumps(table)
    return edit


@pytest.mark.parametrize("case,edit,exc,match", [
    ("wrong dtype", _edit_table(lambda t: t["w"].update(dtype="F16")), MismatchError, "parent holds"),
    ("wrong shape", _edit_table(lambda t: t["w"].update(shape=[2, 4])), MismatchError, "parent holds"),
    ("bad codec", _edit_table(lambda t: t["w"].update(codec="nope")), FormatError, "unknown codec"),
    ("gap in chunks", _edit_table(lambda t: t["w"]["chunks"][0].update(length=[7])), FormatError, "cover"),
    ("chunk out of range", _edit_table(lambda t: t["w"]["chunks"][0].update(start=[1])), FormatError, "exceeds"),
    ("payload range", _edit_table(lambda t: t["w"]["chunks"][0].update(size=3)), FormatError, "cover"),
    # one bit of the key name: read as a chunk written before chunks had a CRC-32, its payload went unchecked
    ("crc32 key renamed", _edit_table(lambda t: t["w"]["chunks"][0].update(crc22=t["w"]["chunks"][0].pop("crc32"))),
     FormatError, r"unknown keys \['crc22'\]"),
    ("bad checksum value", _edit_table(lambda t: t["w"].update(adler32=-1)), FormatError, "adler32"),
    ("table not json", lambda d: d["__metadata__"].update(arc_tensors="{"), FormatError, "not JSON"),
    ("extra table entry", _edit_table(lambda t: t.update(z=t["w"])), FormatError, "without stored data"),
    ("not a delta", lambda d: d["__metadata__"].update(format="other"), FormatError, "not a delta"),
    ("future version", lambda d: d["__metadata__"].update(format_version="9"), FormatError, "format_version"),
    # what the fleet is told (the signal's compression_format) must be what the tensors hold
    ("unknown compression_format", lambda d: d["__metadata__"].update(compression_format="zzz"), FormatError,
     r"compression_format 'zzz' does not match the tensors' codecs \(arc_v2\)"),
    ("other compression_format", lambda d: d["__metadata__"].update(compression_format="arc_sparse_v1"),
     FormatError, "does not match"),
    ("mixed over one codec", lambda d: d["__metadata__"].update(compression_format="mixed"), FormatError,
     "does not match"),
    # one bit of a key name: the message names the key, not a value None
    ("compression_format key renamed", lambda d: d["__metadata__"].pop("compression_format"), FormatError,
     "metadata lacks compression_format"),
    ("format_version key renamed", lambda d: d["__metadata__"].pop("format_version"), FormatError,
     "metadata lacks format_version"),
    ("checksum_format spelt right", lambda d: d["__metadata__"].update(checksum_format="adler32"), FormatError,
     "checksum_format='adler32', want 'alder32'"),
    ("arc_tensors missing", lambda d: d["__metadata__"].pop("arc_tensors"), FormatError, "lacks arc_tensors"),
    ("dtype key renamed", _edit_table(lambda t: t["w"].pop("dtype")), FormatError, "tensor entry lacks dtype"),
    ("codec key renamed", _edit_table(lambda t: t["w"].pop("codec")), FormatError, "tensor entry lacks codec"),
    ("header dtype key renamed", lambda d: d["w"].pop("dtype"), FormatError, "header entry lacks dtype"),
    # null is no CRC-32: read as a chunk from before chunks had one, its payload went unchecked
    ("crc32 null", _edit_table(lambda t: t["w"]["chunks"][0].update(crc32=None)), FormatError, "bad chunk crc32"),
])
def test_corrupt_headers_are_rejected(case: str, edit, exc: type, match: str) -> None:  # type: ignore[no-untyped-def]
    parent, blob = _golden_delta()
    with pytest.raises(exc, match=match) as info:
        apply_delta_file(parent, _corrupt_header(blob, edit), filename="model-1.safetensors")
    assert "model-1.safetensors" in str(info.value)


def test_a_file_of_two_codecs_says_mixed_and_is_read() -> None:
    from fsdp_hotload.arc.container import build_delta_file, encode_tensor, read_delta_info

    parent, _ = _golden_delta()
    new_w = np.arange(8, dtype=np.float32)
    new_w[3] = -1.5
    deltas = [encode_tensor("w", parent["w"], RawTensor.from_any(new_w), "arc_v2"),
              encode_tensor("b", parent["b"], parent["b"], "arc_sparse_v1")]
    blob = build_delta_file(deltas, parent_identity="step-000001-0a0b0c0d")
    assert read_delta_info(blob).compression_format == "mixed"
    assert apply_delta_file(parent, blob)["w"].data.tobytes() == new_w.tobytes()


def test_checksum_mismatch_names_tensor() -> None:
    parent, blob = _golden_delta()
    bad = _corrupt_header(blob, _edit_table(lambda t: t["w"].update(adler32=t["w"]["adler32"] ^ 1)))
    with pytest.raises(ChecksumError, match="tensor 'w'"):
        apply_delta_file(parent, bad, filename="f")


def test_a_wrong_parent_under_an_intact_payload_is_blamed_on_the_parent() -> None:
    """Every chunk's payload passed its CRC-32, so an Adler-32 mismatch means the parent's bytes differ: the error
    said only that the rebuilt tensor's checksum was off, and an operator re-checked the delta first."""
    parent, blob = _golden_delta()
    w = np.arange(8, dtype=np.float32)
    w[0] = 7.0  # one element of the parent changed after the delta was made
    with pytest.raises(ChecksumError, match="tensor 'w'.*passed its CRC-32, so the parent's tensor is not the one"):
        apply_delta_file({**parent, "w": RawTensor.from_any(w)}, blob, filename="f")
    no_crc = _corrupt_header(blob, _edit_table(lambda t: [c.pop("crc32") for c in t["w"]["chunks"]]))
    with pytest.raises(ChecksumError, match="a corrupt payload, or a parent other than"):
        apply_delta_file({**parent, "w": RawTensor.from_any(w)}, no_crc, filename="f")


def test_parent_and_tensor_set_mismatch() -> None:
    parent, blob = _golden_delta()
    with pytest.raises(MismatchError, match="made against"):
        apply_delta_file(parent, blob, expected_parent="other")
    with pytest.raises(MismatchError, match="tensor sets differ"):
        apply_delta_file({"w": parent["w"]}, blob)
    with pytest.raises(MismatchError, match="must not change"):
        encode_delta_file({"w": np.zeros(3, np.float32)}, {"w": np.zeros(3, np.float64)}, parent_identity="p")


@pytest.mark.parametrize("cut", [1, 7, 20, -1, -5])
def test_truncated_files_are_rejected(cut: int) -> None:
    parent, blob = _golden_delta()
    with pytest.raises(FormatError):
        apply_delta_file(parent, blob[:cut] if cut > 0 else blob[:len(blob) + cut])


def test_corrupt_payload_byte_is_caught() -> None:
    parent, blob = _golden_delta()
    header = parse_header(blob)
    e = header.entries["w"]
    for pos in range(header.data_start + e.begin, header.data_start + e.end):
        bad = bytearray(blob)
        bad[pos] ^= 0x40
        with pytest.raises((FormatError, ChecksumError)):
            apply_delta_file(parent, bytes(bad))


def test_a_flipped_bit_that_keeps_the_adler32_is_caught_by_the_chunk_crc() -> None:
    """One flipped bit of this 46-byte arc_v2 frame (found by fuzzing) decodes to 8 bytes off by +-32 in pairs
    that leave the tensor's Adler-32 as it was: the file applied and served wrong weights without an error. The
    chunk table's CRC-32 of each payload refuses it; a file written before that key existed still applies."""
    old = bytes.fromhex("e724d26facd2aeb0daf2a972cd3fa02fd44f487078de451f5f6c246dee45"
                        "3351e4d3ca3aca414c46c1682afad1a4022cb28c6202")
    new = bytes.fromhex("e724d26fabd2ae1adaf2a972cd3fa02f774f48705dde9a6b5f6c246dee28"
                        "3351e4d3ca3aca418246c1682a2ed1a4022cb28c6202")
    frame = bytes.fromhex("28b52ffd20342d0100d800000000070000aa00a30000002500df74"
                          "006d00ce00000000d400041000d924b6273b02")
    parent = {"a": RawTensor("BF16", (26,), np.frombuffer(old, np.uint8).copy())}
    td = TensorDelta("a", "BF16", (26,), zlib.adler32(new), "arc_v2", "flat", [(Box.flat(0, 26), frame)])
    blob = build_delta_file([td], parent_identity="p")
    assert bytes(apply_delta_file(parent, blob)["a"].data) == new
    header = parse_header(blob)
    flipped = bytearray(blob)
    flipped[header.data_start + header.entries["a"].begin + 36] ^= 1 << 5
    wrong = bytearray(frame)
    wrong[36] ^= 1 << 5  # what the frame decodes to once flipped: other bytes, the same Adler-32
    xor = zstandard.ZstdDecompressor().decompress(bytes(wrong))
    assert bytes(a ^ b for a, b in zip(old, xor)) != new and zlib.adler32(bytes(a ^ b for a, b in zip(old, xor))) \
        == zlib.adler32(new)
    with pytest.raises(ChecksumError, match="chunk 0 fails its CRC-32"):
        apply_delta_file(parent, bytes(flipped))
    older = _corrupt_header(blob, _edit_table(lambda t: t["a"]["chunks"][0].pop("crc32")))
    assert bytes(apply_delta_file(parent, older)["a"].data) == new


def test_decompression_bomb_is_bounded() -> None:
    """A payload whose frame claims more bytes than the tensor holds is refused before decompressing."""
    parent = {"w": RawTensor.from_any(np.zeros(16, np.uint8))}
    bomb = zstandard.ZstdCompressor().compress(bytes(10**7))
    td = TensorDelta("w", "U8", (16,), zlib.adler32(bytes(16)), "arc_v2", "flat", [(Box.flat(0, 16), bomb)])
    with pytest.raises(FormatError, match="declares 10000000 bytes"):
        apply_delta_file(parent, build_delta_file([td], parent_identity="p"))
    stream = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(17))
    td.chunks = [(Box.flat(0, 16), stream)]
    with pytest.raises(FormatError, match="decompresses to 17 bytes"):
        apply_delta_file(parent, build_delta_file([td], parent_identity="p"))
    stream = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(10**6))
    td.chunks = [(Box.flat(0, 16), stream)]
    with pytest.raises(FormatError, match="longer than 16 bytes"):
        apply_delta_file(parent, build_delta_file([td], parent_identity="p"))


def test_apply_tensor_rejects_parent_mismatch() -> None:
    parent, blob = _golden_delta()
    info = read_delta_info(blob)
    with pytest.raises(MismatchError):
        apply_tensor(info.tensors["w"], parent["b"], np.frombuffer(blob, np.uint8), filename="f")


def test_payload_bytes_of_a_read_delta_counts_its_stored_payload() -> None:
    """read_delta_info's chunks are (offset, size) ranges, not payloads: payload_bytes must give the bytes the
    tensor stores either way, not two per chunk (the length of the range tuple)."""
    parent = np.arange(64, dtype=np.float32)
    new = parent.copy()
    new[3] += 1
    new[40] -= 1
    p8, n8 = parent.view(np.uint8), new.view(np.uint8)
    codec = get_codec("arc_v2")
    chunks = [(Box.flat(0, 32), codec.encode(element_diff(p8[:128], n8[:128], 4))),
              (Box.flat(32, 32), codec.encode(element_diff(p8[128:], n8[128:], 4)))]
    td = TensorDelta("w", "F32", (64,), RawTensor.from_any(new).adler32(), "arc_v2", "flat", chunks)
    stored = sum(len(p) for _, p in chunks)
    assert stored > 4  # two payloads of more than two bytes each: a count of ranges cannot pass for it
    assert td.payload_bytes == stored
    info = read_delta_info(build_delta_file([td], parent_identity="p"))
    assert info.header.entries["w"].nbytes == stored
    assert info.tensors["w"].payload_bytes == stored


def test_header_bounds() -> None:
    with pytest.raises(FormatError, match="shorter"):
        parse_header(b"\x01")
    with pytest.raises(FormatError, match="exceeds"):
        parse_header((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(FormatError, match="not JSON"):
        parse_header((2).to_bytes(8, "little") + b"{x")
    bad = save_file({"a": RawTensor.from_any(np.zeros(2, np.float32))})
    with pytest.raises(FormatError, match="data section"):
        parse_header(bad + b"x")


@pytest.mark.parametrize("meta", [[], 0, "", False, ["a"], {"k": 1}])
def test_metadata_that_is_not_a_string_map_is_rejected(meta: object) -> None:
    doc = json.dumps({"__metadata__": meta}).encode()
    with pytest.raises(FormatError, match="__metadata__ must map strings to strings"):
        parse_header(len(doc).to_bytes(8, "little") + doc)


def test_null_or_absent_metadata_is_none() -> None:
    for doc in (b'{"__metadata__": null}', b"{}"):
        assert parse_header(len(doc).to_bytes(8, "little") + doc).metadata == {}


def _brute_tiling(boxes: list[Box], space: tuple[int, ...]) -> str:
    """The tiling rule by definition: in range, as many elements as the space, no two non-empty boxes overlap."""
    if any(len(b.start) != len(space) or any(s + n > d for s, n, d in zip(b.start, b.length, space)) for b in boxes):
        return "exceeds"
    if sum(b.numel for b in boxes) != int(np.prod(space)):
        return "cover"
    live = [b for b in boxes if b.numel]
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            if all(sa < sb + nb and sb < sa + na for sa, na, sb, nb in zip(a.start, a.length, b.start, b.length)):
                return "overlap"
    return "ok"


@st.composite
def guillotine_tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A box cut recursively along random dimensions (every dimension can be split), then maybe one box nudged."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=2, max_size=4)))
    todo, done = [((0,) * len(shape), shape)], []
    while todo:
        start, length = todo.pop()
        k = draw(st.integers(0, len(shape) - 1))
        if len(done) + len(todo) > 12 or length[k] < 2 or not draw(st.booleans()):
            done.append(Box(start, length))
            continue
        c = draw(st.integers(1, length[k] - 1))
        todo.append((start, length[:k] + (c,) + length[k + 1:]))
        todo.append((start[:k] + (start[k] + c,) + start[k + 1:], length[:k] + (length[k] - c,) + length[k + 1:]))
    if draw(st.booleans()):
        i, k = draw(st.integers(0, len(done) - 1)), draw(st.integers(0, len(shape) - 1))
        b = done[i]
        start = b.start[:k] + (max(0, b.start[k] + draw(st.integers(-2, 2))),) + b.start[k + 1:]
        done[i] = Box(start, b.length)
    if draw(st.booleans()):
        done.append(Box(tuple(draw(st.integers(0, d)) for d in shape[:-1]) + (0,), (1,) * (len(shape) - 1) + (0,)))
    return shape, draw(st.permutations(done))


@settings(max_examples=200, deadline=None)
@given(tiling=guillotine_tilings(), painted=st.booleans())
def test_tiling_check_agrees_with_its_definition(tiling: tuple[tuple[int, ...], list[Box]], painted: bool) -> None:
    """Corner counting (and, for tables past its bound, marking elements) accepts exactly the exact tilings."""
    shape, boxes = tiling
    want = _brute_tiling(boxes, shape)
    bound = boxes_mod.MAX_TILING_WORK
    boxes_mod.MAX_TILING_WORK = int(np.prod(shape)) if painted else bound
    try:
        if want == "ok":
            check_tiling(boxes, shape)
        else:
            with pytest.raises(FormatError, match=want):
                check_tiling(boxes, shape)
    finally:
        boxes_mod.MAX_TILING_WORK = bound


def _chunk_table_file(shape: list[int], boxes: list[Box]) -> bytes:
    """A delta file header whose one tensor has the given chunks (empty payloads: only the table is read)."""
    table = {"a": {"dtype": "U8", "shape": shape, "adler32": 1, "codec": "arc_v2", "space": "shape",
                   "chunks": [{**b.to_json(), "offset": 0, "size": 0} for b in boxes]}}
    meta = {"format": "hotload-arc", "format_version": "1", "kind": "delta", "previous_snapshot_identity": "p",
            "compression_format": "arc_v2", "checksum_format": "alder32",
            "arc_tensors": json.dumps(table, separators=(",", ":"))}
    return build_header([("a", "U8", (0,), 0)], meta)


def test_many_chunk_tables_are_read_and_checked() -> None:
    """Tens of thousands of chunks split along two dimensions (rows cut at a different column each): the exact
    tiling is read, and a chunk moved onto its neighbour is named."""
    n = 12_000
    boxes = []
    for r in range(n):
        c = r % (n - 1) + 1
        boxes += [Box((r, 0), (1, c)), Box((r, c), (1, n - c))]
    info = read_delta_info(_chunk_table_file([n, n], boxes), filename="f")
    assert len(info.tensors["a"].chunks) == 2 * n
    boxes[2 * 7 + 1] = Box((7, 6), (1, n - 8))  # row 7: [0, 8) and now [6, n - 2), so one element is left out
    with pytest.raises(FormatError, match=r"chunks \{'start': \[7, 0\], 'length': \[1, 8\]\} and "
                                          r"\{'start': \[7, 6\].* overlap") as info_:
        read_delta_info(_chunk_table_file([n, n], boxes), filename="f")
    assert "tensor 'a'" in str(info_.value)


def test_chunk_tables_past_the_check_bound_are_refused() -> None:
    """The tiling check's memory is bounded, and the error says by what."""
    # 21 chunks cutting 20 dimensions in half one after the other, over 10^4 elements each: exact, but 2^20
    # corners per chunk and 10^10 elements are past what the check builds.
    d = 20
    deep = [Box((0,) * i + (1,) + (0,) * (d - i), (1,) * (i + 1) + (2,) * (d - i - 1) + (10_000,)) for i in range(d)]
    deep.append(Box((0,) * (d + 1), (1,) * d + (10_000,)))
    with pytest.raises(FormatError, match=r"21 chunks split 20 dimensions .* handles up to \d+ box corners") as info:
        read_delta_info(_chunk_table_file([2] * d + [10_000], deep), filename="f")
    assert f"up to {boxes_mod.MAX_TILING_WORK} " in str(info.value)
    assert _brute_tiling(deep, (2,) * d + (10_000,)) == "ok"


@pytest.mark.parametrize("where", ["header", "arc_tensors"])
@pytest.mark.parametrize("bad", ["[" * 100_000 + "]" * 100_000, '{"a":' + "9" * 5_000 + "}"])
def test_hostile_json_is_a_format_error(tmp_path: Path, where: str, bad: str) -> None:
    """JSON the decoder gives up on (nesting past the recursion limit, integers past Python's digit limit) is a
    format error naming the file wherever it sits, so verification reports it instead of crashing."""
    parent, blob = _golden_delta()
    if where == "header":
        text = bad.encode()
        blob = len(text).to_bytes(8, "little") + text
    else:
        blob = _corrupt_header(blob, lambda d: d["__metadata__"].update(arc_tensors=bad))
    assert not is_delta_file(blob) if where == "header" else is_delta_file(blob)
    with pytest.raises(FormatError, match="not JSON") as info:
        apply_delta_file(parent, blob, filename="model-1.safetensors")
    assert "model-1.safetensors" in str(info.value)
    (tmp_path / "p.safetensors").write_bytes(save_file(parent))
    (tmp_path / "d.safetensors").write_bytes(blob)
    with pytest.raises(FormatError, match="not JSON"):
        verify_paths(str(tmp_path / "p.safetensors"), str(tmp_path / "d.safetensors"))
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "model.safetensors.index.json").write_text(bad)
    with pytest.raises(FormatError, match="index is not JSON"):
        weight_files(str(tmp_path / "snap"))


def test_arc_v2_payload_is_one_frame_and_nothing_else() -> None:
    """A second frame, a skippable frame or stray bytes after the frame are refused, whether the frame declares
    its size, does not, or declares 0 bytes; a truncated frame is refused too."""
    n = 1000
    sized = zstandard.ZstdCompressor().compress(bytes(n))
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(n))
    empty = zstandard.ZstdCompressor().compress(b"")
    skippable = b"\x50\x2a\x4d\x18" + (2).to_bytes(4, "little") + b"ab"
    for frame, size in [(sized, n), (unsized, n), (empty, 0)]:
        assert zstd_decompress_exact(frame, size) == bytes(size)
        for extra in (b"x", frame, skippable):
            with pytest.raises(FormatError, match="bytes after its zstd frame"):
                zstd_decompress_exact(frame + extra, size)
        with pytest.raises(FormatError, match="truncated|corrupt"):
            zstd_decompress_exact(frame[:-1], size)
    with pytest.raises(FormatError, match="not a zstd frame"):
        zstd_decompress_exact(skippable + sized, n)
    zstd_decompress_exact(zstandard.ZstdCompressor(write_content_size=False).compress(b""), 0)


def test_arc_v2_window_is_bounded_by_the_chunk() -> None:
    """A frame may not make the decoder reserve a window larger than the chunk or 8 MiB (libzstd alone would
    reserve up to 128 MiB for a one-byte chunk). A streaming encoder at levels 1-19 that did not know the size
    declares at most 8 MiB: such frames decode."""
    cobj = zstandard.ZstdCompressor(level=19, write_content_size=False).compressobj()
    streamed = cobj.compress(b"\x01") + cobj.flush()  # size unknown to the encoder: the level's window (8 MiB)
    assert zstandard.get_frame_parameters(streamed).window_size == 1 << 23
    assert zstd_decompress_exact(streamed, 1) == b"\x01"
    params = zstandard.ZstdCompressionParameters.from_level(22, window_log=27, write_content_size=0)
    cobj = zstandard.ZstdCompressor(compression_params=params).compressobj()
    huge = cobj.compress(b"\x01") + cobj.flush()  # a 128 MiB window for one byte
    assert zstandard.get_frame_parameters(huge).window_size == 1 << 27
    with pytest.raises(FormatError, match="window"):
        zstd_decompress_exact(huge, 1)
    assert zstd_window_limit(0) == zstd_window_limit(1) == 1 << 23 and zstd_window_limit((1 << 23) + 1) == 1 << 24
    for n in (0, 1, 1000, 1025, 3000, 1 << 17, (1 << 17) + 1, 700_000):
        data = bytes(range(256)) * (n // 256) + bytes(n % 256)
        for frame in (zstandard.ZstdCompressor(write_content_size=False).compress(data),
                      zstandard.ZstdCompressor(level=19).compress(data)):
            assert zstandard.get_frame_parameters(frame).window_size <= zstd_window_limit(n)
            assert zstd_decompress_exact(frame, n) == data


@pytest.mark.parametrize("encoder", ENCODERS)
@pytest.mark.parametrize("n", [0, 1, 1000, 1 << 17, (1 << 17) + 1, 3 * (1 << 17) + 5, 600_000])
def test_our_frames_declare_their_size_and_a_bounded_window(encoder: str, n: int) -> None:
    """Every arc_v2 writer (streaming, sequences block by block and in one call) declares the content size and a
    window within the decoder's bound, and decodes through it."""
    rng = np.random.default_rng(n)
    parent = rng.integers(0, 256, size=n, dtype=np.uint8)
    new = parent.copy()
    new[::97] ^= 1
    codec = ArcV2(encoder=encoder)
    tables = run_tables([(0, n)] if n else [], 1)
    frames = [codec.encode(element_diff(parent, new, 1)), codec.encode_delta(parent, new, 1, tables, n)[0]]
    if encoder == "sequences":
        for one_call in (False, True):
            enc = SequenceEncoder(sequence_encoder().lib, one_call=one_call)  # type: ignore[union-attr]
            frames.append(enc.encode_delta(parent, new, 1, tables, n)[0])
    for frame in frames:
        params = zstandard.get_frame_parameters(frame)
        assert params.content_size == n and params.window_size <= zstd_window_limit(n)
        out = np.empty(n, dtype=np.uint8)
        codec.decode(frame, parent, 1, out)
        assert (out == new).all()


def test_numpy_scalars_keep_their_empty_shape() -> None:
    old, new = np.array(3.5, dtype=np.float32), np.array(-4.25, dtype=np.float32)
    assert RawTensor.from_any(old).shape == () and RawTensor.from_any(torch.tensor(3.5)).shape == ()
    data = save_file({"z": old})
    assert safetensors.numpy.load(data)["z"].shape == ()
    delta = encode_delta_file({"z": old}, {"z": new}, parent_identity="p")
    for parent in (load_file(data), {"z": old}):
        got = apply_delta_file(parent, delta)["z"]
        assert got.shape == () and got.data.tobytes() == new.tobytes()


def test_decoding_never_reads_the_encoder_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """HOTLOAD_ARC_ENCODER only concerns encoders: a typo in it must not make valid deltas fail to decode."""
    old = np.arange(64, dtype=np.uint16)
    new = old.copy()
    new[5] ^= 3
    delta = encode_delta_file({"w": old}, {"w": new}, parent_identity="p")
    monkeypatch.setenv("HOTLOAD_ARC_ENCODER", "Stream")
    assert apply_delta_file({"w": old}, delta)["w"].data.tobytes() == new.tobytes()
    with pytest.raises(FormatError, match="arc_v2 encoder 'Stream'"):
        encode_delta_file({"w": old}, {"w": new}, parent_identity="p")


@pytest.mark.parametrize("dtype", [[], {}, None, 7])
def test_a_header_dtype_that_is_not_text_is_a_format_error(dtype: object) -> None:
    """A list or dict dtype raised TypeError (unhashable) from parse_header, past every caller that catches
    ArcError (is_delta_file, the CLI's verify, the emulator's loader)."""
    from fsdp_hotload.arc import FormatError, is_delta_file, parse_header

    h = json.dumps({"w": {"dtype": dtype, "shape": [1], "data_offsets": [0, 1]}}).encode()
    h += b" " * (-len(h) % 8)
    blob = len(h).to_bytes(8, "little") + h + b"x"
    with pytest.raises(FormatError, match="unsupported dtype"):
        parse_header(blob)
    assert is_delta_file(blob) is False


def test_a_tensor_cannot_be_named_like_the_metadata_key() -> None:
    """safetensors reads a ``__metadata__`` header entry as the string map, so a tensor of that name gives a file
    no reader loads; the writer refuses it whether or not the file has metadata."""
    one = [("__metadata__", "F32", [1], 4)]
    for meta in (None, {}, {"format": "pt"}):
        with pytest.raises(FormatError, match="__metadata__"):
            build_header(one, meta)


def test_header_bound_is_the_safetensors_one_and_the_writer_keeps_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors refuses a header over 100,000,000 bytes (MAX_HEADER_SIZE in its tensor.rs), so a reader that
    allows more accepts files nobody else loads, and a writer must not produce them (many tensors in one file)."""
    from fsdp_hotload.arc import stio

    assert stio.MAX_HEADER_BYTES == 100_000_000
    items = [(f"t{i}", "U8", [1], 1) for i in range(8)]
    monkeypatch.setattr(stio, "MAX_HEADER_BYTES", len(build_header(items, None)) - 8)
    build_header(items, None)
    with pytest.raises(FormatError, match="header"):
        build_header([*items, ("t8", "U8", [1], 1)], None)


def _one_byte_file(shape: list[int], nbytes: int = 1) -> bytes:
    """A safetensors file whose one U8 tensor holds ``nbytes`` bytes and whose header gives it ``shape``."""
    text = json.dumps({"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + bytes(nbytes)


@pytest.mark.parametrize("shape,match", [
    ([10**4000] * 2, "more than"),  # a product of 8,001 digits: formatting it into the message raised ValueError
    ([2**62] * 4, "more than"),
    ([1] * 65, "65 dimensions"),  # one byte, but no numpy array has 65 dimensions
    ([0, 2**70], "dimension 1 of"),  # no bytes, but no numpy array or torch tensor has that shape
])
def test_header_shapes_are_bounded(shape: list[int], match: str) -> None:
    """Shapes in a header are untrusted: their rank and byte count are bounded before anything multiplies them
    out, and a bad one is a format error naming the tensor (is_delta_file just says no)."""
    blob = _one_byte_file(shape)
    with pytest.raises(FormatError, match=match) as info:
        parse_header(blob, filename="f.safetensors")
    assert "tensor 'w'" in str(info.value) and "f.safetensors" in str(info.value)
    assert not is_delta_file(blob)
    assert parse_header(_one_byte_file([1] * 64)).entries["w"].shape == (1,) * 64
    assert parse_header(_one_byte_file([0, 2**62, 2**62], 0)).entries["w"].nbytes == 0
    if len(shape) > 64:  # and no writer of ours produces what the reader refuses
        wide = RawTensor("U8", tuple(shape), np.zeros(1, np.uint8))
        with pytest.raises(FormatError, match=match):
            save_file({"w": wide})
        with pytest.raises(FormatError, match=match):
            encode_delta_file({"w": wide}, {"w": wide}, parent_identity="p")


def _staircase(rank: int, split: int) -> tuple[tuple[int, ...], list[Box]]:
    """A cube of 2^split cells (padded with dimensions of 1 to ``rank``) tiled by its corner cell and the
    ``split`` slabs of the rest: a valid table whose corner count sends the tiling check to its painted map."""
    space = (2,) * split + (1,) * (rank - split)
    boxes = [Box((0,) * rank, (1,) * rank)]
    for j in range(split):
        length = [1] * j + [1] + list(space[j + 1:])
        boxes.append(Box(tuple([0] * j + [1] + [0] * (rank - j - 1)), tuple(length)))
    return space, boxes


@pytest.mark.parametrize("shape,space,match", [
    ([1] * 64 + [8], "flat", "65 dimensions"),
    ([2**62] * 4, "shape", "more than"),
    ("staircase", "shape", "65 dimensions"),  # a valid table; at rank 65 numpy failed inside the tiling check
])
def test_table_shapes_are_bounded(shape: object, space: str, match: str) -> None:
    """The same bounds for the tensor table's shapes, before the tiling check sees them."""
    parent, blob = _golden_delta()
    stored = parse_header(blob).entries["w"].nbytes
    if shape == "staircase":
        check_tiling(*reversed(_staircase(64, 23)))  # the same table within numpy's rank is checked and valid
        shape, boxes = _staircase(65, 23)
    else:
        boxes = [Box.whole(shape) if space == "shape" else Box.flat(0, 8)]
    chunks = [{**b.to_json(), "offset": 0, "size": 0} for b in boxes]
    chunks[-1]["size"] = stored  # the last chunk holds the stored payload, the others none
    bad = _corrupt_header(blob, _edit_table(lambda t: t["w"].update(shape=list(shape), space=space, chunks=chunks)))
    with pytest.raises(FormatError, match=match) as info:
        read_delta_info(bad, filename="d.safetensors")
    assert "tensor 'w'" in str(info.value) and "d.safetensors" in str(info.value)
