"""How the staging copies are laid out and batched: where each chunk lives in a slot buffer, which chunks are copied
as one run, and the plan of ``torch._foreach_copy_`` batches that stages them. Torch only; no distributed code.

Example::

    plan, _ = CopyPlan.of([window(buf, 0, torch.bfloat16, (4, 4))], [param])
    with torch.no_grad():
        plan.run()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    import numpy as np

SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # integers that move floats' exact bits
_FOREACH_MAX_NUMEL = (1 << 31) - 1  # larger copies go through copy_ (see CopyPlan)
# dtypes every torch since 2.4 dispatches in its CUDA foreach copy, as destination and as source (see CopyPlan)
_FOREACH_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                             torch.int16, torch.int8, torch.uint8, torch.bool})


def empty_bytes(n: int) -> "np.ndarray[Any, Any]":
    """``n`` uninitialised bytes, allocated without holding the GIL. Why not ``bytearray(n)``: it zero-fills under
    the GIL (~0.5 ms per MB, seconds for a 5 GB file), stalling the trainer's thread; nor ``np.empty``: numpy asks
    for huge pages, which some VMs compact at the first touch, 3-5x slower to fill."""
    return torch.empty(n, dtype=torch.uint8).numpy()


@dataclass(frozen=True)
class Slice:
    """Where one chunk lives inside a flat slot buffer."""

    offset: int  # bytes
    nbytes: int
    numel: int
    itemsize: int
    torch_dtype: torch.dtype


@dataclass(frozen=True)
class CopyGroup:
    """Chunks ``start`` to ``stop`` (exclusive), staged by one copy of ``merged`` when more than one."""

    start: int
    stop: int
    members: tuple[torch.Tensor, ...]  # the chunk sources a run was made of (empty for a single chunk)
    merged: torch.Tensor | None  # one view over all of them (None for a single chunk)


def copy_groups(sources: Sequence[torch.Tensor], slices: Sequence[Slice]) -> list[CopyGroup]:
    """Runs of chunks whose sources follow each other in one storage (same dtype, contiguous) and whose slot slices
    follow each other (same snapshot dtype): each run is staged by one copy.

    Why: a split tensor is thousands of chunks (every part of every expert of a MoE model), each a view next to
    the last. Copied one by one, the per-chunk cost of the copy call (3-5 us on a CPU) made staging 6,144 such
    chunks take 3x a single cast-copy of the same bytes (benchmarks/split_staging.py), on the trainer's thread
    where a GPU copy is launched."""
    groups: list[CopyGroup] = []
    start = 0
    for k in range(1, len(sources) + 1):
        if k < len(sources) and _follows(sources[k - 1], sources[k], slices[k - 1], slices[k]):
            continue
        members: tuple[torch.Tensor, ...] = ()  # a single chunk's is not needed: kept, it is one more GC object
        merged = None
        if k - start > 1:
            members = tuple(sources[start:k])
            first = members[0].detach()
            merged = first.as_strided((sum(int(m.numel()) for m in members),), (1,), first.storage_offset())
        groups.append(CopyGroup(start, k, members, merged))
        start = k
    return groups


def window(buf: torch.Tensor, offset: int, kind: torch.dtype, shape: int | Sequence[int]) -> torch.Tensor:
    """A contiguous tensor of ``kind`` and ``shape`` over ``buf``'s bytes from ``offset`` (a multiple of the element
    size). Why not a view: a view cut from a view is tracked by autograd, ~520 bytes of host memory each against
    ~230 for this, and a plan keeps one per chunk and buffer (tens of thousands on a split MoE model)."""
    dims = [shape] if isinstance(shape, int) else [int(d) for d in shape]
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= max(d, 1)
    return torch.empty(0, dtype=kind, device=buf.device).set_(
        buf.untyped_storage(), (buf.storage_offset() + offset) // kind.itemsize, dims, strides[::-1])


def as_source(view: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The slot ``view`` (1-D) shaped as ``source``. Why: a permuted part's source is a strided N-D view whose C
    order is the published one; copied into the same shape, it is read in that order in the one copy, where
    flattening it first would copy it twice."""
    return view if source.dim() == 1 else view.view(source.shape)


def storage_ptr(t: torch.Tensor) -> int:
    """The address of the memory ``t`` is a view of, as ``t.untyped_storage().data_ptr()``. Why not that: the
    first call makes a Python object for the storage that torch then keeps for the storage's life, one more object
    for every collection of the garbage collector to walk, per parameter (tens of thousands on some models)."""
    return int(t.data_ptr()) - int(t.storage_offset()) * t.element_size()


def _follows(a: torch.Tensor, b: torch.Tensor, sa: Slice, sb: Slice) -> bool:
    return (sb.offset == sa.offset + sa.nbytes and sb.torch_dtype == sa.torch_dtype and a.dtype == b.dtype
            and a.device == b.device and a.dim() == b.dim() == 1 and a.is_contiguous() and b.is_contiguous()
            and a.numel() > 0 and storage_ptr(a) == storage_ptr(b)
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())


@dataclass(frozen=True)
class CopyPlan:
    """Copies (with casts) batched for ``torch._foreach_copy_``, one batch per (destination, source) dtype pair,
    and the copies that go one by one through ``copy_``.

    One call per batch means one GIL release, so a busy publisher thread cannot make the trainer wait to retake
    the GIL between chunks. Copies without a cast move integers of the same width: a floating copy may go through
    float on a device and rewrite NaN payloads, and the snapshot must hold the trainer's exact bytes.

    Why one batch per dtype pair, not one for all: torch's CUDA ``_foreach_copy_`` (2.4 on, until
    pytorch/pytorch#173383 was fixed) takes its fused path whenever the sources share a dtype and casts every
    pair to the first destination's dtype, so fp32 masters published as bf16 with one tensor overridden to fp16 or
    fp8 gave that tensor bf16 bits, or wrote 2 bytes per element over the next chunk. Casts to or from 8-bit
    floats use ``copy_``: a batch of them alone would reach that fused path, which torch's older kernels do not
    dispatch for 8-bit floats (an error where ``copy_`` casts). Why a copy of more than ``_FOREACH_MAX_NUMEL``
    elements (an FSDP1 flat shard's run of views, a fused expert tensor on few ranks) goes through ``copy_``:
    before torch 2.8 (pytorch/pytorch#156261) the CUDA foreach kernels computed each block's offset in 32-bit
    ints, and read and wrote outside the tensors; ``copy_`` splits its work into 32-bit pieces. Why a cast from a
    strided source on the CPU is made in two steps (:func:`strided_cast`): torch casts a tensor whose layout differs
    from its destination's element by element, which writes every NaN as bf16 ``0x7fc0``, where ``.to()`` of the
    parameter keeps its sign (``0xffff``). So the source is cast in its own layout (a permuted part is dense) or
    gathered first (a strided slice), and the result copied; 1.3-1.6x the one strided cast on the 2-core VM.

    Example::

        plan, _ = CopyPlan.of([slot_view], [param])
        plan.run()   # under torch.no_grad()
    """

    batches: list[tuple[list[torch.Tensor], list[torch.Tensor]]]
    singles: list[tuple[torch.Tensor, torch.Tensor]]

    @staticmethod
    def of(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]
           ) -> tuple[CopyPlan, list[tuple[int, int, bool]]]:
        """The plan that copies each ``src`` into its ``dst``, and where each pair went: (batch, position in it,
        viewed as integers), batch -1 for ``singles``."""
        batches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        singles: list[tuple[torch.Tensor, torch.Tensor]] = []
        where: list[tuple[int, int, bool]] = []
        index: dict[tuple[torch.dtype, torch.dtype], int] = {}
        for d, s in zip(dst, src):
            bits = d.dtype == s.dtype and d.is_floating_point()
            if bits:
                kind = SIGNED[d.element_size()]
                d, s = d.view(kind), s.view(kind)
            if (d.numel() > _FOREACH_MAX_NUMEL or d.dtype not in _FOREACH_DTYPES or s.dtype not in _FOREACH_DTYPES
                    or strided_cast(d, s)):
                where.append((-1, len(singles), bits))
                singles.append((d, s))
                continue
            b = index.setdefault((d.dtype, s.dtype), len(batches))
            if b == len(batches):
                batches.append(([], []))
            ds, ss = batches[b]
            where.append((b, len(ds), bits))
            ds.append(d)
            ss.append(s)
        return CopyPlan(batches, singles), where

    def run(self) -> None:
        for d, s in self.singles:
            if strided_cast(d, s):  # cast in the source's own layout where it is dense (a permuted part), else gathered
                s = s.to(d.dtype) if _dense(s) else s.contiguous()
            d.copy_(s)
        foreach = getattr(torch, "_foreach_copy_", None)
        for ds, ss in self.batches:
            if foreach is not None:
                foreach(ds, ss)
            else:  # pragma: no cover - older torch
                for d, s in zip(ds, ss):
                    d.copy_(s, non_blocking=True)


def strided_cast(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether copying ``src`` into ``dst`` is a cast from a strided CPU tensor, which :class:`CopyPlan` makes in two
    steps, one at a time."""
    return src.dtype != dst.dtype and src.device.type == "cpu" and not src.is_contiguous()


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory without gaps or overlaps in some order of its dims (a permuted
    contiguous tensor is; a slice with a step, or an expanded one, is not)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
