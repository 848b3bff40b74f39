"""Format layer: round trips, golden container bytes, strictness on corrupt input, Adler-32 parts."""
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

from fsdp_hotload.arc import (Box, ChecksumError, FormatError, MismatchError, RawTensor, TensorDelta,
                              apply_delta_file, apply_tensor, build_delta_file, codec_names, element_diff,
                              encode_delta_file, get_codec, load_file, read_delta_info, save_file)
from fsdp_hotload.arc.adler import add_parts, chunk_parts, combine, global_elements, update_parts
from fsdp_hotload.arc.boxes import check_tiling, gather
from fsdp_hotload.arc.codecs import ArcV2
from fsdp_hotload.arc.dense import DenseDelta, run_tables
from fsdp_hotload.arc.stio import parse_header
from fsdp_hotload.arc.zstd_seq import sequence_encoder

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
        scan = DenseDelta(old_c, new_c, size, run_tables(box.runs(sp), size), total, block_bytes=block)
        payload = codec.encode_xor_blocks(scan.blocks(), old_c.size)
        diff = element_diff(old_c, new_c, size)
        assert zstandard.decompress(payload) == zstandard.decompress(codec.encode(diff))
        out = np.empty_like(old_c)
        codec.decode(payload, old_c, size, out)
        assert bytes(out) == bytes(new_c)
        assert scan.changed == diff.changed
        # what the publisher calls: the same XOR, count and share delta (one compiled call with libzstd)
        one, changed, delta = codec.encode_delta(old_c, new_c, size, run_tables(box.runs(sp), size), total)
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
    assert [dict(c, size=None) for c in table["w"]["chunks"]] == [{"start": [0], "length": [8], "offset": 0,
                                                                   "size": None}]
    # Tensors are stored as U8 vectors in write order, payload = one zstd frame of the XOR bytes.
    assert [(e.name, e.dtype) for e in header.entries.values()] == [("w", "U8"), ("b", "U8")]
    e = header.entries["w"]
    frame = blob[header.data_start + e.begin:header.data_start + e.end]
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
    ("bad checksum value", _edit_table(lambda t: t["w"].update(adler32=-1)), FormatError, "adler32"),
    ("table not json", lambda d: d["__metadata__"].update(arc_tensors="{"), FormatError, "not JSON"),
    ("extra table entry", _edit_table(lambda t: t.update(z=t["w"])), FormatError, "without stored data"),
    ("not a delta", lambda d: d["__metadata__"].update(format="other"), FormatError, "not a delta"),
    ("future version", lambda d: d["__metadata__"].update(format_version="9"), FormatError, "format_version"),
])
def test_corrupt_headers_are_rejected(case: str, edit, exc: type, match: str) -> None:  # type: ignore[no-untyped-def]
    parent, blob = _golden_delta()
    with pytest.raises(exc, match=match) as info:
        apply_delta_file(parent, _corrupt_header(blob, edit), filename="model-1.safetensors")
    assert "model-1.safetensors" in str(info.value)


def test_checksum_mismatch_names_tensor() -> None:
    parent, blob = _golden_delta()
    bad = _corrupt_header(blob, _edit_table(lambda t: t["w"].update(adler32=t["w"]["adler32"] ^ 1)))
    with pytest.raises(ChecksumError, match="tensor 'w'"):
        apply_delta_file(parent, bad, filename="f")


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


def test_decompression_bomb_is_bounded() -> None:
    """A payload whose frame claims more bytes than the tensor holds is refused before decompressing."""
    parent = {"w": RawTensor.from_any(np.zeros(16, np.uint8))}
    bomb = zstandard.ZstdCompressor().compress(bytes(10**7))
    td = TensorDelta("w", "U8", (16,), zlib.adler32(bytes(16)), "arc_v2", "flat", [(Box.flat(0, 16), bomb)])
    with pytest.raises(FormatError, match="declares 10000000 bytes"):
        apply_delta_file(parent, build_delta_file([td], parent_identity="p"))
    stream = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(10**6))
    td.chunks = [(Box.flat(0, 16), stream)]
    with pytest.raises(FormatError, match="decompresses to 17 bytes"):
        apply_delta_file(parent, build_delta_file([td], parent_identity="p"))


def test_apply_tensor_rejects_parent_mismatch() -> None:
    parent, blob = _golden_delta()
    info = read_delta_info(blob)
    with pytest.raises(MismatchError):
        apply_tensor(info.tensors["w"], parent["b"], np.frombuffer(blob, np.uint8), filename="f")


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
