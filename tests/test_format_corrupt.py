"""Format layer's strictness on damaged, hostile or oversized input: checksums that refuse a flipped bit, corrupt
headers and tensor tables, truncated files and payloads, a wrong parent, decompression bombs, hostile JSON, and the
bounds on headers, metadata and shapes."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard

from fsdp_hotload.arc import (Box, ChecksumError, FormatError, MismatchError, RawTensor, TensorDelta, apply_delta_file,
                              apply_tensor, build_delta_file, encode_delta_file, is_delta_file, load_file,
                              read_delta_info, save_file)
from fsdp_hotload.arc.boxes import check_tiling
from fsdp_hotload.arc.folder import verify_paths, weight_files
from fsdp_hotload.arc.stio import CHECKSUM_KEY, build_header, parse_header
from tests.test_format import _golden_delta


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
