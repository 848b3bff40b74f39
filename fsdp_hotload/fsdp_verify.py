"""Verification helpers for the FSDP adapter: the framework's own full state, and chunk ownership across ranks.

Why a separate module: none of this runs per publish. ``gather_full_state`` all-gathers every parameter (the
independent reference that tests compare published bytes against, bit for bit), and the ownership checks prove
that the chunks of all ranks tile every tensor exactly once (the callback runs them once, when it is created:
:func:`agree_on_chunks`).

Example::

    specs = verify_ownership(model)            # collective; raises OwnershipError on every rank if not exact
    full = gather_full_state(model)            # collective; {published name: CPU tensor in the snapshot dtype}
"""
from __future__ import annotations

import logging
import zlib
from typing import Any, Collection, Iterator, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from .arc.boxes import Box, check_tiling
from .arc.dtypes import numel, torch_name
from .arc.errors import FormatError
from .dtype_policy import DtypePolicy
from .fsdp import (FLAT, SHAPE, Joined, LocalChunk, OwnershipError, Rename, Segment, TensorSpec, _ChunkLike,
                   _dtensor_type, _fsdp1_type, _fsdp2_type, _plan, full_tensor_specs, local_chunks, space_shape,
                   wrapper_paths)
from .naming import Split, clean_name

log = logging.getLogger("fsdp_hotload")


def _is_distributed(model: nn.Module) -> bool:
    fsdp1, fsdp2, dtensor = _fsdp1_type(), _fsdp2_type(), _dtensor_type()
    for mod in model.modules():
        if (fsdp1 is not None and isinstance(mod, fsdp1)) or (fsdp2 is not None and isinstance(mod, fsdp2)):
            return True
    return dtensor is not None and any(isinstance(p, dtensor) for p in model.parameters())


def gather_full_state(
    model: nn.Module,
    *,
    snapshot_dtype: str = "BF16",
    dtype_overrides: Mapping[str, str] | None = None,
    rename: Rename | None = None,
    tie_word_embeddings: bool | None = None,
    include_buffers: bool = True,
    split: Split | None = None,
) -> dict[str, torch.Tensor]:
    """Full tensors (CPU, published dtype) on every rank, through the framework's own full-state-dict path.

    For tests and debugging only: this all-gathers every parameter, which the publisher never does. It is the
    independent reference that published chunks are compared against bit for bit. Collective: every rank of
    the model's process groups must call it.
    """
    policy = DtypePolicy.of(snapshot_dtype, dtype_overrides)
    if _is_distributed(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # cpu_offload=False: with it, only rank 0 would receive the tensors.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    else:
        state = model.state_dict()
    wrapped = wrapper_paths(model)
    by_path: dict[str, Any] = {clean_name(k, wrapped): v for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    for name, src, paths in _plan(model, rename, tie_word_embeddings, include_buffers, split):
        if isinstance(src, Joined):
            t = torch.cat([_full(name, part, [path], by_path) for path, part in src.members])
        else:
            t = _full(name, src, paths, by_path)
        if t.is_floating_point():
            t = t.to(getattr(torch, torch_name(policy.code(name, src.dtype()))))
        out[name] = t.contiguous()
    return out


def _full(name: str, src: Any, paths: list[str], by_path: dict[str, Any]) -> torch.Tensor:
    """The full tensor of one source (a split's part: cut from its whole tensor) from the state dict, on the host."""
    if isinstance(src, Segment):  # a split's part: its range of the whole tensor
        paths = [src.base_path]
    found = next((by_path[p] for p in paths if p in by_path), None)
    if found is None:
        raise KeyError(f"tensor {name!r} (path {paths[0]!r}) is missing from the framework's state dict")
    t = found.detach()
    if isinstance(src, Segment):  # cut where the state is: the host gets each part, not the whole per part
        t = t.reshape(-1)[src.start:src.start + numel(src.part_shape)].reshape(src.part_shape)
        t = t if src.perm is None else t.permute(src.perm)
        t = t if src.as_shape is None else t.reshape(src.as_shape)
    return t.to("cpu")


#: Places per tensor that :func:`replica_samples` reads, spread along its first dim, and elements read at each.
SAMPLE_PLACES, SAMPLE_RUN = 8, 8


def _sample(t: torch.Tensor) -> torch.Tensor:
    """A few of ``t``'s elements (at most ``SAMPLE_PLACES * SAMPLE_RUN``) as fresh bytes on its device, in one
    copy: a run of elements at each of up to eight places spread evenly along its first dim (rows, experts), each
    run along its last dim (a 1-D tensor: along itself) with the dims between at 0.

    Why spread: partitions often agree at their start (padding rows of a vocabulary, experts seeded alike) and
    differ further on. The places follow from the shape alone, so one box's views read the same elements on
    every rank, whatever their memory layout (a part published with its dims permuted)."""
    t = t.detach().reshape(1) if t.dim() == 0 else t.detach()
    rows = int(t.shape[0])
    if t.dim() == 1:  # runs end inside the tensor
        reach, run, along = max(rows - SAMPLE_RUN, 0), min(SAMPLE_RUN, rows), t.stride(0)
    else:
        reach, run, along = rows - 1, min(SAMPLE_RUN, int(t.shape[-1])), t.stride(-1)
    step = max(reach // (SAMPLE_PLACES - 1), 1)
    places = min(SAMPLE_PLACES, reach // step + 1)
    view = t.as_strided((places, run), (step * t.stride(0), along), t.storage_offset())
    return torch.empty(view.shape, dtype=t.dtype, device=t.device).copy_(view).view(torch.uint8).reshape(-1)


#: Integer dtypes of each element size: a tensor's bits, summed exactly (wrapping) in any order.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SUM_BLOCK = 1 << 22  # elements per partial sum of a tensor's bits (32 MiB of int64 at a time)


def _bit_sum(bits: torch.Tensor, block: int = SUM_BLOCK) -> torch.Tensor:
    """The sum of an integer tensor's elements as int64 (wrapping: the same on every device), shape (1,), in
    blocks of about ``block`` elements. Why blocks: a sum with ``dtype=torch.int64`` first casts its whole input,
    8 bytes per element: summing a 256 MiB bf16 tensor so raised a CPU process's peak memory by 513 MiB, against
    none in blocks (and on a GPU it is device memory, taken on the trainer's thread after ``optimizer.step()``)."""
    flat = bits.reshape(-1) if bits.is_contiguous() else bits  # a 0-d tensor is contiguous
    if flat.numel() <= block:
        return flat.sum(dtype=torch.int64).reshape(1)
    rows = max(1, block // max(1, flat[0].numel()))  # along the first dim: a view, whatever the layout
    return torch.stack([part.sum(dtype=torch.int64) for part in flat.split(rows)]).sum().reshape(1)


#: Elements up to which a ``whole`` digest (:func:`_crcs`) reads every byte of a tensor rather than its sample and
#: bit sum (128 KiB of bf16: a norm, a bias), and the bytes of each host copy of samples and such whole tensors.
WHOLE_ELEMENTS, JOIN_BYTES = 1 << 16, 1 << 26


def _crcs(tensors: Sequence[tuple[Any, torch.Tensor]], whole: bool = False) -> dict[Any, int]:
    """A CRC-32 of :func:`_sample` of each tensor, by its key, in host copies of at most ``JOIN_BYTES`` per device;
    ``whole`` folds in the sum of every element's bits (read where the tensor lives, exact, so equal on every
    device), which catches a change outside the sample: an embedding whose sampled rows no token reached. With
    ``whole``, a tensor of at most ``WHOLE_ELEMENTS`` elements goes into a host copy whole instead (in its logical
    order, whatever its layout), and its CRC-32 covers every byte. Why: the sample and the sum took 25-30 us per
    tensor on a CPU, a pause of 1.1 s on the trainer's thread for a model of 40,000 small plain parameters."""
    heads: dict[torch.device, list[_Digest]] = {}
    for key, t in tensors:
        bits = _BITS.get(t.element_size()) if whole else None
        if bits is not None and t.numel() <= WHOLE_ELEMENTS:  # flattened only once its host copy is made
            heads.setdefault(t.device, []).append(_Digest(key, t, None, t.numel() * t.element_size(), True))
            continue
        total = None if bits is None else _bit_sum(t.detach().view(bits))
        sample = _sample(t)
        heads.setdefault(t.device, []).append(_Digest(key, sample, total, sample.numel(), False))
    out: dict[Any, int] = {}
    for items in heads.values():
        for batch in _batches(items, JOIN_BYTES):
            joined = torch.cat([_flat_bytes(d.bytes) if d.flatten else d.bytes for d in batch]).cpu().numpy()
            sums = [d.total for d in batch if d.total is not None]
            totals = iter(torch.cat(sums).cpu().numpy() if sums else ())
            at = 0
            for d in batch:
                out[d.key] = zlib.crc32(joined[at:at + d.nbytes])
                if d.total is not None:
                    out[d.key] = zlib.crc32(next(totals).tobytes(), out[d.key])
                at += d.nbytes
    return out


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in its logical order, flat. Why the copy: ``reshape(-1)`` keeps a view wherever it can, and
    a view whose stride is not 1 (a column ``w[:, 0]``, or one element of stride 3, which counts as contiguous)
    cannot be viewed as bytes."""
    flat = t.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        flat = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device).copy_(flat)
    return flat.view(torch.uint8)


class _Digest(NamedTuple):
    """What :func:`_crcs` reads of one tensor: its sample (uint8), or the tensor itself to flatten whole."""

    key: Any
    bytes: torch.Tensor
    total: torch.Tensor | None  # the sum of its bits, shape (1,), or None
    nbytes: int  # bytes it takes in the host copy
    flatten: bool  # whether ``bytes`` is the tensor itself


def _batches(items: Sequence[_Digest], limit: int) -> Iterator[Sequence[_Digest]]:
    """``items`` in runs of at most ``limit`` bytes in all, or of one item."""
    start, size = 0, 0
    for i, item in enumerate(items):
        if i > start and size + item.nbytes > limit:
            yield items[start:i]
            start, size = i, 0
        size += item.nbytes
    if start < len(items):
        yield items[start:]


def replica_samples(chunks: Sequence[LocalChunk], skip: Collection[int] = ()) -> list[int | None]:
    """A CRC-32 of a few elements of each chunk (:func:`_sample`, in its own dtype), None for the chunks in
    ``skip`` and empty ones.

    Why: ranks holding the same box of a tensor are taken for copies of one replica, and only the lowest publishes
    it. That holds for what the framework replicates, not for partitions it cannot see: each rank's own experts
    under one name (DTensors over a one-rank sub-mesh). Their boxes agree and their values do not, so rank 0's
    would be published as everyone's. A few elements per chunk (at most 512 bytes, in one host copy per device)
    tell them apart at construction, where copies must agree. Plain tensors (not DTensors), which only rank 0
    makes chunks of, are compared by :func:`plain_samples`. ``skip``: module buffers, which forward passes update
    on each rank alone (BatchNorm statistics under FSDP)."""
    crcs = _crcs([(i, c.source) for i, c in enumerate(chunks)
                  if i not in skip and c.source.numel() > 0 and not c.source.is_meta])  # meta: agree_on_chunks
    return [crcs.get(i) for i in range(len(chunks))]


def plain_samples(plain: Mapping[str, torch.Tensor], whole: bool = False) -> dict[str, int]:
    """A CRC-32 of a few elements (:func:`_sample`) of each plain tensor in ``plain`` (``local_chunks(plain=)``:
    parameters that are neither DTensors nor FSDP's, by path, buffers left out), empty and meta ones left out.

    Why: every rank holds such a tensor whole and only rank 0 publishes it, taking the others for copies. A
    partition kept in a plain parameter (a hand-written tensor-parallel layer, each rank's own experts) would be
    published as rank 0's whole tensor, and a parameter that no wrapper syncs (a module left out of
    ``fully_shard``) drifts from rank to rank. Ranks comparing them at construction refuse the first, and the
    second where the ranks start apart."""
    return _crcs([(path, t) for path, t in plain.items() if t.numel() > 0 and not t.is_meta], whole)


class Agreed(NamedTuple):
    """What :func:`agree_on_chunks` decided for this rank."""

    kept: list[int]  # indexes of the chunks this rank publishes
    shared: list[tuple[int, int]]  # (index, group) of its sampled chunks whose box another rank holds too
    recheck: bool  # whether any rank holds such a chunk or a plain tensor (the same answer on every rank)
    groups: list[tuple[str, Box]]  # rank 0 only: each group's tensor and box, for the messages of RecheckReplicas
    ngroups: int  # how many groups there are (the same on every rank)


def agree_on_chunks(chunks: Sequence[LocalChunk], specs: Sequence[TensorSpec], ctrl: Any,
                    failed: BaseException | None = None, samples: Sequence[int | None] | None = None,
                    plain: Mapping[str, int] | None = None) -> Agreed:
    """Collective over ``ctrl`` (a :class:`~fsdp_hotload.engine.comm.Comm`), at construction: which of this
    rank's chunks it publishes (:func:`assign_chunks`), decided on rank 0 from every rank's chunk metadata.
    ``failed``: this rank's set-up failed before (reading ``hf_config_dir``, walking the model); it raises that,
    and the other ranks an OwnershipError naming it.

    Why here and not at the first publish: a rank whose tensors are still on the ``meta`` device, on two devices,
    or that sees other tensors than rank 0 would otherwise fail alone inside the publisher's set-up while the
    other ranks wait in its next collective. Every rank raises the same error instead, naming the rank.
    ``samples``: :func:`replica_samples` of ``chunks``; ranks holding one box with different samples are refused.
    ``plain``: :func:`plain_samples` of the model; ranks whose plain tensors differ are refused alike. Where
    either is given, it also says which chunks to compare again once training has started
    (:class:`~fsdp_hotload.fsdp_recheck.RecheckReplicas`): those whose box another rank holds too.
    """
    devices = sorted({str(c.source.device) for c in chunks})
    problem = None
    if failed is not None:
        problem = f"its set-up failed: {type(failed).__name__}: {failed}"
    elif "meta" in devices:
        problem = ("its tensors are on the meta device: create the HotloadCallback after the weights are "
                   "materialised (to_empty() and init, or loading a checkpoint)")
    elif len(devices) > 1:
        problem = (f"its chunks live on several devices {devices} (FSDP2's CPUOffloadPolicy keeps buffers on "
                   "the GPU): pass include_buffers=False, or keep the buffers on the parameters' device")
    gathered = ctrl.gather(([c.meta() for c in chunks], list(specs), problem, samples, plain))
    verdict: Any = None
    groups: list[tuple[str, Box]] = []
    if gathered is not None:
        try:
            for r, (_metas, _specs, trouble, _s, _p) in enumerate(gathered):
                if trouble:
                    raise OwnershipError(f"rank {r}: {trouble}")
            _check_same_specs([other for _m, other, _t, _s, _p in gathered])
            if plain is not None:
                _check_same_plain([p for _m, _s, _t, _x, p in gathered])
            kept = assign_chunks([metas for metas, _s, _t, _x, _p in gathered], specs,
                                 [x for _m, _s, _t, x, _p in gathered] if samples is not None else None)
            changes = {r: k for r, k in enumerate(kept) if len(k) != len(gathered[r][0])}  # only what changes
            shared = _shared_boxes([(metas, x) for metas, _s, _t, x, _p in gathered], groups)
            verdict = (changes, shared, bool(shared) or any(p for *_r, p in gathered), len(groups))
        except OwnershipError as exc:
            verdict = str(exc)
    verdict = ctrl.broadcast(verdict)
    if failed is not None:
        raise failed
    if isinstance(verdict, str):
        raise OwnershipError(verdict)
    changes, shared, recheck, ngroups = verdict
    return Agreed(changes.get(ctrl.rank, list(range(len(chunks)))), shared.get(ctrl.rank, []), recheck, groups,
                  ngroups)


def _shared_boxes(by_rank: Sequence[tuple[Sequence[Any], Sequence[int | None] | None]],
                  groups: list[tuple[str, Box]]) -> dict[int, list[tuple[int, int]]]:
    """``{rank: [(index, group), ...]}`` for the sampled chunks whose box several ranks hold (copies of one box
    make a group, numbered in ``groups``); ranks without any are left out."""
    holders: dict[tuple[str, str, Box], int] = {}
    for metas, samples in by_rank:
        for m, x in zip(metas, samples or ()):
            if x is not None:
                key = (m.name, m.space, m.box)
                holders[key] = holders.get(key, 0) + 1
    number: dict[tuple[str, str, Box], int] = {}
    out: dict[int, list[tuple[int, int]]] = {}
    for r, (metas, samples) in enumerate(by_rank):
        for i, (m, x) in enumerate(zip(metas, samples or ())):
            key = (m.name, m.space, m.box)
            if x is not None and holders[key] > 1:
                if key not in number:
                    number[key] = len(groups)
                    groups.append((m.name, m.box))
                out.setdefault(r, []).append((i, number[key]))
    return out


def _check_same_specs(specs_by_rank: Sequence[Sequence[TensorSpec]]) -> None:
    for r, other in enumerate(specs_by_rank):
        if list(other) != list(specs_by_rank[0]):
            diff = sorted(set(map(repr, other)) ^ set(map(repr, specs_by_rank[0])))[:3]
            hint = ""
            if [(n, d) for n, _s, d in other] == [(n, d) for n, _s, d in specs_by_rank[0]]:  # shapes alone differ
                hint = ("; only shapes differ: does every rank read the same base checkpoint in hf_config_dir "
                        "(hf_names publishes a tensor transposed where its headers store it so)?")
            raise OwnershipError(f"ranks 0 and {r} see different tensor specs (e.g. {', '.join(diff)}){hint}")


def _plain_difference(plain_by_rank: Sequence[Mapping[str, int] | None]) -> tuple[int, str] | None:
    """The first rank whose plain samples differ from rank 0's, with the first path and how many more differ."""
    for r, other in enumerate(plain_by_rank):
        differ = sorted(p for p, crc in (other or {}).items() if (plain_by_rank[0] or {}).get(p, crc) != crc)
        if differ:
            return r, repr(differ[0]) + (f" and {len(differ) - 1} more" if len(differ) > 1 else "")
    return None


def _check_same_plain(plain_by_rank: Sequence[Mapping[str, int] | None]) -> None:
    if (found := _plain_difference(plain_by_rank)) is not None:
        r, which = found
        raise OwnershipError(
            f"ranks 0 and {r} hold different values of plain tensor {which} (a parameter that is "
            "not sharded: neither a DTensor nor FSDP's), which every rank holds whole and rank 0 alone publishes. "
            "A partition (a hand-written tensor-parallel layer, each rank's own experts) would be published as "
            "rank 0's whole tensor: express it as DTensors (FSDP2 over a device mesh), or publish a gathered "
            "state dict from rank 0 with TensorPublisher. A replica must start equal: seed every rank alike or "
            "load the same checkpoint, and create the callback after a wrapper that broadcasts rank 0's "
            "weights (DistributedDataParallel); a module left out of fully_shard is not synced by FSDP at all")


def assign_chunks(chunks_from_all_ranks: Sequence[Sequence[_ChunkLike]], specs: Sequence[TensorSpec],
                  samples_from_all_ranks: Sequence[Sequence[int | None] | None] | None = None) -> list[list[int]]:
    """Which of its chunks each rank publishes: ``out[r]`` indexes ``chunks_from_all_ranks[r]``.

    Why: a tensor sharded over part of the ranks is held whole by each group of them. FSDP2 over tensor
    parallelism shards a norm weight over the data-parallel mesh dim only, so every tensor-parallel rank holds
    the same box of it; one copy must be published, or each file would get the box twice. Identical boxes of one
    tensor are therefore published by the lowest rank that holds them, and the rest must tile every tensor
    exactly once (:func:`check_ownership`, whose OwnershipError this raises). With ``samples_from_all_ranks``
    (:func:`replica_samples` per rank), copies whose samples differ are refused: they are partitions.
    """
    seen: dict[tuple[str, str, Box], tuple[int, int | None]] = {}
    out: list[list[int]] = []
    kept: list[list[_ChunkLike]] = []
    for rank, chunks in enumerate(chunks_from_all_ranks):
        samples = samples_from_all_ranks[rank] if samples_from_all_ranks is not None else None
        mine: list[int] = []
        for i, c in enumerate(chunks):
            key = (c.name, c.space, c.box)
            sample = samples[i] if samples is not None else None
            if key not in seen:
                seen[key] = (rank, sample)
                mine.append(i)
            elif sample is not None and seen[key][1] is not None and sample != seen[key][1]:
                raise OwnershipError(
                    f"ranks {seen[key][0]} and {rank} hold the same part of tensor {c.name!r} ({c.box.to_json()}) "
                    "with different values, so they are partitions, not copies of one replica (each rank's own "
                    "experts under one name), and only rank "
                    f"{seen[key][0]}'s would be published: express that parallelism as DTensors (FSDP2 over a "
                    "device mesh), or publish a gathered state dict from rank 0 with TensorPublisher. Replicas "
                    "must also start equal: seed every rank alike, or load the same checkpoint, before creating "
                    "the callback")
        out.append(mine)
        kept.append([chunks[i] for i in mine])
    check_ownership(kept, specs)
    return out


def check_ownership(chunks_from_all_ranks: Sequence[Sequence[_ChunkLike]], specs: Sequence[TensorSpec]) -> None:
    """Raise OwnershipError unless the chunks of all ranks cover every element of every tensor exactly once.

    ``chunks_from_all_ranks[r]`` holds rank r's :class:`LocalChunk` or :class:`ChunkMeta` objects; ``specs``
    is :func:`full_tensor_specs`. Chunks must also agree with the specs on shape and dtype, and all chunks of
    one tensor must use the same space.
    """
    spec_of: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape, dtype in specs:
        if name in spec_of:
            raise OwnershipError(f"tensor {name!r} appears twice in the tensor specs")
        spec_of[name] = (tuple(int(s) for s in shape), dtype)
    boxes: dict[str, list[tuple[int, Box]]] = {name: [] for name in spec_of}
    spaces: dict[str, str] = {}
    for rank, chunks in enumerate(chunks_from_all_ranks):
        for c in chunks:
            if c.name not in spec_of:
                raise OwnershipError(f"rank {rank} holds a chunk of {c.name!r}, which is not in the tensor specs")
            shape, dtype = spec_of[c.name]
            if tuple(c.shape) != shape or c.dtype != dtype:
                raise OwnershipError(
                    f"rank {rank}: chunk of {c.name!r} says {c.dtype} {list(c.shape)}, specs say {dtype} {list(shape)}"
                )
            if c.space not in (FLAT, SHAPE):
                raise OwnershipError(f"rank {rank}: chunk of {c.name!r} has unknown space {c.space!r}")
            if spaces.setdefault(c.name, c.space) != c.space:
                raise OwnershipError(f"tensor {c.name!r} has chunks in both {FLAT!r} and {SHAPE!r} space")
            boxes[c.name].append((rank, c.box))
    for name, (shape, _dtype) in spec_of.items():
        space = spaces.get(name, FLAT)
        try:
            check_tiling([b for _, b in boxes[name]], space_shape(space, shape))
        except FormatError as exc:
            held = "; ".join(f"rank {r}: {b.to_json()}" for r, b in boxes[name]) or "no rank holds any of it"
            raise OwnershipError(f"tensor {name!r} {list(shape)} ({space} space): {exc.reason} ({held})") from None


def verify_ownership(
    model: nn.Module,
    *,
    group: Any = None,
    snapshot_dtype: str = "BF16",
    dtype_overrides: Mapping[str, str] | None = None,
    rename: Rename | None = None,
    tie_word_embeddings: bool | None = None,
    include_buffers: bool = True,
    split: Split | None = None,
) -> list[TensorSpec]:
    """Collective debug check: every rank computes its chunks, and all ranks check the union (one copy of each
    box held by several ranks: :func:`assign_chunks`).

    Sends only chunk metadata (no tensor data). Raises OwnershipError on every rank if the specs differ between
    ranks or the chunks do not tile each tensor exactly once. Returns the specs.
    """
    import torch.distributed as dist

    kw: dict[str, Any] = dict(snapshot_dtype=snapshot_dtype, dtype_overrides=dtype_overrides, rename=rename,
                              tie_word_embeddings=tie_word_embeddings, include_buffers=include_buffers, split=split)
    specs = full_tensor_specs(model, **kw)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, ([c.meta() for c in local_chunks(model, **kw)], specs), group=group)
    _check_same_specs([other for _metas, other in gathered])
    assign_chunks([metas for metas, _specs in gathered], specs)
    return specs
