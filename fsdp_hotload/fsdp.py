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
* Joined tensors (``rename`` giving several tensors one name at positions, e.g. q, k and v published as one
  ``qkv``): each block's part on this rank is moved down by the rows before the block (:class:`Joined`).

Chunk ``source`` tensors are views into the framework's own storage (the sharded, full-precision master
copy), so staging at publish time is at most one device copy per chunk (one per run of adjacent chunks, such as a
split tensor's parts), and chunks taken once stay live across steps (see :func:`local_chunks` for when they do not).

Example::

    chunks = local_chunks(model, tie_word_embeddings=True)
    for c in chunks:                      # c.box is in c.space ("flat": (numel,), "shape": c.shape)
        staging[c.name].view(c.source.shape).copy_(c.source)   # the engine casts fp32 masters to c.dtype ("BF16")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch
from torch import nn

from .arc.boxes import Box
from .arc.dtypes import numel
from .dtype_policy import DtypePolicy
from .fsdp_sources import (FLAT, SHAPE, Joined, Segment, _DTensorSource, _dtensor_type, _Fsdp1Source,
                           _fsdp1_type, _fsdp2_type, _is_flat_param, _PlainSource, _Source, split_slots)
from .naming import HELD_MODULE_ATTR, Rename, Split, clean_name, is_tied_output, plan_names

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
    # view of this rank's elements, in box C order when read in its own C order: 1-D, or for a part published
    # with its dims permuted the box's shape, strided; original dtype and device
    source: torch.Tensor

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


def wrapper_paths(model: nn.Module) -> frozenset[str]:
    """The raw paths through which DDP or DataParallel hold the model (``"module"``, ``"_orig_mod.module"``).

    Why by type: ``module`` is also a plausible attribute of a model itself, which must keep its name.
    """
    holders = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return frozenset(f"{prefix}.{HELD_MODULE_ATTR}" if prefix else HELD_MODULE_ATTR
                     for prefix, mod in model.named_modules(remove_duplicate=False) if isinstance(mod, holders))


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
    wrapped = wrapper_paths(model)

    def add(prefix: str, attr: str, src: _Source) -> None:
        slots.append((clean_name(f"{prefix}.{attr}" if prefix else attr, wrapped), src))

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


def _fsdp1_untied_head(slots: Sequence[tuple[str, _Source]]) -> tuple[str, str] | None:
    """(``lm_head``'s path, the embedding's path) where FSDP1 holds an ``lm_head`` in one unit and a tensor of its
    shape in another, or None. Why a guess by shape: FSDP1 flattens each unit's parameters into that unit's own flat
    parameter, so a weight tied across two units (the input embedding wrapped on its own, ``lm_head`` in the
    parent) becomes two tensors, and once wrapped nothing in the model records that they were one; an untied head
    of the embedding's shape in another unit looks the same."""
    heads = [(raw, src) for raw, src in slots if is_tied_output(raw) and isinstance(src, _Fsdp1Source)]
    if not heads:
        return None

    def shape(src: _Source) -> tuple[int, ...] | None:
        try:
            return src.shape()
        except NotImplementedError:  # FSDP1 over tensor parallelism: refused on its own
            return None

    raw, head = heads[0]
    want = shape(head)
    if want is None:
        return None
    for other, src in slots:  # the embedding it was tied to; none there: FSDP did not untie them
        if (not is_tied_output(other) and isinstance(src, _Fsdp1Source) and src.handle is not head.handle
                and shape(src) == want):
            return raw, other
    return None


def _untied_by_fsdp1(exc: ValueError, slots: Sequence[tuple[str, _Source]]) -> ValueError:
    """``exc``, or where it refuses a tied ``lm_head`` that is a tensor of its own under FSDP1 with several FSDP
    units, an error that says why: the model does tie them, and ``tie_word_embeddings=False`` would publish both
    while the carried config.json says tied, so a server that ties them would serve another policy."""
    if not str(exc).startswith("tie_word_embeddings=True but "):
        return exc
    found = _fsdp1_untied_head(slots)
    if found is None:
        return exc
    return ValueError(
        f"tie_word_embeddings=True but {found[0]!r} is a tensor of its own under FSDP1: a weight tied across two "
        "FSDP units is flattened into each unit's own tensor, and the two copies train apart. Wrap the input "
        "embedding and the output projection in one FSDP unit (an auto-wrap policy that does not wrap the "
        "embedding on its own), or use FSDP2 (fully_shard([embed, lm_head])). Only if the model is not meant to "
        "tie them: a config.json in hf_config_dir (or tie_word_embeddings=) that says false.")


def _model_says_untied(model: nn.Module) -> bool:
    """Whether the model object's own config (``model.config``, reached through FSDP1's wrapper) says its output
    projection is not tied, with no ``text_config`` that says otherwise."""
    cfg = getattr(model, "config", None)
    top = getattr(cfg, "tie_word_embeddings", None)
    text = getattr(getattr(cfg, "text_config", None), "tie_word_embeddings", None)
    return top is False and text in (None, False)


def fsdp1_untied_note(model: nn.Module, *, rename: Rename | None = None, tie_word_embeddings: bool | None = None,
                      include_buffers: bool = True, split: Split | None = None) -> str | None:
    """A warning, or None: with ``tie_word_embeddings`` unknown (None: no config.json says, nor the caller), an
    ``lm_head`` published as a tensor of its own that FSDP1 may have untied from the input embedding.

    Why a warning and not the refusal that True gets: None means "the model decides", and the wrapped model holds
    two tensors, which is what the trainer computes with; but after wrapping, a head FSDP1 split from the
    embedding cannot be told from an untied head of the embedding's shape (Llama's) in another unit, and refusing
    would stop such a model. The warning names both readings and the setting that settles it. A model object that
    carries its own config saying it does not tie them (a transformers model's ``config.tie_word_embeddings``,
    which its ``tie_weights()`` reads) settles it too: nothing to say."""
    if tie_word_embeddings is not None or _model_says_untied(model):
        return None
    found = _fsdp1_untied_head(split_slots(_slots(model, include_buffers), split))
    if found is None:
        return None
    raw, embed = found
    names = [name for name, _src, paths in _plan(model, rename, None, include_buffers, split) if raw in paths]
    if not names:  # left out: by the rename, or shared with a name that ties it
        return None
    where = "" if names[0] == raw else f" ({raw!r} in the model)"
    return (f"{names[0]!r}{where} is published as a tensor of its own beside {embed!r}, of its "
            "shape, in another FSDP1 unit, and no config.json in hf_config_dir nor tie_word_embeddings= says "
            "whether the model ties them. If it does, FSDP1 has untied them: it flattens each unit's parameters "
            "into that unit's own tensor, so a weight tied across two units becomes two copies that train apart, "
            "and a server that ties them serves the embedding's copy as the output projection. Then wrap the "
            "input embedding and lm_head in one FSDP unit (or use FSDP2) and set tie_word_embeddings true "
            "(config.json in hf_config_dir, or HotloadCallback(tie_word_embeddings=True)); if the model does not "
            "tie them, set it false to say so")


def _plan(
    model: nn.Module, rename: Rename | None, tie_word_embeddings: bool | None, include_buffers: bool,
    split: Split | None = None,
) -> list[tuple[str, _Source, list[str]]]:
    """(published name, source, cleaned paths of that source with this name's own path first; of a joined tensor,
    its blocks' paths in order); a split's parts are named before ``rename`` sees them."""
    slots = split_slots(_slots(model, include_buffers), split)
    paths_of: dict[int, list[str]] = {}
    for raw, src in slots:
        paths_of.setdefault(id(src), []).append(raw)
    first = {}  # a tensor split under one name and not another is one tensor: its first part stands for it
    for _raw, src in slots:
        if isinstance(src, Segment):
            first.setdefault(id(src.base), id(src))
    try:
        planned = plan_names([(raw, first.get(id(src), id(src))) for raw, src in slots], rename=rename,
                             tie_word_embeddings=tie_word_embeddings)
    except ValueError as exc:
        raise _untied_by_fsdp1(exc, slots) from None
    blocks: dict[str, list[tuple[int, str, _Source]]] = {}  # a joined tensor's blocks, by its name
    for name, i, position in planned:
        if position is not None:
            blocks.setdefault(name, []).append((position, *slots[i]))
    out = []
    for name, i, position in planned:
        raw, src = slots[i]
        if position is None:
            out.append((name, src, [raw, *(p for p in paths_of[id(src)] if p != raw)]))
        elif name in blocks:  # the joined tensor, where its first block was
            members = [(path, part) for _pos, path, part in sorted(blocks.pop(name), key=lambda b: b[0])]
            out.append((name, Joined(name, members), [path for path, _part in members]))
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
    plain: dict[str, torch.Tensor] | None = None,
) -> list[LocalChunk]:
    """The chunks this rank owns, in ``state_dict`` order. No communication, no data copies.

    Ranks that hold nothing of a tensor (empty FSDP shards, non-zero ranks for replicated tensors, replicas
    other than the first under HSDP or FSDP1 NO_SHARD) return no chunk for it; chunks are never empty.

    Sources stay views of the live parameters across training steps as long as the framework keeps its
    storage: FSDP2 from ``fully_shard`` on, FSDP1 from wrapping on (its lazy init keeps the storage, except
    with CPU offload, which pins a new copy: take the chunks after the first forward there). Loading a state
    dict or moving the model replaces storages; take the chunks again after that.

    ``plain``: filled, on every rank, with the plain parameters (neither DTensors nor FSDP's; buffers left out, as
    forward passes update them on each rank alone) that published tensors read, by path: every rank holds them
    whole and only rank 0 makes chunks of them, so this is what ranks compare to tell replicas from partitions
    (:func:`~fsdp_hotload.fsdp_verify.plain_samples`), without another walk.
    """
    policy = DtypePolicy.of(snapshot_dtype, dtype_overrides)
    chunks: list[LocalChunk] = []
    dtensor = _dtensor_type()
    buffers = {id(b) for b in model.buffers()} if plain is not None else set()
    for name, src, paths in _plan(model, rename, tie_word_embeddings, include_buffers, split):
        shape, dtype = src.shape(), policy.code(name, src.dtype())
        for space, box, view in src.pieces(name):
            chunks.append(LocalChunk(name, shape, dtype, space, box, view))
        if plain is None:
            continue
        for path, member in src.members if isinstance(src, Joined) else [(paths[0], src)]:
            cut = None
            if isinstance(member, Segment):  # its range only: a part that rename leaves out is not compared
                cut = (member.start, member.start + numel(member.part_shape))
                path, member = f"{member.base_path}[{cut[0]}:{cut[1]}]", member.base
            if (isinstance(member, _PlainSource) and id(member.tensor) not in buffers
                    and not (dtensor is not None and isinstance(member.tensor, dtensor))):
                plain.setdefault(path, member.tensor if cut is None else member.tensor.reshape(-1)[cut[0]:cut[1]])
    return chunks


def storage_fingerprint(model: nn.Module) -> tuple[int, ...]:
    """Identity and data pointer of every tensor that chunk sources can be views of, in module order (one flat
    tuple: ``(id, pointer, id, pointer, ...)``).

    Why: walking the model for chunks costs milliseconds on the trainer's thread (names, placements, FSDP1
    metadata), while this costs ~0.2 us per tensor. Equal fingerprints mean every parameter and
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
    out: list[int] = []
    add = out.extend
    for mod in model.modules():
        for group in (mod._parameters, mod._buffers):
            for t in group.values():
                if t is None:
                    continue
                cls = type(t)
                if cls is nn.Parameter or cls is torch.Tensor:  # nothing to look through: a third less time
                    add((id(t), t.data_ptr()))
                    continue
                local = getattr(t, "_local_tensor", None)  # FSDP2 DTensor
                if local is None:
                    local = getattr(t, "_local_shard", None)  # FSDP1 flat parameter
                add((id(t), int((t if local is None else local).data_ptr())))
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


def model_parallel_note(model: nn.Module, *, several_ranks: bool = True) -> str | None:
    """Why ``model`` cannot be published as it is, or None: the plain parameters Megatron marks as tensor-parallel
    (``tensor_model_parallel``, set by its parallel layers even at a tensor-parallel size of 1) or expert-parallel
    (``allreduce=False``). Why: their names and fused layouts are Megatron's, not a Hugging Face checkpoint's,
    and over several ranks each rank may hold a partition of them, of which only rank 0's would be published as
    the whole tensors."""
    dtensor = _dtensor_type()
    tp, ep = [], []
    for path, src in _slots(model, include_buffers=False):
        if not isinstance(src, _PlainSource) or (dtensor is not None and isinstance(src.tensor, dtensor)):
            continue
        if getattr(src.tensor, "tensor_model_parallel", False):
            tp.append(path)
        elif getattr(src.tensor, "allreduce", True) is False:
            ep.append(path)
    if not tp and not ep:
        return None
    kinds = [f"{len(names)} {kind}-parallel (e.g. {names[0]!r})" for kind, names in (("tensor", tp), ("expert", ep))
             if names]
    ranks = (", and with tensor or expert parallelism each rank holds a partition of them, which HotloadCallback "
             "would publish as rank 0's whole tensors") if several_ranks else ""
    return (f"the model holds Megatron {' and '.join(kinds)} parameters: their names and fused layouts (linear_qkv "
            f"interleaved per query group, linear_fc1's gate and up joined) are not a Hugging Face checkpoint's"
            f"{ranks}; gather a Hugging Face state dict (TP/PP/EP merged, HF names) and publish it from rank 0 with "
            "TensorPublisher" + ("" if several_ranks else ", or pass rename= and split= that map them"))


def tensor_paths(model: nn.Module, *, include_buffers: bool = True) -> list[str]:
    """Every tensor's cleaned path before any rename, FSDP1's flattened parameters included (its
    ``named_parameters`` lists only the flat parameter when ``use_orig_params=False``)."""
    return [path for path, _src in _slots(model, include_buffers)]
