"""Routing chunks to file owners and assembling snapshot files from them.

Every file of a snapshot has one owner rank (files are spread over ranks by size, deterministically, so every
rank computes the same map). Ranks send each owner their pieces of that owner's tensors: raw bytes for a full
snapshot, codec payloads plus Adler-32 shares for a delta. The owner puts the pieces together and writes the file.
No rank ever assembles a full tensor for a delta.

Example::

    owners = assign_owners(plan, world=4)
    blob = assemble_delta_file(plan, "model-00002-of-00009.safetensors", pieces, parent_identity="step-...")
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from ..arc.adler import combine
from ..arc.boxes import Box, check_tiling, scatter
from ..arc.container import TensorDelta, build_delta_file
from ..arc.dtypes import RawTensor, numel
from ..arc.stio import write_file

#: The ``__metadata__`` of a full snapshot's files, as Hugging Face's own writer sets it. Why: transformers
#: before 4.48.2 reads ``metadata.get("format")`` unguarded and fails to load a file without it.
FULL_FILE_METADATA = {"format": "pt"}
from ..layout import ShardPlan


@dataclass
class Piece:
    """One rank's part of one tensor, on its way to the file owner."""

    tensor: str
    space: str
    start: tuple[int, ...]
    length: tuple[int, ...]
    data: bytes  # raw chunk bytes (full) or codec payload (delta)
    parts: tuple[int, int] = (0, 0)  # Adler-32 shares of the new chunk bytes (delta)

    @property
    def box(self) -> Box:
        return Box(self.start, self.length)


def assign_owners(plan: ShardPlan, world: int) -> dict[str, int]:
    """File -> rank, balancing bytes greedily (largest files first); identical on every rank."""
    load = [0] * world
    owners: dict[str, int] = {}
    sizes = sorted(((sum(plan.specs[n].nbytes for n in names), f) for f, names in plan.files.items()),
                   key=lambda x: (-x[0], x[1]))
    for size, f in sizes:
        r = min(range(world), key=lambda i: (load[i], i))
        owners[f] = r
        load[r] += size
    return owners


def _space_shape(space: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (numel(shape),) if space == "flat" else shape


def _pieces_by_tensor(filename: str, pieces: list[Piece]) -> dict[str, list[Piece]]:
    out: dict[str, list[Piece]] = {}
    for p in pieces:
        out.setdefault(p.tensor, []).append(p)
    for name, ps in out.items():
        if len({p.space for p in ps}) != 1:
            raise ValueError(f"{filename}: tensor {name!r} arrived in mixed chunk spaces")
        ps.sort(key=lambda p: p.start)
    return out


def assemble_full_file(plan: ShardPlan, filename: str, pieces: list[Piece]) -> bytes:
    """A plain HF safetensors file from raw chunk bytes (tiling checked, so no element is missing)."""
    by_tensor = _pieces_by_tensor(filename, pieces)
    tensors: dict[str, RawTensor] = {}
    for name in plan.files[filename]:
        spec = plan.specs[name]
        ps = by_tensor.get(name, [])
        space = ps[0].space if ps else "flat"
        sshape = _space_shape(space, spec.shape)
        check_tiling([p.box for p in ps], sshape)
        buf = np.empty(spec.nbytes, dtype=np.uint8)
        size = spec.nbytes // max(numel(spec.shape), 1)
        for p in ps:
            scatter(buf, np.frombuffer(p.data, dtype=np.uint8), p.box, sshape, size)
        tensors[name] = RawTensor(spec.dtype, spec.shape, buf)
    out = io.BytesIO()
    write_file(out, tensors, FULL_FILE_METADATA)
    return out.getvalue()


def assemble_delta_file(plan: ShardPlan, filename: str, pieces: list[Piece], *, parent_identity: str,
                        codec: str) -> bytes:
    """A delta file from every rank's encoded chunks; each tensor's Adler-32 is combined from the shares."""
    by_tensor = _pieces_by_tensor(filename, pieces)
    deltas = []
    for name in plan.files[filename]:
        spec = plan.specs[name]
        ps = by_tensor.get(name, [])
        space = ps[0].space if ps else "flat"
        adler = combine([p.parts for p in ps], spec.nbytes)
        deltas.append(TensorDelta(name, spec.dtype, spec.shape, adler, codec, space, [(p.box, p.data) for p in ps]))
    return build_delta_file(deltas, parent_identity=parent_identity)
