"""A full snapshot's file, assembled in one buffer from every rank's pieces, is byte for byte the file our
safetensors writer (``stio.save_file``, whose files the reference reader loads: ``test_format``) makes of the whole
tensors, whatever the pieces' order, boxes or buffer types."""
from __future__ import annotations

import random

import numpy as np
import pytest
import safetensors.torch
import torch

from fsdp_hotload.arc.adler import chunk_parts
from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.arc.errors import FormatError
from fsdp_hotload.arc.stio import CHECKSUM_KEY, build_header, parse_header, save_file
from fsdp_hotload.engine.assemble import FULL_FILE_METADATA, Piece, assemble_full_file, assign_owners
from fsdp_hotload.layout import TensorSpec, plan_shards


def _pieces(name: str, full: np.ndarray, boxes: list[Box], space: str) -> list[Piece]:
    """Each box's bytes in box C order, as a rank stages them, with their Adler-32 shares; alternately numpy views
    and bytes."""
    out = []
    flat = full.reshape(-1)
    for i, b in enumerate(boxes):
        part = flat[b.start[0]:b.start[0] + b.length[0]] if space == "flat" else \
            full[tuple(slice(s, s + n) for s, n in zip(b.start, b.length))]
        raw = np.ascontiguousarray(part).view(np.uint8).reshape(-1)
        parts = chunk_parts(raw, b, flat.shape if space == "flat" else full.shape, full.itemsize, full.nbytes)
        out.append(Piece(name, space, tuple(b.start), tuple(b.length), raw if i % 2 else raw.tobytes(), parts))
    return out


def test_full_file_equals_the_reference_writer() -> None:
    rng = np.random.default_rng(5)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": rng.integers(0, 2**16, (48, 40), dtype=np.uint16),
        "model.layers.0.mlp.up_proj.weight": rng.integers(0, 2**16, (30, 16), dtype=np.uint16),
        "model.layers.0.input_layernorm.weight": rng.integers(0, 2**16, (40,), dtype=np.uint16),
        "model.layers.0.step": rng.integers(-9, 9, (3,), dtype=np.int64),
    }
    codes = {np.dtype(np.uint16): "BF16", np.dtype(np.int64): "I64"}
    specs = [TensorSpec(n, t.shape, codes[t.dtype]) for n, t in tensors.items()]
    plan = plan_shards(specs)
    (filename, names), = plan.files.items()
    q = "model.layers.0.self_attn.q_proj.weight"
    pieces = (_pieces(q, tensors[q], [Box((0, 0), (48, 7)), Box((0, 7), (48, 33))], "shape")
              + _pieces("model.layers.0.mlp.up_proj.weight", tensors["model.layers.0.mlp.up_proj.weight"],
                        [Box((0, 0), (11, 16)), Box((11, 0), (0, 16)), Box((11, 0), (19, 16))], "shape")
              + _pieces("model.layers.0.input_layernorm.weight", tensors["model.layers.0.input_layernorm.weight"],
                        [Box.flat(0, 25), Box.flat(25, 15)], "flat")
              + _pieces("model.layers.0.step", tensors["model.layers.0.step"], [Box.flat(0, 3)], "flat"))
    random.Random(1).shuffle(pieces)
    got = assemble_full_file(plan, filename, pieces)
    want = save_file({n: RawTensor(plan.specs[n].dtype, plan.specs[n].shape, tensors[n].view(np.uint8).reshape(-1))
                      for n in names}, FULL_FILE_METADATA)
    assert bytes(got) == want  # checksums included: combined from the pieces' shares, as save_file computes them
    assert CHECKSUM_KEY in parse_header(want).metadata
    with pytest.raises(FormatError, match="cover"):  # a rank's piece missing: refused, never a file with a hole
        assemble_full_file(plan, filename, [p for p in pieces if p.box.numel][1:])


def test_a_piece_of_another_length_than_its_box_is_refused() -> None:
    """numpy would broadcast a short piece over its box and cut a long one: wrong weights, refused only once a
    replica checks the file's checksums, after every upload."""
    plan = plan_shards([TensorSpec("model.norm.weight", (4,), "BF16")])
    (filename, _), = plan.files.items()
    good = np.arange(8, dtype=np.uint8)
    assert bytes(assemble_full_file(plan, filename, [Piece("model.norm.weight", "flat", (0,), (4,), good)]))[-8:] \
        == good.tobytes()
    for bad in (good[:1], np.arange(10, dtype=np.uint8)):
        with pytest.raises(FormatError, match=f"a chunk of {bad.size} bytes for a box of 4 elements of 2 bytes"):
            assemble_full_file(plan, filename, [Piece("model.norm.weight", "flat", (0,), (4,), bad)])


def test_mixed_dtypes_of_odd_lengths_stay_aligned() -> None:
    """In name order a 3-element BF16 tensor would put the F32 and I64 tensors after it at offsets 6 and 26: a
    reader that views the mapped file as typed arrays (no copy) needs each tensor at a multiple of its item size."""
    rng = np.random.default_rng(7)
    raw = {  # name -> (code, numpy array of the same item size)
        "model.layers.0.a_bias": ("BF16", rng.integers(0, 2**16, (3,), dtype=np.uint16)),
        "model.layers.0.b_scale": ("F32", rng.standard_normal(5).astype(np.float32)),
        "model.layers.0.c_steps": ("I64", rng.integers(-9, 9, (3,), dtype=np.int64)),
        "model.layers.0.d_mask": ("U8", rng.integers(0, 255, (7,), dtype=np.uint8)),
        "model.layers.0.e_gain": ("F16", rng.standard_normal(1).astype(np.float16)),
        "model.layers.0.f_table": ("I32", rng.integers(-9, 9, (2, 3), dtype=np.int32)),
    }
    plan = plan_shards([TensorSpec(n, a.shape, code) for n, (code, a) in raw.items()])
    (filename, names), = plan.files.items()
    pieces = [p for n, (_, a) in raw.items() for p in _pieces(n, a, [Box.flat(0, a.size)], "flat")]
    blob = bytes(assemble_full_file(plan, filename, pieces))
    header = parse_header(blob)
    assert header.data_start % 8 == 0
    for name, (code, a) in raw.items():
        e = header.entries[name]
        assert (header.data_start + e.begin) % a.itemsize == 0, (name, e.begin)
        assert blob[header.data_start + e.begin:header.data_start + e.end] == a.tobytes()
        if code != "BF16":  # a zero-copy typed view of the file's bytes, as a memory-mapping reader makes
            view = np.frombuffer(blob, dtype=a.dtype, count=a.size, offset=header.data_start + e.begin)
            assert view.tobytes() == a.tobytes()
    assert [e.dtype for e in header.entries.values()] == ["I64", "F32", "I32", "BF16", "F16", "U8"]
    tensors = {n: RawTensor(code, a.shape, a.view(np.uint8).reshape(-1)) for n, (code, a) in raw.items()}
    assert save_file(tensors, FULL_FILE_METADATA) == blob  # the same file whoever writes it
    loaded = safetensors.torch.load(blob)  # the reference reader agrees
    assert all(loaded[n].view(torch.uint8).numpy().tobytes() == a.tobytes() for n, (_, a) in raw.items())
    with pytest.raises(FormatError, match="b_scale.: F32 data would start at byte 6 "):
        build_header([(n, raw[n][0], raw[n][1].shape, raw[n][1].nbytes) for n in names], None)


def test_delta_file_from_several_ranks_pieces_rebuilds_the_new_bytes() -> None:
    """A delta file assembled from every rank's pieces of each tensor (column boxes and flat ranges, shuffled):
    applied to the parent it rebuilds the new tensors byte for byte, and its Adler-32, combined from every
    piece's shares, passes the reader's check (a combine over some pieces only would fail it)."""
    from fsdp_hotload.arc.adler import add_parts, chunk_parts
    from fsdp_hotload.arc.codecs import ArcV2
    from fsdp_hotload.arc.container import apply_delta_file
    from fsdp_hotload.arc.dense import box_run_tables
    from fsdp_hotload.engine.assemble import assemble_delta_file

    rng = np.random.default_rng(9)
    q, n = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.input_layernorm.weight"
    parent = {q: rng.integers(0, 2**16, (48, 40), dtype=np.uint16), n: rng.integers(0, 2**16, (40,), dtype=np.uint16)}
    new = {k: v.copy() for k, v in parent.items()}
    for v in new.values():
        flat = v.reshape(-1)
        idx = rng.choice(flat.size, flat.size // 10, replace=False)
        flat[idx] ^= rng.integers(1, 2**16, idx.size, dtype=np.uint16)
    plan = plan_shards([TensorSpec(k, v.shape, "BF16") for k, v in parent.items()])
    (filename, _), = plan.files.items()
    codec = ArcV2()
    pieces = []
    for name, boxes, space in ((q, [Box((0, 0), (48, 7)), Box((0, 7), (48, 33))], "shape"),
                               (n, [Box.flat(0, 25), Box.flat(25, 15)], "flat")):
        shape = parent[name].shape if space == "shape" else (parent[name].size,)
        total = parent[name].nbytes
        for b in boxes:
            sl = tuple(slice(s, s + m) for s, m in zip(b.start, b.length))
            old_b = np.ascontiguousarray(parent[name].reshape(shape)[sl]).view(np.uint8).reshape(-1)
            new_b = np.ascontiguousarray(new[name].reshape(shape)[sl]).view(np.uint8).reshape(-1)
            payload, _, delta = codec.encode_delta(old_b, new_b, 2, box_run_tables(b, shape, 2), total)
            parts = add_parts(chunk_parts(old_b, b, shape, 2, total), delta)
            pieces.append(Piece(name, space, tuple(b.start), tuple(b.length), payload, parts))
    random.Random(3).shuffle(pieces)
    blob = assemble_delta_file(plan, filename, pieces, parent_identity="step-1", codec="arc_v2")
    got = apply_delta_file({k: RawTensor("BF16", v.shape, v.view(np.uint8).reshape(-1)) for k, v in parent.items()},
                           blob, expected_parent="step-1")
    for k, v in new.items():
        assert got[k].data.tobytes() == v.tobytes(), k


def test_files_pinned_to_rank_0_count_in_its_load() -> None:
    """Files that hold carried base tensors (which rank 0 alone reads) go to rank 0; the rest balance around them."""
    specs = [TensorSpec(f"model.layers.{i}.w", (100 * (i + 1), 8), "BF16") for i in range(6)]
    plan = plan_shards(specs)
    files = {s.name: plan.file_of(s.name) for s in specs}
    free = assign_owners(plan, 3)
    assert free[files["model.layers.5.w"]] == 0  # the largest file goes first, to rank 0
    pinned = assign_owners(plan, 3, {files["model.layers.0.w"], files["model.layers.4.w"]})
    assert pinned[files["model.layers.0.w"]] == pinned[files["model.layers.4.w"]] == 0
    load = [0, 0, 0]
    for s in specs:
        load[pinned[files[s.name]]] += s.nbytes
    assert load == [(1 + 5 + 2) * 1600, 6 * 1600, (4 + 3) * 1600]  # greedy around rank 0's pinned load


def test_routed_objects_round_trip_with_their_arrays_aligned_views_of_the_received_blob() -> None:
    """Pieces routed to another rank travel out of band (numpy copies them in, with the GIL released) and come back
    as views of the received buffer, each at a 64-byte boundary; bytes, odd lengths, dtypes and layouts survive."""
    from fsdp_hotload.engine.comm import dumps_buffer, loads_buffer

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in (0, 1, 3, 1000)]
    arrays += [rng.standard_normal(7).astype(np.float32), np.arange(12, dtype=np.uint16).reshape(3, 4)[:, ::2]]
    obj = [("model.w", 0, arrays, b"an encoded chunk", {"parts": [(1, 2)], "none": None})]
    received = np.frombuffer(dumps_buffer(obj), dtype=np.uint8).copy()  # what gloo hands the receiving rank
    ((name, pos, back, raw, extra),) = loads_buffer(received)
    assert (name, pos, raw, extra) == obj[0][:2] + obj[0][3:]
    for a, b in zip(arrays, back, strict=True):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes())
    for b in back[1:5]:  # the contiguous ones: no copy, and aligned as a fresh allocation would be
        assert np.shares_memory(b, received) and (b.ctypes.data - received.ctypes.data) % 64 == 0
    with pytest.raises(ValueError, match="cut short"):
        loads_buffer(received[:-1])
