"""Staging: the only work the trainer's main thread does, plus the diff against the cache.

Each rank's chunks are packed into one flat byte buffer per slot (offsets aligned to 8 bytes), in the snapshot
dtype, on the chunks' own device. ``stage`` copies (and casts) every chunk's source into a free slot; on CUDA it
does so on a side stream and makes the training stream wait for that copy on the device, so the host returns at
once and the next optimizer step cannot overwrite a parameter before it has been copied. The publisher's own device
work (the diff, reading a full snapshot, filling a host cache) runs on a second stream of its own, so it never
queues behind, or holds up, the training stream; the diff walks each chunk (adjacent chunks of one element size as
one range) in blocks of ``DIFF_BLOCK`` elements, so its device temporaries stay below ~52 MB (bf16) however many
values changed. On the CPU it can hand the copy to a helper thread (``background=True``); the caller then fences
before the next update. The cache is one more buffer with the same layout holding the bytes of the last accepted
snapshot; after an accepted publish the slot and the cache swap roles (no copy).

Example::

    st = Stager(chunks, slots=1)
    slot = st.acquire(wait=True); st.stage(slot)   # main thread
    diffs = st.diff(slot)                      # background: ElementDiff per chunk (only changes reach the host)
    st.promote(slot)                           # background, after every deployment accepted the snapshot
"""
from __future__ import annotations

import contextlib
import operator
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ContextManager, Protocol, Sequence

import numpy as np
import torch

from ..arc.codecs import ElementDiff, element_diff
from ..arc.dtypes import UINT_BY_SIZE, itemsize, torch_name

_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DIFF_BLOCK = 1 << 22  # elements per device-diff step (the device temporaries are ~13 bytes per element)
_NO_STATIC_NONZERO: set[str] = set()  # device types whose torch has no nonzero_static kernel (see _positions)
_FOREACH_MAX_NUMEL = (1 << 31) - 1  # larger copies go through copy_ (see _copy_all)
# dtypes every torch since 2.4 dispatches in its CUDA foreach copy, as destination and as source (see _copy_all)
_FOREACH_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                             torch.int16, torch.int8, torch.uint8, torch.bool})


class ChunkLike(Protocol):
    """What the engine needs of a chunk (read-only: adapters hand in frozen dataclasses)."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def space(self) -> str: ...
    @property
    def box(self) -> Any: ...
    @property
    def source(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Slice:
    """Where one chunk lives inside a flat slot buffer."""

    offset: int  # bytes
    nbytes: int
    numel: int
    itemsize: int
    torch_dtype: torch.dtype


class Stager:
    """Slot buffers, the cache buffer, and the copy/diff operations between them."""

    def __init__(self, chunks: Sequence[ChunkLike], *, slots: int = 1, cache_on: str = "device") -> None:
        self.chunks = list(chunks)
        devices = {c.source.device for c in self.chunks}
        if len(devices) > 1:
            raise ValueError(f"local chunks live on several devices {sorted(map(str, devices))}; one expected")
        self.device = devices.pop() if devices else torch.device("cpu")
        if self.device.type == "meta":  # FSDP2's deferred init: these tensors have no bytes to stage
            raise ValueError("the local shards are on the meta device: create the publisher after the weights are "
                             "materialised (model.to_empty(device=...) and their initialisation or checkpoint load)")
        if self.device.type not in ("cpu", "cuda"):  # the diff reads host memory or CUDA streams, nothing else
            raise ValueError(f"local shards on {self.device.type!r} tensors cannot be staged: cpu and cuda only")
        self.slices: list[Slice] = []
        pos = 0
        for c in self.chunks:
            size = itemsize(c.dtype)
            n = c.box.numel
            if int(c.source.numel()) != n:
                raise ValueError(f"chunk {c.name!r}: source has {c.source.numel()} elements, box has {n}")
            pos += -pos % 8
            self.slices.append(Slice(pos, n * size, n, size, getattr(torch, torch_name(c.dtype))))
            pos += n * size
        self.nbytes = pos
        self._free: list[torch.Tensor] = [self._alloc(self.device) for _ in range(slots)]
        self._cond = threading.Condition()
        self._closed = False
        self.cache: torch.Tensor | None = None  # bytes of the last accepted snapshot
        self.cache_on = cache_on
        self.cuda = self.device.type == "cuda"
        # The cache's memory is taken now, not at the first accepted publish: memory that runs out then would fail
        # on the publisher's thread a step into training, on one rank; here it fails before training starts.
        self._spare: torch.Tensor | None = self._alloc(
            torch.device("cpu") if cache_on == "host" and self.device.type != "cpu" else self.device)
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None  # the trainer's staging copies
        self._work = torch.cuda.Stream(self.device) if self.cuda else None  # the publisher's device work
        self._copier: ThreadPoolExecutor | None = None  # host copies off the trainer's thread (``background``)
        self._views: dict[int, list[np.ndarray]] = {}  # host_views by buffer address
        self._own = [c.source for c in self.chunks]  # checked above
        self._groups = copy_groups(self._own, self.slices)
        self._dst: dict[int, list[torch.Tensor]] = {}  # each group's slot view, by buffer address

    def _alloc(self, device: torch.device) -> torch.Tensor:
        """One buffer of the slot layout on ``device``. Host memory is pinned only for a CUDA shard (its host
        cache): nothing else crosses to a device, and pinned memory is page-locked and rounded up to a power of
        two, which a CPU shard on a GPU machine (parameters offloaded to the CPU) cannot spare."""
        pin = device.type == "cpu" and self.device.type == "cuda"
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device, pin_memory=pin)

    # ------------------------------------------------------------------ main thread
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, wait: bool) -> torch.Tensor | None:
        with self._cond:
            while not self._free or self._closed:
                if self._closed:
                    raise RuntimeError("publisher is closed: its staging slots are refused")
                if not wait:
                    return None
                self._cond.wait()
            return self._free.pop()

    def view(self, buf: torch.Tensor, s: Slice) -> torch.Tensor:
        return buf[s.offset:s.offset + s.nbytes].view(s.torch_dtype)

    def stage(self, buf: torch.Tensor, sources: Sequence[torch.Tensor] | None = None, *,
              background: bool = False) -> Any:
        """Copy every chunk's source into ``buf`` (casting to the snapshot dtype). Returns a completion event.

        On CUDA the copy runs on a side stream. On the CPU it runs here, or with ``background`` on a helper
        thread, returning a Future: the caller must then keep the sources unchanged until it is done (the
        callback waits for it before the next optimizer step).
        """
        srcs = self._own if sources is None else self._checked(sources)
        if self.cuda:
            assert self._stream is not None
            main = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(main)
            with torch.no_grad(), torch.cuda.stream(self._stream):
                _copy_all(*self._pairs(buf, srcs))
                event = torch.cuda.Event()
                event.record(self._stream)
            main.wait_event(event)  # the next optimizer step waits for the copy on the device, not on the host
            return event
        if background:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotload-stage")
            return self._copier.submit(self._copy_host, buf, srcs)
        self._copy_host(buf, srcs)
        return None

    def _checked(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Caller-given sources, one per chunk with the chunk's element count, on the shard's device. Why: a copy
        broadcasts, so a source of one element would fill its whole chunk and be published without any error; and
        a source on another device is copied without waiting for that device's work (on GPUs). The chunks' own
        sources, which the callback passes while the model's storage is unchanged, were checked at construction:
        one identity pass skips them (a split MoE model has tens of thousands, ~0.4 us each to count)."""
        srcs = list(sources)
        if len(srcs) != len(self.chunks):
            raise ValueError(f"{len(srcs)} source tensors for {len(self.chunks)} chunks (one per chunk, in order)")
        if all(map(operator.is_, srcs, self._own)):
            return self._own  # which _pairs knows without looking again
        for c, s, src in zip(self.chunks, self.slices, srcs):
            if src is c.source:
                continue
            if int(src.numel()) != s.numel:
                raise ValueError(f"chunk {c.name!r}: source has {src.numel()} elements, the chunk {s.numel}")
            if src.device != self.device:  # the side stream waits only for this device's stream
                raise ValueError(f"chunk {c.name!r}: source is on {src.device}, the shard on {self.device}")
        return srcs

    def _copy_host(self, buf: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():  # thread-local: set here, on whichever thread copies
            _copy_all(*self._pairs(buf, srcs))

    def _pairs(self, buf: torch.Tensor, srcs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The copies that stage ``srcs`` into ``buf``: one per group of chunks whose sources are still the
        adjacent views the group was made of (:func:`copy_groups`), one per chunk otherwise (sources given anew,
        a buffer cloned for a background copy)."""
        views = self._dst.get(buf.data_ptr())
        if views is None:
            views = self._dst[buf.data_ptr()] = [
                buf[self.slices[g.start].offset:self.slices[g.stop - 1].offset + self.slices[g.stop - 1].nbytes]
                .view(self.slices[g.start].torch_dtype) for g in self._groups]
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        own = srcs is self._own
        for g, view in zip(self._groups, views):
            if g.stop - g.start == 1:  # no detach(): called under no_grad (one per chunk and publish adds up)
                dst.append(_as_source(view, srcs[g.start]))
                src.append(srcs[g.start])
            elif own or all(map(operator.is_, srcs[g.start:g.stop], g.members)):
                dst.append(view)
                src.append(g.merged)
            else:
                dst += [_as_source(self.view(buf, self.slices[k]), srcs[k]) for k in range(g.start, g.stop)]
                src += srcs[g.start:g.stop]
        return dst, src

    # ------------------------------------------------------------------ background thread
    def _on_work_stream(self) -> ContextManager[Any]:
        """Device work of the publisher thread goes to its own stream (a new thread's current stream is the
        default one, which training uses). Every such piece of work ends in a host copy, which waits for it, so
        nothing it reads can be staged into again before it is done."""
        return torch.cuda.stream(self._work) if self._work is not None else contextlib.nullcontext()

    def host_bytes(self, buf: torch.Tensor, s: Slice) -> np.ndarray:
        """A chunk's staged bytes on the host (a view when the buffer is on the CPU)."""
        piece = buf[s.offset:s.offset + s.nbytes]
        if piece.device.type == "cpu":
            return piece.numpy()
        with self._on_work_stream():
            return piece.cpu().numpy()

    def host_views(self, buf: torch.Tensor) -> list[np.ndarray]:
        """Every chunk's bytes of a CPU buffer (slot or cache) as numpy views, made once per buffer: the
        buffers live as long as the stager and only swap roles."""
        views = self._views.get(buf.data_ptr())
        if views is None:
            flat = buf.numpy()
            views = self._views[buf.data_ptr()] = [flat[s.offset:s.offset + s.nbytes] for s in self.slices]
        return views

    def diff(self, buf: torch.Tensor) -> list[ElementDiff]:
        """Per-chunk changes of ``buf`` against the cache. On CUDA only positions and values cross to the host."""
        if self.cache is None:
            raise RuntimeError("no cache: the first publish must be full")
        if buf.device.type == "cuda":
            with self._on_work_stream():
                return device_diff(buf, self.cache, self.slices)
        out = []
        for s in self.slices:
            new = buf[s.offset:s.offset + s.nbytes]
            old = self.cache[s.offset:s.offset + s.nbytes]
            out.append(element_diff(old.numpy(), new.numpy(), s.itemsize))
        return out

    def promote(self, buf: torch.Tensor) -> None:
        """``buf`` holds the newly accepted snapshot: it becomes the cache, the old cache a free slot.

        Only the publisher thread reads or writes the cache, so a host cache is filled outside the slot lock:
        the trainer's thread takes that lock on every publish step and must not wait for a device-to-host copy.
        """
        if self.cache_on == "host" and buf.device.type != "cpu":
            try:
                if self.cache is None:
                    self.cache, self._spare = self._spare, None  # the host buffer allocated at construction
                assert self.cache is not None
                with self._on_work_stream():
                    self.cache.copy_(buf)  # synchronous: done before the slot is handed back
            finally:  # the slot is never lost, even if the copy failed (the next publish is then full)
                self.release(buf)
            return
        with self._cond:
            spare, self._spare = self._spare, None
            old, self.cache = self.cache, buf
            slot = old if old is not None else spare  # the first promotion frees the buffer allocated for the cache
            assert slot is not None
            self._free.append(slot)
            self._cond.notify_all()

    def release(self, buf: torch.Tensor) -> None:
        """Give a slot back without promoting it (failed or skipped publish)."""
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()

    def wait_event(self, event: Any) -> float:
        """Wait until a staged copy is complete (re-raising a host copy's error); returns seconds waited."""
        t0 = time.perf_counter()
        if isinstance(event, Future):
            event.result()
        elif event is not None:
            event.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the copy helper and let go of every buffer. Why: a closed publisher's owner is often still held
        (a ``with`` block's name, a callback replaced after a resharding while the new one is built), and the slots
        and cache are twice the rank's shard, in device memory on a GPU trainer. Later acquires raise."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        with self._cond:
            self._free, self.cache, self._spare = [], None, None
            self._views.clear()
            self._dst.clear()
        self.refuse()

    def refuse(self) -> None:
        """From now on :meth:`acquire` raises, also in a caller waiting there. Why: once its publisher gave up on a
        stuck snapshot, a trainer waiting for that snapshot's slot (the wait policy) would wait as long as it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@dataclass(frozen=True)
class CopyGroup:
    """Chunks ``start`` to ``stop`` (exclusive), staged by one copy of ``merged`` when more than one."""

    start: int
    stop: int
    members: tuple[torch.Tensor, ...]  # the chunk sources the group was made of
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
        members = tuple(sources[start:k])
        merged = None
        if k - start > 1:
            first = members[0].detach()
            merged = first.as_strided((sum(int(m.numel()) for m in members),), (1,), first.storage_offset())
        groups.append(CopyGroup(start, k, members, merged))
        start = k
    return groups


def _as_source(view: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The slot ``view`` (1-D) shaped as ``source``. Why: a permuted part's source is a strided N-D view whose C
    order is the published one; copied into the same shape, it is read in that order in the one copy, where
    flattening it first would copy it twice."""
    return view if source.dim() == 1 else view.view(source.shape)


def _follows(a: torch.Tensor, b: torch.Tensor, sa: Slice, sb: Slice) -> bool:
    return (sb.offset == sa.offset + sa.nbytes and sb.torch_dtype == sa.torch_dtype and a.dtype == b.dtype
            and a.device == b.device and a.dim() == b.dim() == 1 and a.is_contiguous() and b.is_contiguous()
            and a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """All chunk copies (with casts) in one call per pair of dtypes where torch offers it: one call means one GIL
    release, so a busy publisher thread cannot make the trainer wait to retake the GIL between chunks. Copies
    without a cast move integers of the same width: a floating copy may go through float on a device and rewrite
    NaN payloads, and the snapshot must hold the trainer's exact bytes.

    Why one call per (destination, source) dtype pair, not one for all: torch's CUDA ``_foreach_copy_`` (2.4 on,
    until pytorch/pytorch#173383 was fixed) takes its fused path whenever the sources share a dtype and casts every
    pair to the first destination's dtype, so fp32 masters published as bf16 with one tensor overridden to fp16 or
    fp8 gave that tensor bf16 bits, or wrote 2 bytes per element over the next chunk. Casts to or from 8-bit
    floats (single tensors) use ``copy_``: a batch of them alone would reach that fused path, which torch's
    older kernels do not dispatch for 8-bit floats (an error where ``copy_`` casts). Why a copy of more than
    ``_FOREACH_MAX_NUMEL`` elements (an FSDP1 flat shard's run of views, a fused expert tensor on few ranks) goes
    through ``copy_``: before torch 2.8 (pytorch/pytorch#156261) the CUDA foreach kernels computed each block's
    offset in 32-bit ints, and read and wrote outside the tensors; ``copy_`` splits its work into 32-bit pieces."""
    if not dst:
        return
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dst, src):
        if d.dtype == s.dtype and d.is_floating_point():
            bits = _SIGNED[d.element_size()]
            d, s = d.view(bits), s.view(bits)
        if d.numel() > _FOREACH_MAX_NUMEL or d.dtype not in _FOREACH_DTYPES or s.dtype not in _FOREACH_DTYPES:
            d.copy_(s)
            continue
        ds, ss = groups.setdefault((d.dtype, s.dtype), ([], []))
        ds.append(d)
        ss.append(s)
    foreach = getattr(torch, "_foreach_copy_", None)
    for ds, ss in groups.values():
        if foreach is not None:
            foreach(ds, ss)
        else:  # pragma: no cover - older torch
            for d, s in zip(ds, ss):
                d.copy_(s, non_blocking=True)


def device_diff(new: torch.Tensor, old: torch.Tensor, slices: Sequence[Slice], block: int = DIFF_BLOCK
                ) -> list[ElementDiff]:
    """Every chunk's changes between ``new`` (a slot's bytes, on its device) and ``old`` (the cache's bytes, on that
    device or in host memory): positions and old/new values, copied straight into host arrays.

    Chunks whose slices follow each other with the same element size are diffed as one range, then cut apart on
    the host. Why: each block costs a handful of torch calls (~150 us on an H100, ~60 us on a CPU), so a split MoE
    model's thousands of small expert parts cost a block each: on a CPU, 6,144 parts of 8 Ki elements took 476 ms
    one by one against 119 ms as one range.
    """
    runs: list[list[int]] = []
    for i, s in enumerate(slices):
        last = slices[runs[-1][-1]] if runs else None
        if last is not None and s.itemsize == last.itemsize and s.offset == last.offset + last.nbytes:
            runs[-1].append(i)
        else:
            runs.append([i])
    ranges = [Slice(slices[r[0]].offset, sum(slices[i].nbytes for i in r), sum(slices[i].numel for i in r),
                    slices[r[0]].itemsize, slices[r[0]].torch_dtype) for r in runs]
    out: list[ElementDiff] = []
    for r, d in zip(runs, _range_diffs(new, old, ranges, block)):
        if len(r) == 1:
            out.append(d)
            continue
        starts = np.cumsum([0] + [slices[i].numel for i in r])
        bounds = np.searchsorted(d.idx, starts)
        for k, i in enumerate(r):
            lo, hi = bounds[k], bounds[k + 1]
            out.append(ElementDiff(slices[i].numel, d.itemsize, d.idx[lo:hi] - starts[k], d.old[lo:hi], d.new[lo:hi]))
    return out


def _range_diffs(new: torch.Tensor, old: torch.Tensor, slices: Sequence[Slice], block: int) -> list[ElementDiff]:
    """:func:`device_diff` of each of ``slices``, one range of elements each.

    Why two passes over each block of at most ``block`` elements: the first counts every block's changes and
    reads all the counts at once, so the host arrays are allocated once at their final size (pinned on CUDA:
    the copies into them are queued and run at the link's speed); the second finds the positions, gathers both
    values and copies them out. One pass instead left the host to shift, join and split the pieces: on an H100
    that made a 2 GB shard with 2% changed take 0.27 s instead of 0.04 (``benchmarks/RESULTS.md``). The device
    temporaries stay per block (a mask, the block's int64 positions, one gathered value array, and on a host
    cache the block brought over: at most ``block * (9 + 2 * itemsize)`` bytes) however many values changed;
    a host cache crosses to the device one block at a time, once per pass. The pinned host arrays go back to
    torch's pinned-memory cache when the diff is dropped and serve the next one, so the host keeps as much
    pinned memory as the largest diff needed (12 bytes per changed bf16 element).
    """
    pieces = [(i, start, min(block, s.numel - start)) for i, s in enumerate(slices)
              for start in range(0, s.numel, block)]

    def pair(i: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = slices[i]
        kind = _SIGNED[s.itemsize]
        a = new[s.offset:s.offset + s.nbytes].view(kind)[start:start + n]
        b = old[s.offset:s.offset + s.nbytes].view(kind)[start:start + n]
        return a, b.to(a.device, non_blocking=True)  # a pinned host cache: queued, in order

    counts = torch.stack([_count(torch.ne(*pair(*p))) for p in pieces]).tolist() if pieces else []
    per_chunk = [0] * len(slices)
    for (i, _, _), c in zip(pieces, counts):
        per_chunk[i] += c
    pin = new.device.type == "cuda"
    host = [(torch.empty(c, dtype=torch.int64, pin_memory=pin),
             *(torch.empty(c, dtype=_SIGNED[s.itemsize], pin_memory=pin) for _ in range(2)))
            for s, c in zip(slices, per_chunk)]
    filled = [0] * len(slices)

    def copy_out(i: int, start: int, n: int, c: int) -> None:
        # A function of its own, so each block's temporaries are freed when it returns, not held by loop
        # variables through the next block (which doubled the peak). Stream-ordered: the caching allocator gives
        # a freed temporary only to later work on this stream, which runs after the copy out of it.
        a, b = pair(i, start, n)
        pos = _positions(torch.ne(a, b), c)
        h_idx, h_old, h_new = host[i]
        at = filled[i]
        filled[i] += c
        h_old[at:at + c].copy_(b.index_select(0, pos), non_blocking=True)
        h_new[at:at + c].copy_(a.index_select(0, pos), non_blocking=True)
        if start:
            pos += start
        h_idx[at:at + c].copy_(pos, non_blocking=True)

    for (i, start, n), c in zip(pieces, counts):
        if c:
            copy_out(i, start, n, c)
    if pin:
        torch.cuda.current_stream(new.device).synchronize()
    return [ElementDiff(s.numel, s.itemsize, h_idx.numpy(), h_old.numpy().view(UINT_BY_SIZE[s.itemsize]),
                        h_new.numpy().view(UINT_BY_SIZE[s.itemsize])) for s, (h_idx, h_old, h_new) in zip(slices, host)]


def _count(mask: torch.Tensor) -> torch.Tensor:
    """How many elements of a bool mask are set, as a 0-d tensor, without the int64 copy of the mask that
    summing a bool tensor makes (8 bytes per element): rows of 128 are summed as uint8 first."""
    flat = mask.view(torch.uint8)
    bulk = flat.numel() // 128 * 128
    total = flat[:bulk].view(-1, 128).sum(1, dtype=torch.uint8).sum()
    return total + flat[bulk:].sum() if bulk < flat.numel() else total


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted int64 positions of the ``count`` set elements of ``mask``, without a host sync where torch has
    ``nonzero_static`` (its padding, never needed since the count was read from the same bytes, is position 0:
    a valid index, where -1 would fail on the device).

    Why the fallback: torch 2.4 and 2.5 define ``nonzero_static`` for the CPU only, and on a CUDA tensor it
    raises NotImplementedError; ``nonzero`` (one host sync per block) gives the same positions. The device type
    is remembered, so the missing kernel costs one failed call per process, not one per block."""
    kind = mask.device.type
    if kind not in _NO_STATIC_NONZERO and hasattr(torch, "nonzero_static"):
        try:
            return torch.nonzero_static(mask, size=count, fill_value=0).reshape(-1)
        except NotImplementedError:
            _NO_STATIC_NONZERO.add(kind)
    return torch.nonzero(mask).reshape(-1)
