"""How one rank holds each tensor of a model: the framework's sources, and the parts of split tensors.

A source is one underlying tensor (plain, an FSDP2 DTensor, an FSDP1 flat parameter's original parameter, or a
part of another) and answers which elements of it this rank publishes and where they live in memory, as
``(space, box, view)`` pieces (see :mod:`.fsdp`, which walks a model into these and names them). Kept apart from
the walk because each framework's metadata, read without communication and without copying, is its own story.

Example::

    src = _DTensorSource(model.layers[0].weight)     # a fully_shard parameter
    for space, box, view in src.pieces("layers.0.weight"):
        ...                                          # "flat": a range of the flattened tensor; "shape": a box
"""
from __future__ import annotations

import importlib
import itertools
from typing import Any

import torch
from torch import nn

from .arc.boxes import Box
from .arc.dtypes import numel
from .naming import Split, split_parts
from .slab import Slab, permute_box, range_boxes

FLAT = "flat"
SHAPE = "shape"


# --------------------------------------------------------------------------------------------- framework access


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _first_importable(*paths: str) -> Any:
    """The first ``module:attr`` that imports (these names moved between torch releases), or None."""
    for path in paths:
        mod, attr = path.split(":")
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError):
            continue
    return None


def _dtensor_type() -> Any:
    return _first_importable("torch.distributed.tensor:DTensor", "torch.distributed._tensor:DTensor")


def _fsdp1_type() -> Any:
    return _first_importable("torch.distributed.fsdp:FullyShardedDataParallel")


def _fsdp2_type() -> Any:
    return _first_importable("torch.distributed.fsdp:FSDPModule", "torch.distributed._composable.fsdp:FSDPModule")


def _local_shape_and_offset(dt: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    # DTensor's own rule, so we agree with it by construction: along each sharded dim, shards are torch.chunk
    # pieces (ceil(n / k) each, the last ones shorter or EMPTY); an empty shard's offset is reported as the
    # dim size. Nested shards of one dim (several mesh dims) compose left to right.
    compute = _first_importable("torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
                                "torch.distributed._tensor._utils:compute_local_shape_and_global_offset")
    shape, offset = compute(dt.shape, dt.device_mesh, dt.placements)
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def _check_strided(name: str, dt: Any, mesh_dim: int) -> None:
    """FSDP2 over tensor parallelism on the same dim (torchtitan's layout) marks the data-parallel shard as
    ``_StridedShard(d, split_factor=k)`` followed by the tensor-parallel ``Shard(d)`` over a mesh dim of size k:
    the TP shard is taken first and FSDP shards it again, so each rank holds one contiguous range along ``d``,
    whose offset DTensor's own rule gives. Any other strided layout interleaves ranges on a rank: refused."""
    pl = dt.placements[mesh_dim]
    k = int(getattr(pl, "split_factor", 0))
    later = [j for j in range(mesh_dim + 1, len(dt.placements))
             if type(dt.placements[j]).__name__ == "Shard" and int(dt.placements[j].dim) == int(pl.dim)]
    if not (len(later) == 1 and dt.device_mesh.size(later[0]) == k):
        raise NotImplementedError(
            f"tensor {name!r}: placements {dt.placements}: strided sharding {pl} without one later Shard({pl.dim}) "
            f"over a mesh dim of size {k} interleaves rows on each rank, which a single box cannot describe"
        )


def _is_flat_param(p: Any) -> bool:
    return bool(getattr(p, "_is_flat_param", False)) or type(p).__name__ == "FlatParameter"


def _view_1d(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(
            f"tensor {name!r} is not contiguous (stride {tuple(t.stride())} for shape {tuple(t.shape)}); "
            "chunks must be views of the framework's storage, so make the parameter contiguous"
        )
    return _flat_alias(t, 0, t.numel())


def _flat_alias(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Elements ``start`` to ``start + n`` of contiguous ``t``'s memory as a 1-D tensor without autograd, which
    sees every later in-place update of ``t``. Why not ``t.detach().view(-1)``: that view keeps the detached tensor
    alive as its base, one more Python object per chunk for every full garbage collection to walk (tens of
    thousands of chunks on an MoE model). A tensor subclass (which may hold no storage of its own) is viewed."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return t.detach().view(-1)[start:start + n]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t, t.storage_offset() + start, (n,), (1,))


# ---------------------------------------------------------------------------------------------------- sources


class _Source:
    """One underlying tensor (several published names may share it) and how this rank holds it."""

    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    def pieces(self, name: str) -> list[tuple[str, Box, torch.Tensor]]:
        """(space, box, source view) for each non-empty part this rank owns (see ``LocalChunk.source``)."""
        raise NotImplementedError

    def boxed(self) -> bool:
        """Whether :meth:`pieces` gives boxes of the shape (``shape`` space) rather than ranges of the flattened
        tensor; the same answer on every rank (from the layout, never from this rank's share)."""
        return False


class _PlainSource(_Source):
    """A tensor every rank holds whole (replicated): owned by global rank 0."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.tensor.shape)

    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def pieces(self, name: str) -> list[tuple[str, Box, torch.Tensor]]:
        view = _view_1d(self.tensor, name)  # checked on every rank, so all of them raise, not only the owner
        if _global_rank() != 0 or self.tensor.numel() == 0:
            return []
        return [(FLAT, Box.flat(0, self.tensor.numel()), view)]


class _DTensorSource(_Source):
    """A DTensor (FSDP2's sharded parameter, possibly on a 2-D HSDP or FSDP+TP mesh)."""

    def __init__(self, dt: Any) -> None:
        self.dt = dt

    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.dt.shape)

    def dtype(self) -> torch.dtype:
        return self.dt.dtype

    def flat_layout(self) -> bool:
        """Whether every rank's part is a range of the flattened tensor: sharded along dim 0 only (the same answer
        on every rank, from the placements)."""
        return all(int(pl.dim) == 0 for pl in self.dt.placements if hasattr(pl, "dim"))  # Shard, _StridedShard

    def boxed(self) -> bool:
        return not self.flat_layout()

    def pieces(self, name: str) -> list[tuple[str, Box, torch.Tensor]]:
        dt = self.dt
        coord = dt.device_mesh.get_coordinate()
        if coord is None:  # this rank is not in the tensor's mesh
            return []
        shard_dims: list[int] = []
        replica = False
        for mesh_dim, pl in enumerate(dt.placements):
            if type(pl).__name__ == "_StridedShard":
                _check_strided(name, dt, mesh_dim)
                shard_dims.append(int(pl.dim))
            elif pl.is_shard():
                shard_dims.append(int(pl.dim))
            elif pl.is_replicate():
                replica = replica or coord[mesh_dim] != 0  # one replica of each shard publishes it
            else:  # checked on every rank, replicas included, so all of them raise
                raise ValueError(f"tensor {name!r} has placement {pl}; reduce partial values before publishing")
        if replica:
            return []
        local = getattr(dt, "_local_tensor", None)
        if local is None:
            local = dt.to_local()
        local_shape, offset = _local_shape_and_offset(dt)
        if tuple(local.shape) != local_shape:
            raise RuntimeError(
                f"tensor {name!r}: local shard has shape {tuple(local.shape)} but its placements "
                f"{dt.placements} give {local_shape}"
            )
        if local.numel() == 0:
            return []
        full = self.shape()
        view = _view_1d(local, name)
        if all(d == 0 for d in shard_dims):
            # A dim-0 slab with all trailing dims whole is one contiguous range of the flattened tensor.
            start = offset[0] * numel(full[1:]) if full else 0
            return [(FLAT, Box.flat(start, local.numel()), view)]
        return [(SHAPE, Box(offset, local_shape), view)]


class _Fsdp1Source(_Source):
    """Original parameter ``index`` of an FSDP1 FlatParameter."""

    def __init__(self, fsdp_module: nn.Module, handle: Any, index: int) -> None:
        self.fsdp_module = fsdp_module
        self.handle = handle
        self.flat = handle.flat_param
        self.index = index

    def shape(self) -> tuple[int, ...]:
        # FSDP1 over tensor parallelism (``FSDP(device_mesh=...)`` around a parallelised model) flattens each
        # DTensor's local block and keeps its spec as the parameter's extension: the flat metadata then describes
        # this TP rank's block, not the tensor, and with even blocks every rank would agree on the block's shape
        # and publish TP rank 0's block as the whole tensor. Refused on every rank (the layout is the same on all).
        extensions = getattr(self.flat, "_param_extensions", None)
        if extensions and extensions[self.index] is not None:
            placements = getattr(extensions[self.index], "placements", extensions[self.index])
            raise NotImplementedError(
                f"tensor {self.flat._fqns[self.index]!r} is a DTensor ({placements}) inside an FSDP1 flat "
                "parameter: FSDP1 over tensor parallelism is not supported; use FSDP2 (fully_shard) over tensor "
                "parallelism")
        return tuple(int(s) for s in self.flat._shapes[self.index])

    def _local_shard(self) -> torch.Tensor:
        # `_local_shard` is the sharded (padded, full-precision) flat parameter; `flat_param.data` may point at
        # the unsharded or low-precision copy while a forward is in progress. Before FSDP's lazy init there
        # is no `_local_shard` yet and the flat parameter itself is the sharded one.
        local = getattr(self.flat, "_local_shard", None)
        if local is None:
            local = self.flat
        expected = getattr(self.flat, "_sharded_size", None)
        if expected is not None and local.numel() != numel(tuple(expected)):
            raise RuntimeError(
                f"FSDP flat parameter holding {list(self.flat._fqns)} is not in its sharded state "
                f"({local.numel()} elements, {numel(tuple(expected))} expected)"
            )
        return local.detach()

    def dtype(self) -> torch.dtype:
        return self._local_shard().dtype

    def _owner(self) -> bool:
        strategy = getattr(getattr(self.handle, "_sharding_strategy", None), "name", "FULL_SHARD")
        if strategy == "NO_SHARD":  # every rank of the group holds the whole flat parameter
            return int(self.handle.rank) == 0
        if "HYBRID" in strategy:  # shards are replicated across the inter-node group: replica 0 publishes
            import torch.distributed as dist

            inter = getattr(self.fsdp_module, "_inter_node_pg", None)
            if inter is not None and dist.get_rank(group=inter) != 0:
                return False
        return True

    def pieces(self, name: str) -> list[tuple[str, Box, torch.Tensor]]:
        contiguities = getattr(self.flat, "_contiguities", None)  # the same on every rank: all of them raise
        if contiguities is not None and not contiguities[self.index]:
            raise NotImplementedError(
                f"tensor {name!r} was not contiguous when FSDP flattened it, so its flat range is in memory "
                "order, not C order; make the parameter contiguous before wrapping"
            )
        info = self.flat._shard_param_infos[self.index]
        if not info.in_shard or not info.numel_in_shard or not self._owner():
            return []
        start, n = int(info.intra_param_start_idx), int(info.numel_in_shard)
        if int(info.intra_param_end_idx) - start + 1 != n or start + n > int(self.flat._numels[self.index]):
            raise RuntimeError(f"tensor {name!r}: inconsistent FSDP shard metadata {info}")
        local = self._local_shard()
        at = int(info.offset_in_shard)
        if at < 0 or at + n > local.numel():
            raise RuntimeError(f"tensor {name!r}: shard range {info} exceeds the local shard ({local.numel()})")
        return [(FLAT, Box.flat(start, n), _flat_alias(local, at, n))]


class Segment(_Source):
    """A published tensor that is the contiguous range ``[start, start + numel(part_shape))`` of another tensor's
    flattened elements (see ``naming.Split``), viewed as ``part_shape`` and, with ``perm``, permuted, and with
    ``as_shape`` reshaped: its pieces are the base's, cut to that range (a base sharded along another dim than 0:
    each box cut to the part's slab, :mod:`.slab`; a permuted part: each range cut into boxes, which are permuted;
    a reshaped one: each permuted box cut into runs of the flattened tensor, :func:`_flat_runs`). The segments of one
    walk share ``seen``, so a base's pieces are worked out once, not once per part (thousands per MoE layer)."""

    def __init__(self, base: _Source, base_path: str, start: int, part_shape: tuple[int, ...],
                 perm: tuple[int, ...] | None, seen: dict[int, list[tuple[str, Box, torch.Tensor]]],
                 as_shape: tuple[int, ...] | None = None) -> None:
        self.base, self.base_path, self.start, self.part_shape = base, base_path, int(start), part_shape
        self.perm, self._seen, self.as_shape = perm, seen, as_shape

    def permuted_shape(self) -> tuple[int, ...]:
        return self.part_shape if self.perm is None else tuple(self.part_shape[d] for d in self.perm)

    def shape(self) -> tuple[int, ...]:
        return self.permuted_shape() if self.as_shape is None else self.as_shape

    def dtype(self) -> torch.dtype:
        return self.base.dtype()

    def boxed(self) -> bool:
        return self.as_shape is None and (self.perm is not None or self.base.boxed())

    def pieces(self, name: str) -> list[tuple[str, Box, torch.Tensor]]:
        slab = None
        if isinstance(self.base, _DTensorSource) and not self.base.flat_layout():  # decided alike on every rank
            slab = Slab.of(self.base.shape(), self.start, numel(self.part_shape))
            if slab is None or not slab.fits(self.part_shape):
                raise NotImplementedError(
                    f"tensor {name!r} is split from {self.base_path!r} (shape {self.base.shape()}), which is sharded "
                    f"along a dimension other than 0 ({self.base.dt.placements}); such a tensor's parts must each be "
                    "a slab of it (fixed leading indices, a range of one dim, the later dims whole) in its own "
                    f"shape, and elements {self.start}.. as {self.part_shape} are not")
        end = self.start + numel(self.part_shape)
        boxes: list[tuple[Box, torch.Tensor]] = []  # boxes of the part (in part_shape) with their data
        out = []
        if id(self.base) not in self._seen:  # its errors name the model's parameter, not a part it has not
            self._seen[id(self.base)] = self.base.pieces(self.base_path)
        for space, box, view in self._seen[id(self.base)]:
            if slab is not None and space == SHAPE:  # a box of the tensor: its part of the slab, one run of the view
                cut = slab.cut(box, self.part_shape)
                if cut is not None:
                    part_box, offset, count = cut
                    boxes.append((part_box, view[offset:offset + count]))
                continue
            if space != FLAT:  # pragma: no cover - a box-sharded base is a DTensor that is not flat_layout
                raise RuntimeError(f"tensor {name!r}: a {space} piece of {self.base_path!r} cannot be split")
            lo, n = box.start[0], box.length[0]
            a, b = max(lo, self.start), min(lo + n, end)
            if a >= b:
                continue
            if self.perm is None:
                out.append((FLAT, Box.flat(a - self.start, b - a), view[a - lo:b - lo]))
            else:
                boxes += [(bx, view[a - lo + o:a - lo + o + k]) for bx, o, k in
                          range_boxes(self.part_shape, a - self.start, b - a)]
        if self.perm is not None:
            boxes = [(permute_box(bx, self.perm), v.view(bx.length).permute(self.perm)) for bx, v in boxes]
        if self.as_shape is not None:  # published reshaped: ranges of it (a range of the part is one already)
            return out + [(FLAT, run, view) for bx, v in boxes for run, view in
                          _flat_runs(bx, v if self.perm else v.view(bx.length), self.permuted_shape())]
        return out + [(SHAPE, bx, v) for bx, v in boxes]


def _flat_runs(box: Box, view: torch.Tensor, shape: tuple[int, ...]) -> list[tuple[Box, torch.Tensor]]:
    """A box of a C-ordered tensor of ``shape`` (its elements in ``view``, shaped as the box) as ranges of the
    flattened tensor, each with the part of ``view`` that holds it in its order. The dims after the last one the
    box does not span whole stay together, so a box of whole rows is one range, one of part of each row a range
    per row."""
    lead = max((d for d in range(len(shape)) if box.length[d] != shape[d]), default=-1)  # the last partial dim
    if lead < 0:
        return [(Box.flat(0, numel(shape)), view)]
    count = box.length[lead] * numel(shape[lead + 1:])
    out = []
    for idx in itertools.product(*(range(n) for n in box.length[:lead])):
        first = 0
        for d in range(len(shape)):  # the run's first element, raveled
            first = first * shape[d] + (box.start[d] + idx[d] if d < lead else box.start[d] if d == lead else 0)
        out.append((Box.flat(first, count), view[idx]))
    return out


class Joined(_Source):
    """A published tensor that is several tensors concatenated along dim 0, in order (a checkpoint that keeps q, k
    and v as one tensor; ``rename`` gave them one name at different positions): its pieces are the members',
    moved down by the rows before each. Members must agree in dtype and in every dim after the first.

    Why no copy: each member's part on this rank is already a range (or boxes) of the joined tensor, so the rank
    publishes it where it lies, as it does a split's part."""

    def __init__(self, name: str, members: list[tuple[str, _Source]]) -> None:
        self.members = members  # (path, source) in the joined order
        shapes = [src.shape() for _p, src in members]
        dtypes = {src.dtype() for _p, src in members}
        if any(not sh or sh[1:] != shapes[0][1:] for sh in shapes) or len(dtypes) > 1:
            listed = ", ".join(f"{p!r} {sh} {src.dtype()}" for (p, src), sh in zip(members, shapes))
            raise ValueError(f"tensor {name!r} joins {listed} along dim 0: every block must have at least one dim, "
                             "the same dims after the first and the same dtype")
        self._shape = (sum(sh[0] for sh in shapes), *shapes[0][1:])
        self.rows = [0, *itertools.accumulate(sh[0] for sh in shapes)][:-1]  # each member's first row

    def shape(self) -> tuple[int, ...]:
        return self._shape

    def dtype(self) -> torch.dtype:
        return self.members[0][1].dtype()

    def boxed(self) -> bool:
        return any(src.boxed() for _p, src in self.members)

    def pieces(self, name: str) -> list[tuple[str, Box, torch.Tensor]]:
        boxed, per_row = self.boxed(), numel(self._shape[1:])
        out = []
        for (path, src), row in zip(self.members, self.rows):
            for space, box, view in src.pieces(path):  # errors name the model's parameter, not the joined tensor
                if space == SHAPE:
                    out.append((SHAPE, Box((box.start[0] + row, *box.start[1:]), box.length), view))
                elif not boxed:
                    out.append((FLAT, Box.flat(box.start[0] + row * per_row, box.length[0]), view))
                else:  # one member is boxed, so all are: this range as boxes of the member, then moved down
                    out += [(SHAPE, Box((bx.start[0] + row, *bx.start[1:]), bx.length), part)
                            for bx, part in _range_as_boxes(src.shape(), box.start[0], view)]
        return out


def _range_as_boxes(shape: tuple[int, ...], start: int, view: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """Elements ``[start, start + view.numel())`` of a C-ordered tensor of ``shape``, which ``view`` holds in its own
    C order, as boxes of that tensor (:func:`~fsdp_hotload.slab.range_boxes`), each with the view of its elements.

    Why not slices of ``view``: a range of a part published reshaped is held by an N-D strided view (its run of the
    permuted part, :func:`_flat_runs`), and slicing that counts rows of its first dim, not elements. Such a view is
    cut along its first dim until each box's elements are one box of it (or it is 1-D, where a slice is a range)."""
    if view.dim() <= 1:
        return [(bx, view[o:o + k]) for bx, o, k in range_boxes(shape, start, int(view.numel()))]
    out = []
    for bx, o, k in range_boxes(shape, start, int(view.numel())):
        (held, _o, _k), *more = range_boxes(tuple(view.shape), o, k)  # a range of the view is boxes of it
        part = None if more else view[tuple(slice(a, a + n) for a, n in zip(held.start, held.length))]
        try:
            part = None if part is None else part.view(bx.length)  # read in the box's shape, as boxes are
        except RuntimeError:  # its strides do not allow that shape
            part = None
        if part is None:
            rows = int(view[0].numel())
            return [piece for i in range(view.shape[0]) for piece in _range_as_boxes(shape, start + i * rows, view[i])]
        out.append((bx, part))
    return out


def split_slots(slots: list[tuple[str, _Source]], split: Split | None) -> list[tuple[str, _Source]]:
    """``slots`` with each tensor that ``split`` divides replaced by its parts (one :class:`Segment` per range
    and tensor, so the names of a tensor registered twice still share their parts)."""
    if split is None:
        return slots
    out: list[tuple[str, _Source]] = []
    made: dict[tuple[Any, ...], Segment] = {}
    seen: dict[int, list[tuple[str, Box, torch.Tensor]]] = {}
    for path, src in slots:
        parts = split_parts(split, path, src.shape())
        if parts is None:
            out.append((path, src))
        for name, start, shape, perm, as_shape in parts or []:
            key = (id(src), start, shape, perm, as_shape)
            out.append((name, made.setdefault(key, Segment(src, path, start, shape, perm, seen, as_shape))))
    return out
