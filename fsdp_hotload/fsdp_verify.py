"""Verification helpers for the FSDP adapter: the framework's own full state, and chunk ownership across ranks.

Why a separate module: none of this runs when publishing. ``gather_full_state`` all-gathers every parameter (the
independent reference that tests compare published bytes against, bit for bit), and the ownership checks prove
that the chunks of all ranks tile every tensor exactly once.

Example::

    specs = verify_ownership(model)            # collective; raises OwnershipError on every rank if not exact
    full = gather_full_state(model)            # collective; {published name: CPU tensor in the snapshot dtype}
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .arc.boxes import Box, check_tiling
from .arc.dtypes import torch_name
from .arc.errors import FormatError
from .dtype_policy import DtypePolicy
from .fsdp import (FLAT, SHAPE, OwnershipError, Rename, TensorSpec, _ChunkLike, _dtensor_type, _fsdp1_type,
                   _fsdp2_type, _plan, full_tensor_specs, local_chunks, space_shape)
from .naming import clean_name


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
    by_path: dict[str, Any] = {clean_name(k): v for k, v in state.items()}
    out: dict[str, torch.Tensor] = {}
    for name, src, paths in _plan(model, rename, tie_word_embeddings, include_buffers):
        found = next((by_path[p] for p in paths if p in by_path), None)
        if found is None:
            raise KeyError(f"tensor {name!r} (path {paths[0]!r}) is missing from the framework's state dict")
        t = found.detach().to("cpu")
        if t.is_floating_point():
            t = t.to(getattr(torch, torch_name(policy.code(name, src.dtype()))))
        out[name] = t.contiguous()
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
) -> list[TensorSpec]:
    """Collective debug check: every rank computes its chunks, and all ranks check the union.

    Sends only chunk metadata (no tensor data). Raises OwnershipError on every rank if the specs differ between
    ranks or the chunks do not tile each tensor exactly once. Returns the specs.
    """
    import torch.distributed as dist

    kw: dict[str, Any] = dict(snapshot_dtype=snapshot_dtype, dtype_overrides=dtype_overrides, rename=rename,
                              tie_word_embeddings=tie_word_embeddings, include_buffers=include_buffers)
    specs = full_tensor_specs(model, **kw)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, ([c.meta() for c in local_chunks(model, **kw)], specs), group=group)
    for r, (_metas, other) in enumerate(gathered):
        if other != gathered[0][1]:
            diff = sorted(set(map(repr, other)) ^ set(map(repr, gathered[0][1])))[:3]
            raise OwnershipError(f"ranks 0 and {r} see different tensor specs (e.g. {', '.join(diff)})")
    check_ownership([metas for metas, _specs in gathered], specs)
    return specs
