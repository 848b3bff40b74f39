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

from typing import Callable, Collection, Iterator, NamedTuple, Sequence

import numpy as np

from ..arc.adler import combine
from ..arc.boxes import Box, check_tiling, scatter
from ..arc.container import TensorDelta, build_delta_file
from ..arc.dtypes import numel
from ..arc.stio import CHECKSUM_KEY, build_header, checksum_text, data_order

#: The ``__metadata__`` of a full snapshot's files, as Hugging Face's own writer sets it. Why: transformers
#: before 4.48.2 reads ``metadata.get("format")`` unguarded and fails to load a file without it.
FULL_FILE_METADATA = {"format": "pt"}
from ..layout import ShardPlan
from .copies import empty_bytes


class Piece(NamedTuple):
    """One rank's part of one tensor, on its way to the file owner.

    Until its file is assembled a piece travels as a plain tuple of these fields (:data:`RawPiece`;
    ``Piece._make`` names them). Why: the publisher holds one per chunk from the encode to the assembly, long
    enough to reach the garbage collector's oldest generation, and an exact tuple of strings, ints, bytes and
    arrays drops out of the collector's lists at its first collection, where any other object stays; at tens of
    thousands of chunks, objects per piece set off a full collection (which holds the GIL) every publish or two."""

    tensor: str
    space: str
    start: tuple[int, ...]
    length: tuple[int, ...]
    # full: the raw chunk bytes (uint8, possibly a view of the staged bytes), or, for a whole tensor, a function that
    # fills the tensor's place in the file when it is assembled and returns its Adler-32 shares (a carried base
    # tensor, on rank 0); delta: payload
    data: bytes | np.ndarray | Callable[[np.ndarray], tuple[int, int]]
    parts: tuple[int, int] = (0, 0)  # Adler-32 shares of the new chunk bytes (delta)

    @property
    def box(self) -> Box:
        return Box(self.start, self.length)


RawPiece = tuple[str, str, tuple[int, ...], tuple[int, ...],
                 "bytes | np.ndarray | Callable[[np.ndarray], tuple[int, int]]",
                 tuple[int, int]]  # see Piece


def assign_owners(plan: ShardPlan, world: int, on_rank_0: Collection[str] = ()) -> dict[str, int]:
    """File -> rank, balancing bytes greedily (largest files first); identical on every rank. The files named in
    ``on_rank_0`` (those holding carried base tensors, which rank 0 alone reads) go to rank 0, counted in its load."""
    load = [0] * world
    owners: dict[str, int] = {}
    sizes = sorted(((sum(plan.specs[n].nbytes for n in names), f) for f, names in plan.files.items()),
                   key=lambda x: (x[1] not in on_rank_0, -x[0], x[1]))
    for size, f in sizes:
        if f in on_rank_0:
            owners[f] = 0
            load[0] += size
            continue
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


def assemble_full_file(plan: ShardPlan, filename: str, pieces: list[Piece]) -> memoryview:
    """A plain HF safetensors file from raw chunk bytes (tiling checked, so no element is missing), built in one
    buffer of the file's size: the pieces land where the file holds them, with no per-tensor copy in between.

    Each tensor's checksum (``CHECKSUM_KEY``) is combined from the Adler-32 shares the ranks computed from their
    staged bytes, so a replica that checks it checks the trainer's bytes end to end, routing and assembly
    included, at no extra pass here (a carried tensor's is computed as it is read, see ``Carrier``)."""
    by_tensor = _pieces_by_tensor(filename, pieces)
    specs = [plan.specs[n] for n in data_order({n: plan.specs[n].dtype for n in plan.files[filename]})]
    items = [(s.name, s.dtype, s.shape, s.nbytes) for s in specs]
    header = build_header(items, {**FULL_FILE_METADATA, CHECKSUM_KEY: checksum_text([0] * len(specs))})
    view = empty_bytes(len(header) + sum(s.nbytes for s in specs))  # every byte is written below
    out = memoryview(view)
    pos = len(header)
    sums: list[int] = []
    for spec in specs:
        ps = by_tensor.get(spec.name, [])
        space = ps[0].space if ps else "flat"
        sshape = _space_shape(space, spec.shape)
        check_tiling([p.box for p in ps], sshape)
        size = spec.nbytes // max(numel(spec.shape), 1)
        parts = []
        for p in ps:
            if callable(p.data):  # a whole tensor, read straight into its place in the file
                if space != "flat" or p.box.start != (0,) or p.box.length != (numel(spec.shape),):
                    raise ValueError(f"{filename}: tensor {p.tensor!r}: a piece read at assembly must be the "
                                     "whole tensor")
                parts.append(p.data(view[pos:pos + spec.nbytes]))
                continue
            scatter(view[pos:pos + spec.nbytes], np.frombuffer(p.data, dtype=np.uint8), p.box, sshape, size)
            parts.append(p.parts)
        sums.append(combine(parts, spec.nbytes))
        pos += spec.nbytes
    final = build_header(items, {**FULL_FILE_METADATA, CHECKSUM_KEY: checksum_text(sums)})
    assert len(final) == len(header)  # fixed-width checksums: the data section stays where it was laid out
    out[:len(final)] = final
    return out


def assemble_delta_file(plan: ShardPlan, filename: str, pieces: Sequence[RawPiece], *, parent_identity: str,
                        codec: str) -> bytes:
    """A delta file from every rank's encoded chunks (plain tuples or Pieces); each tensor's Adler-32 is combined
    from the shares. The tensors are handed to the file's writer one at a time, so no object per tensor or piece
    lives through the whole file (see :class:`Piece` for why that matters)."""
    names = plan.files[filename]
    where = {name: i for i, name in enumerate(names)}
    ordered = sorted((p for p in pieces if p[0] in where), key=lambda p: (where[p[0]], p[2]))

    def tensors() -> Iterator[TensorDelta]:
        at = 0
        for name in names:
            group = []
            while at < len(ordered) and ordered[at][0] == name:
                group.append(Piece._make(ordered[at]))
                at += 1
            if len({p.space for p in group}) > 1:
                raise ValueError(f"{filename}: tensor {name!r} arrived in mixed chunk spaces")
            spec = plan.specs[name]
            space = group[0].space if group else "flat"
            adler = combine([p.parts for p in group], spec.nbytes)
            yield TensorDelta(name, spec.dtype, spec.shape, adler, codec, space, [(p.box, p.data) for p in group])

    return build_delta_file(tensors(), parent_identity=parent_identity)
