"""Format layer: round trips, golden container bytes, tiling checks, Adler-32 parts and arc_v2's zstd frames.
Strictness on damaged, hostile or oversized input is in test_format_corrupt.py."""
from __future__ import annotations

import hashlib
import json
import zlib

import numpy as np
import pytest
import safetensors.numpy
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_hotload.arc import (Box, FormatError, RawTensor, TensorDelta, apply_delta_file, build_delta_file,
                              codec_names, element_diff, encode_delta_file, get_codec, load_file, read_delta_info,
                              save_file)
from fsdp_hotload.arc.adler import add_parts, chunk_parts, combine, global_elements, segment_parts, update_parts
from fsdp_hotload.arc import boxes as boxes_mod
from fsdp_hotload.arc.boxes import check_tiling, gather, scatter
from fsdp_hotload.arc.codecs import ArcV2, zstd_decompress_exact, zstd_window_limit
from fsdp_hotload.arc.dense import DenseDelta, box_run_tables, run_tables
from fsdp_hotload.arc.stio import build_header, parse_header
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
