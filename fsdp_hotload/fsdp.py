"""FSDP adapter: which parts of which Hugging Face tensors this rank holds, as chunks.

The publisher never assembles a full tensor for a delta: each rank diffs and encodes the elements it already
holds. This module answers, for one rank, "which elements of which published tensor are mine, and where do they
live in memory", without any communication and without copying data:

* FSDP2 (``fully_shard``): parameters are DTensors. The local tensor is the rank's shard; its place in the full
  tensor comes from the placements (Shard(0) by default: a dim-0 slab, i.e. one contiguous element range).
* FSDP1 (``FullyShardedDataParallel``, ``use_orig_params`` True or False): parameters are flattened and
  concatenated into a FlatParameter whose per-rank shard is a contiguous range that may cut tensors anywhere.
  The flat parameter's own shard metadata says which element range of each original tensor is in this rank's
  shard and where; each such range becomes a ``flat`` chunk.
* Plain tensors (an unwrapped model, parameters FSDP was told to ignore, buffers): replicated, so rank 0 owns
  them whole and the other ranks publish nothing of them. Every element has exactly one owner.
* Split tensors (``split=``, e.g. fused MoE experts published per expert): each part is a range of its tensor's
  flattened elements, so a rank's part of it is its pieces of the tensor cut to that range (:class:`Segment`); of
  a tensor sharded along another dim, each part must be a slab of it (one expert, or a range of its rows).

Chunk ``source`` tensors are views into the framework's own storage (the sharded, full-precision master
copy), so staging at publish time is at most one device copy per chunk (one per run of adjacent chunks, such as a
split tensor's parts), and chunks taken once stay live across steps (see :func:`local_chunks` for when they do not).

Example::

    chunks = local_chunks(model, tie_word_embeddings=True)
    for c in chunks:                      # c.box is in c.space ("flat": (numel,), "shape": c.shape)
        staging[c.name].copy_(c.source)   # the engine casts fp32 masters to c.dtype ("BF16") while copying
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

import torch
from torch import nn

from .arc.boxes import Box
from .arc.dtypes import numel
from .dtype_policy import DtypePolicy
from .naming import Rename, Split, clean_name, plan_names, split_parts
from .slab import Slab

FLAT = "flat"
SHAPE = "shape"

TensorSpec = tuple[str, tuple[int, ...], str]


@dataclass(frozen=True)
class ChunkMeta:
    """A chunk without its data: what :func:`check_ownership` needs, and small enough to send between ranks.

    Example::

        metas = [c.meta() for c in local_chunks(model)]
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    space: str
    box: Box

    @property
    def space_shape(self) -> tuple[int, ...]:
        return space_shape(self.space, self.shape)


@dataclass(frozen=True, eq=False)
class LocalChunk:
    """The part of one published tensor that this rank holds (``eq=False``: tensors have no boolean equality).

    Example::

        c = local_chunks(model)[0]
        full = torch.empty(c.shape, dtype=torch.bfloat16)
        full.view(-1)[c.box.start[0]:c.box.start[0] + c.box.length[0]] = c.source   # when c.space == "flat"
    """

    name: str  # HF tensor name (wrapper prefixes stripped, user rename applied)
    shape: tuple[int, ...]  # full tensor shape
    dtype: str  # dtype code of the published tensor (snapshot dtype for floating tensors)
    space: str  # "flat": box over (numel,); "shape": box over shape
    box: Box  # the part this rank holds
    source: torch.Tensor  # 1-D view of this rank's elements in box C order, original dtype and device

    @property
    def space_shape(self) -> tuple[int, ...]:
        return space_shape(self.space, self.shape)

    def meta(self) -> ChunkMeta:
        return ChunkMeta(self.name, self.shape, self.dtype, self.space, self.box)


class _ChunkLike(Protocol):
    name: str
    shape: tuple[int, ...]
    dtype: str
    space: str
    box: Box


class OwnershipError(ValueError):
    """Chunks from all ranks do not cover every tensor element exactly once (or disagree with the specs)."""


def space_shape(space: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a chunk's box lives in: ``(numel,)`` for ``flat``, the tensor shape for ``shape``."""
    if space == FLAT:
        return (numel(tuple(shape)),)
    if space == SHAPE:
        return tuple(int(s) for s in shape)
    raise ValueError(f"unknown chunk space {space!r} (expected {FLAT!r} or {SHAPE!r})")


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
    t = t.detach()
    if not t.is_contiguous():
        raise ValueError(
            f"tensor {name!r} is not contiguous (stride {tuple(t.stride())} for shape {tuple(t.shape)}); "
            "chunks must be views of the framework's storage, so make the parameter contiguous"
        )
    return t.view(-1)


# ---------------------------------------------------------------------------------------------------- sources


class _Source:
    """One underlying tensor (several published names may share it) and how this rank holds it."""

    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    def pieces(self, name: str) -> list[tuple[str, Box, torch.Tensor]]:
        """(space, box, 1-D source view) for each non-empty part this rank owns."""
        raise NotImplementedError


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
        view = local[int(info.offset_in_shard):int(info.offset_in_shard) + n]
        if view.numel() != n:
            raise RuntimeError(f"tensor {name!r}: shard range {info} exceeds the local shard ({local.numel()})")
        return [(FLAT, Box.flat(start, n), view)]


class Segment(_Source):
    """A published tensor that is the contiguous range ``[start, start + numel(shape))`` of another tensor's
    flattened elements (see ``naming.Split``): its pieces are the base's, cut to that range (a base sharded along
    another dim than 0: each box cut to the part's slab, :mod:`.slab`). The segments of one walk share ``seen``, so
    a base's pieces are worked out once, not once per part (thousands per MoE layer)."""

    def __init__(self, base: _Source, base_path: str, start: int, shape: tuple[int, ...],
                 seen: dict[int, list[tuple[str, Box, torch.Tensor]]]) -> None:
        self.base, self.base_path, self.start, self._shape, self._seen = base, base_path, int(start), shape, seen

    def shape(self) -> tuple[int, ...]:
        return self._shape

    def dtype(self) -> torch.dtype:
        return self.base.dtype()

    def pieces(self, name: str) -> list[tuple[str, Box, torch.Tensor]]:
        slab = None
        if isinstance(self.base, _DTensorSource) and not self.base.flat_layout():  # decided alike on every rank
            slab = Slab.of(self.base.shape(), self.start, numel(self._shape))
            if slab is None or not slab.fits(self._shape):
                raise NotImplementedError(
                    f"tensor {name!r} is split from {self.base_path!r} (shape {self.base.shape()}), which is sharded "
                    f"along a dimension other than 0 ({self.base.dt.placements}); such a tensor's parts must each be "
                    "a slab of it (fixed leading indices, a range of one dim, the later dims whole) in its own "
                    f"shape, and elements {self.start}.. as {self._shape} are not")
        end = self.start + numel(self._shape)
        out = []
        if id(self.base) not in self._seen:
            self._seen[id(self.base)] = self.base.pieces(name)
        for space, box, view in self._seen[id(self.base)]:
            if slab is not None and space == SHAPE:  # a box of the tensor: its part of the slab, one run of the view
                cut = slab.cut(box, self._shape)
                if cut is not None:
                    part_box, offset, count = cut
                    out.append((SHAPE, part_box, view[offset:offset + count]))
                continue
            if space != FLAT:  # pragma: no cover - a box-sharded base is a DTensor that is not flat_layout
                raise RuntimeError(f"tensor {name!r}: a {space} piece of {self.base_path!r} cannot be split")
            lo, n = box.start[0], box.length[0]
            a, b = max(lo, self.start), min(lo + n, end)
            if a < b:
                out.append((FLAT, Box.flat(a - self.start, b - a), view[a - lo:b - lo]))
        return out


def _split_slots(slots: list[tuple[str, _Source]], split: Split | None) -> list[tuple[str, _Source]]:
    """``slots`` with each tensor that ``split`` divides replaced by its parts (one :class:`Segment` per range
    and tensor, so the names of a tensor registered twice still share their parts)."""
    if split is None:
        return slots
    out: list[tuple[str, _Source]] = []
    made: dict[tuple[int, int, tuple[int, ...]], Segment] = {}
    seen: dict[int, list[tuple[str, Box, torch.Tensor]]] = {}
    for path, src in slots:
        parts = split_parts(split, path, src.shape())
        if parts is None:
            out.append((path, src))
        for name, start, shape in parts or []:
            out.append((name, made.setdefault((id(src), start, shape), Segment(src, path, start, shape, seen))))
    return out


# -------------------------------------------------------------------------------------------------------- walk


def _framework_maps(
    model: nn.Module,
) -> tuple[dict[tuple[int, str], _Source], dict[int, list[tuple[str, _Source]]], dict[int, _Source]]:
    """Sources of framework-managed parameters, keyed by (id(owning module), attribute name).

    Looked up by module slot rather than by the attribute's current value, so the answer does not depend on
    whether the framework has the parameter sharded or unsharded at the moment (FSDP2 swaps plain unsharded
    tensors into modules between forward and backward; FSDP1 replaces them with views of the flat parameter).
    Also returns, per module, the FSDP1-managed slots in flat-parameter order: with ``use_orig_params=False``
    they are no longer registered parameters, so the walk must add them itself. The third map holds FSDP2's
    sharded DTensors by id, so that the same DTensor found anywhere else is recognised as the same tensor.
    """
    by_slot: dict[tuple[int, str], _Source] = {}
    by_tensor: dict[int, _Source] = {}
    fsdp1_by_module: dict[int, list[tuple[str, _Source]]] = {}
    fsdp1, fsdp2 = _fsdp1_type(), _fsdp2_type()
    for mod in model.modules():
        if fsdp1 is not None and isinstance(mod, fsdp1):
            handle = getattr(mod, "_handle", None)
            if handle is None:
                continue
            flat = handle.flat_param
            for i, info in enumerate(flat._param_infos):
                src = _Fsdp1Source(mod, handle, i)
                by_slot[(id(info.module), info.param_name)] = src
                fsdp1_by_module.setdefault(id(info.module), []).append((info.param_name, src))
            for shared in flat._shared_param_infos:
                src = by_slot[(id(shared.prim_module), shared.prim_param_name)]
                by_slot[(id(shared.module), shared.param_name)] = src
                fsdp1_by_module.setdefault(id(shared.module), []).append((shared.param_name, src))
        if fsdp2 is not None and isinstance(mod, fsdp2):
            state = mod._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch < 2.9: at most one group per module
                group = getattr(state, "_fsdp_param_group", None)
                groups = [group] if group is not None else []
            for group in groups:
                for fp in group.fsdp_params:
                    src = _DTensorSource(fp.sharded_param)
                    by_tensor[id(fp.sharded_param)] = src
                    info = fp._module_info
                    by_slot[(id(info.module), info.param_name)] = src
                    for m, pname in zip(info.shared_modules, info.shared_param_names):
                        by_slot[(id(m), pname)] = src
    return by_slot, fsdp1_by_module, by_tensor


def _slots(model: nn.Module, include_buffers: bool) -> list[tuple[str, _Source]]:
    """Every place a tensor is registered, as (cleaned path, source), in ``state_dict`` order.

    (Within one module, FSDP1 re-registers the parameters it flattens after those it ignores, so there the
    order can differ from the unwrapped model's; it is the same on every rank.)
    """
    by_slot, fsdp1_by_module, by_tensor = _framework_maps(model)  # by_tensor: one source per tensor object
    dtensor = _dtensor_type()

    def source_of(t: torch.Tensor) -> _Source:
        src = by_tensor.get(id(t))
        if src is None:
            src = _DTensorSource(t) if dtensor is not None and isinstance(t, dtensor) else _PlainSource(t)
            by_tensor[id(t)] = src
        return src

    slots: list[tuple[str, _Source]] = []

    def add(prefix: str, attr: str, src: _Source) -> None:
        slots.append((clean_name(f"{prefix}.{attr}" if prefix else attr), src))

    for prefix, mod in model.named_modules(remove_duplicate=False):
        done: set[str] = set()
        for pname, p in mod._parameters.items():
            if p is None or _is_flat_param(p):
                continue
            src = by_slot.get((id(mod), pname))
            if src is None:
                src = source_of(p)
            add(prefix, pname, src)
            done.add(pname)
        for pname, src in fsdp1_by_module.get(id(mod), []):
            if pname not in done:
                add(prefix, pname, src)
                done.add(pname)
        if include_buffers:
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for bname, b in mod._buffers.items():
                if b is not None and bname not in skip:
                    add(prefix, bname, source_of(b))
    return slots


def _plan(
    model: nn.Module, rename: Rename | None, tie_word_embeddings: bool | None, include_buffers: bool,
    split: Split | None = None,
) -> list[tuple[str, _Source, list[str]]]:
    """(published name, source, cleaned paths of that source with this name's own path first); a split's parts
    are named before ``rename`` sees them."""
    slots = _split_slots(_slots(model, include_buffers), split)
    paths_of: dict[int, list[str]] = {}
    for raw, src in slots:
        paths_of.setdefault(id(src), []).append(raw)
    first = {}  # a tensor split under one name and not another is one tensor: its first part stands for it
    for _raw, src in slots:
        if isinstance(src, Segment):
            first.setdefault(id(src.base), id(src))
    planned = plan_names([(raw, first.get(id(src), id(src))) for raw, src in slots], rename=rename,
                         tie_word_embeddings=tie_word_embeddings)
    out = []
    for name, i in planned:
        raw, src = slots[i]
        out.append((name, src, [raw, *(p for p in paths_of[id(src)] if p != raw)]))
    return out


# ------------------------------------------------------------------------------------------------- public API


def local_chunks(
    model: nn.Module,
    *,
    snapshot_dtype: str = "BF16",
    dtype_overrides: Mapping[str, str] | None = None,
    rename: Rename | None = None,
    tie_word_embeddings: bool | None = None,
    include_buffers: bool = True,
    split: Split | None = None,
) -> list[LocalChunk]:
    """The chunks this rank owns, in ``state_dict`` order. No communication, no data copies.

    Ranks that hold nothing of a tensor (empty FSDP shards, non-zero ranks for replicated tensors, replicas
    other than the first under HSDP or FSDP1 NO_SHARD) return no chunk for it; chunks are never empty.

    Sources stay views of the live parameters across training steps as long as the framework keeps its
    storage: FSDP2 from ``fully_shard`` on, FSDP1 from wrapping on (its lazy init keeps the storage, except
    with CPU offload, which pins a new copy: take the chunks after the first forward there). Loading a state
    dict or moving the model replaces storages; take the chunks again after that.
    """
    policy = DtypePolicy.of(snapshot_dtype, dtype_overrides)
    chunks: list[LocalChunk] = []
    for name, src, _paths in _plan(model, rename, tie_word_embeddings, include_buffers, split):
        shape, dtype = src.shape(), policy.code(name, src.dtype())
        for space, box, view in src.pieces(name):
            chunks.append(LocalChunk(name, shape, dtype, space, box, view))
    return chunks


def storage_fingerprint(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Identity and data pointer of every tensor that chunk sources can be views of, in module order.

    Why: walking the model for chunks costs milliseconds on the trainer's thread (names, placements, FSDP1
    metadata), while this costs about a microsecond per tensor. Equal fingerprints mean every parameter and
    buffer object is the same and still owns the same memory, so views taken earlier still see the live
    values; a replaced parameter, a moved model or FSDP1's CPU-offload copy changes it. Held views keep their
    memory alive, so an address cannot be reused while they exist.

    Example::

        fp = storage_fingerprint(model)
        chunks = local_chunks(model)
        ...
        if storage_fingerprint(model) != fp:
            chunks = local_chunks(model)
    """
    out: list[tuple[int, int]] = []
    for mod in model.modules():
        for group in (mod._parameters, mod._buffers):
            for t in group.values():
                if t is None:
                    continue
                local = getattr(t, "_local_tensor", None)  # FSDP2 DTensor
                if local is None:
                    local = getattr(t, "_local_shard", None)  # FSDP1 flat parameter
                out.append((id(t), int((t if local is None else local).data_ptr())))
    return tuple(out)


def full_tensor_specs(
    model: nn.Module,
    *,
    snapshot_dtype: str = "BF16",
    dtype_overrides: Mapping[str, str] | None = None,
    rename: Rename | None = None,
    tie_word_embeddings: bool | None = None,
    include_buffers: bool = True,
    split: Split | None = None,
) -> list[TensorSpec]:
    """``(name, full shape, dtype code)`` of every published tensor, the same list on every rank."""
    policy = DtypePolicy.of(snapshot_dtype, dtype_overrides)
    return [
        (name, src.shape(), policy.code(name, src.dtype()))
        for name, src, _paths in _plan(model, rename, tie_word_embeddings, include_buffers, split)
    ]


def source_dtypes(
    model: nn.Module,
    *,
    rename: Rename | None = None,
    tie_word_embeddings: bool | None = None,
    include_buffers: bool = True,
    split: Split | None = None,
) -> dict[str, torch.dtype]:
    """The trainer's dtype of every published tensor (FSDP's sharded parameters: the masters), by name."""
    return {name: src.dtype()
            for name, src, _paths in _plan(model, rename, tie_word_embeddings, include_buffers, split)}


def tensor_paths(model: nn.Module, *, include_buffers: bool = True) -> list[str]:
    """Every tensor's cleaned path before any rename, FSDP1's flattened parameters included (its
    ``named_parameters`` lists only the flat parameter when ``use_orig_params=False``)."""
    return [path for path, _src in _slots(model, include_buffers)]
