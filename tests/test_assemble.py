"""A full snapshot's file, assembled in one buffer from every rank's pieces, is byte for byte the file our
safetensors writer (``stio.save_file``, whose files the reference reader loads: ``test_format``) makes of the whole
tensors, whatever the pieces' order, boxes or buffer types."""
from __future__ import annotations

import random

import numpy as np
import pytest

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.arc.errors import FormatError
from fsdp_hotload.arc.stio import save_file
from fsdp_hotload.engine.assemble import FULL_FILE_METADATA, Piece, assemble_full_file
from fsdp_hotload.layout import TensorSpec, plan_shards


def _pieces(name: str, full: np.ndarray, boxes: list[Box], space: str) -> list[Piece]:
    """Each box's bytes in box C order, as a rank stages them; alternately numpy views and bytes."""
    out = []
    flat = full.reshape(-1)
    for i, b in enumerate(boxes):
        part = flat[b.start[0]:b.start[0] + b.length[0]] if space == "flat" else \
            full[tuple(slice(s, s + n) for s, n in zip(b.start, b.length))]
        raw = np.ascontiguousarray(part).view(np.uint8).reshape(-1)
        out.append(Piece(name, space, tuple(b.start), tuple(b.length), raw if i % 2 else raw.tobytes()))
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
    assert bytes(got) == want
    with pytest.raises(FormatError, match="cover"):  # a rank's piece missing: refused, never a file with a hole
        assemble_full_file(plan, filename, [p for p in pieces if p.box.numel][1:])


def test_a_piece_of_another_length_than_its_box_is_refused() -> None:
    """numpy would broadcast a short piece over its box and cut a long one: wrong weights, published in silence
    (a full snapshot carries no checksum)."""
    plan = plan_shards([TensorSpec("model.norm.weight", (4,), "BF16")])
    (filename, _), = plan.files.items()
    good = np.arange(8, dtype=np.uint8)
    assert bytes(assemble_full_file(plan, filename, [Piece("model.norm.weight", "flat", (0,), (4,), good)]))[-8:] \
        == good.tobytes()
    for bad in (good[:1], np.arange(10, dtype=np.uint8)):
        with pytest.raises(FormatError, match=f"a chunk of {bad.size} bytes for a box of 4 elements of 2 bytes"):
            assemble_full_file(plan, filename, [Piece("model.norm.weight", "flat", (0,), (4,), bad)])
