"""Staging: the only work the trainer's main thread does, plus the diff against the cache.

Each rank's chunks are packed into one flat byte buffer per slot (offsets aligned to 8 bytes), in the snapshot
dtype, on the chunks' own device. ``stage`` copies (and casts) every chunk's source into a free slot; on CUDA it
does so on a side stream and makes the training stream wait for that copy on the device, so the host returns at
once and the next optimizer step cannot overwrite a parameter before it has been copied. The publisher's own device
work (the diff, reading a full snapshot, filling a host cache) runs on a second stream of its own, so it never
queues behind, or holds up, the training stream; the diff (``device_diff.py``) walks each chunk (adjacent chunks
of one element size as one range) in blocks of ``DIFF_BLOCK`` elements, so its device temporaries stay below ~52 MB
(bf16) however many values changed. On the CPU it can hand the copy to a helper thread (``background=True``); the
caller then fences before the next update. The copies into each buffer are batched once and kept
(``copies.CopyPlan``). The cache is one more buffer with the same layout holding the bytes of the last accepted
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
from typing import Any, ContextManager, Iterator, Protocol, Sequence

import numpy as np
import torch

from ..arc.codecs import ElementDiff, element_diff
from ..arc.dtypes import itemsize, torch_name
from .copies import SIGNED, CopyPlan, Slice, as_source, copy_groups, strided_cast, window
from .device_diff import DIFF_BLOCK, HostArena, device_diff

__all__ = ["DIFF_BLOCK", "ChunkInfo", "ChunkLike", "HostArena", "Stager", "device_diff"]



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
class ChunkInfo:
    """A chunk without its source tensor: what the engine keeps of it after construction. Why: a chunk's source
    is a view of the model's memory, and only the copy plans may hold that (:meth:`Stager.rebind` replaces them),
    so that memory the model lets go of (a checkpoint loaded with ``assign=True``) is freed, not kept to close()."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    space: str
    box: Any


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
        self._arena = HostArena(pin=self.cuda)  # the device diff's host arrays, kept from one diff to the next
        self._work = torch.cuda.Stream(self.device) if self.cuda else None  # the publisher's device work
        self._copier: ThreadPoolExecutor | None = None  # host copies off the trainer's thread (``background``)
        self._views: dict[int, list[np.ndarray]] = {}  # host_views by buffer address
        self._own = [c.source for c in self.chunks]  # checked above
        self._forgotten = False  # see forget_sources
        self.chunks = [ChunkInfo(c.name, tuple(c.shape), c.dtype, c.space, c.box) for c in self.chunks]
        self._groups = copy_groups(self._own, self.slices)
        self._plans: dict[int, CopyPlan] = {}  # the own sources' copies into each buffer, by buffer address
        self._where: list[tuple[int, int, bool] | None] = []  # each chunk's place in every plan (see _plan)
        self._own_src: list[torch.Tensor] = []  # each copy group's source in the plans
        self._bits: list[bool] = []  # whether each group is copied as integers (no cast)
        # Every buffer that will be staged into gets its plan now: made at the first publishes instead, they took
        # ~3 us per chunk and buffer from those steps (0.5 s at 160k chunks), on the trainer's thread on a GPU.
        with torch.no_grad():
            for buf in self._free + ([self._spare] if self._spare is not None and self._spare.device == self.device
                                     else []):
                self._plan(buf)

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
        if sources is None and self._forgotten:
            raise RuntimeError("the chunks' own sources were let go of (forget_sources): give stage() its sources")
        srcs, changed = (self._own, []) if sources is None else self._checked(sources)
        if self.cuda:
            assert self._stream is not None
            main = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(main)
            with self._on_device(), torch.no_grad(), torch.cuda.stream(self._stream):
                # The caching allocator knows only the stream a caller's tensor was made on: one dropped after
                # publish() could be handed out again, and written, before this stream's copy read it. The own
                # sources need none: they are held until rebind(), which waits for this stream first.
                for k in changed:
                    srcs[k].record_stream(self._stream)
                try:
                    self._copy(buf, srcs, changed)
                finally:  # also after a copy that failed part way: the slot goes back, its copies may still run
                    # blocking: the publisher thread sleeps in synchronize() instead of spinning a core
                    event = torch.cuda.Event(blocking=True)
                    event.record(self._stream)
                    main.wait_event(event)  # the next optimizer step waits for the copy on the device, not the host
            return event
        if background:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hotload-stage")
            return self._copier.submit(self._copy_host, buf, srcs, changed)
        self._copy_host(buf, srcs, changed)
        return None

    def _checked(self, sources: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
        """Caller-given sources, one per chunk with the chunk's element count, on the shard's device, and the
        indices of those that are not the chunk's own. Why: a copy broadcasts, so a source of one element would
        fill its whole chunk and be published without any error; and a source on another device is copied without
        waiting for that device's work (on GPUs). The chunks' own sources, which the callback passes while the
        model's storage is unchanged, were checked at construction: one identity pass skips them (a split MoE
        model has tens of thousands, ~0.4 us each to count)."""
        srcs = list(sources)
        if len(srcs) != len(self.chunks):
            raise ValueError(f"{len(srcs)} source tensors for {len(self.chunks)} chunks (one per chunk, in order)")
        changed = [k for k, same in enumerate(map(operator.is_, srcs, self._own)) if not same]
        if not changed:
            return self._own, changed  # which _copy knows without looking again
        for k in changed:
            src, s = srcs[k], self.slices[k]
            if int(src.numel()) != s.numel:
                raise ValueError(f"chunk {self.chunks[k].name!r}: source has {src.numel()} elements, the chunk "
                                 f"{s.numel}")
            if src.device != self.device:  # the side stream waits only for this device's stream
                raise ValueError(f"chunk {self.chunks[k].name!r}: source is on {src.device}, the shard on "
                                 f"{self.device}")
        return srcs, changed

    def rebind(self, sources: Sequence[torch.Tensor]) -> None:
        """Make ``sources`` the chunks' own, in place of those given at construction (the model's storage was
        replaced: a checkpoint loaded with ``assign=True``, a parameter swapped). Why: the copy plans hold the
        tensors they read, so the memory the model let go of stayed alive, a whole shard (device memory on a GPU
        trainer), until close(). No copy may be running (the publisher calls this after its fence); the plans are
        made again at the next copy into each buffer."""
        srcs, changed = self._checked(sources)
        if not changed:
            return
        if self._stream is not None:  # the caching allocator does not know the side stream reads the old ones
            with self._on_device():
                self._stream.synchronize()
        self._own = list(srcs)
        self._groups = copy_groups(self._own, self.slices)
        self._plans.clear()
        self._where, self._own_src, self._bits = [], [], []

    def forget_sources(self) -> None:
        """Let go of the chunks' own sources for good: every later :meth:`stage` must be given its sources. Why: a
        caller that brings other tensors at every publish (a state dict gathered at each step) would keep the first
        ones, a whole copy of the weights, alive until close(). Stand-ins of each source's dtype and shape over one
        element take their place (no given source is one of them, and none is copied as a run with another); each
        copy is then planned for the sources it is given. No copy may be running."""
        one: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        stand_ins = [one.setdefault((t.dtype, t.device), torch.zeros((), dtype=t.dtype, device=t.device)
                                    ).expand(t.shape) for t in self._own]
        self.rebind(stand_ins)
        self._forgotten = True

    def _copy_host(self, buf: torch.Tensor, srcs: Sequence[torch.Tensor], changed: Sequence[int]) -> None:
        with torch.no_grad():  # thread-local: set here, on whichever thread copies
            self._copy(buf, srcs, changed)

    def _copy(self, buf: torch.Tensor, srcs: Sequence[torch.Tensor], changed: Sequence[int]) -> None:
        """Stage ``srcs`` into ``buf`` (under ``no_grad``): by the buffer's plan, with the ``changed`` chunks'
        sources put in place of their own where they fit it, else pair by pair."""
        # Once the own sources are let go of, every source is given: a plan made for stand-ins would be patched
        # whole at each copy, and batch the given sources by the stand-ins' layout, not theirs.
        plan = None if self._forgotten else self._plan(buf)
        if plan is not None and changed:
            plan = self._patched(plan, srcs, changed)
        if plan is None:
            plan = CopyPlan.of(*self._pairs(buf, srcs))[0]
        plan.run()

    def _plan(self, buf: torch.Tensor) -> CopyPlan:
        """The copies that stage the chunks' own sources into ``buf``, batched once per buffer and kept.

        Why: sorting tens of thousands of copies into batches by dtype pair, and making each chunk's slot view,
        cost the trainer's thread ~1 us per chunk on every publish, twice what the copies take. A plan holds one
        window of the buffer per copy (:func:`~.copies.window`) and the sources once for all buffers (an integer view of
        each one copied without a cast). The buffers live as long as the stager and only swap roles."""
        plan = self._plans.get(buf.data_ptr())
        if plan is None:
            if not self._where:
                self._own_src, self._bits = [], []
                for g in self._groups:
                    src = self._own[g.start] if g.merged is None else g.merged
                    bits = src.dtype == self.slices[g.start].torch_dtype and src.is_floating_point()
                    self._own_src.append(src.view(SIGNED[src.element_size()]) if bits else src)
                    self._bits.append(bits)
            plan, where = CopyPlan.of(self._destinations(buf), self._own_src)
            if not self._where:
                self._where = [None] * len(self.chunks)
                for g, (batch, pos, _), bits in zip(self._groups, where, self._bits):
                    if g.merged is None:
                        self._where[g.start] = (batch, pos, bits)
            self._plans[buf.data_ptr()] = plan
        return plan

    def _destinations(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each copy group's window of ``buf`` for the own sources: in their shape, as integers where not cast."""
        out = []
        for g, src, bits in zip(self._groups, self._own_src, self._bits):
            first, last = self.slices[g.start], self.slices[g.stop - 1]
            kind = SIGNED[first.itemsize] if bits else first.torch_dtype
            shape = (last.offset + last.nbytes - first.offset) // first.itemsize if src.dim() == 1 else src.shape
            out.append(window(buf, first.offset, kind, shape))
        return out

    def _patched(self, plan: CopyPlan, srcs: Sequence[torch.Tensor], changed: Sequence[int]) -> CopyPlan | None:
        """``plan`` with the ``changed`` chunks' sources in place of their own (a buffer cloned for a background
        copy, a model walked again), or None where one does not fit: it is part of a run copied as one, or its
        dtype or shape differs from its own (the copy's destination view and batch would differ)."""
        batches, singles = list(plan.batches), list(plan.singles)
        copied: set[int] = set()
        for k in changed:
            where, src, own = self._where[k], srcs[k], self._own[k]
            if where is None or src.dtype != own.dtype or src.shape != own.shape:
                return None
            batch, pos, bits = where
            if batch >= 0 and not bits and strided_cast(plan.batches[batch][0][pos], src):
                return None  # a cast from a strided CPU source is not batched (see CopyPlan)
            if bits:
                src = src.view(SIGNED[src.element_size()])
            if batch < 0:
                singles[pos] = (singles[pos][0], src)
                continue
            if batch not in copied:
                copied.add(batch)
                batches[batch] = (batches[batch][0], list(batches[batch][1]))
            batches[batch][1][pos] = src
        return CopyPlan(batches, singles)

    def _pairs(self, buf: torch.Tensor, srcs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The copies that stage ``srcs`` into ``buf``: one per group of chunks whose sources are still the
        adjacent views the group was made of (:func:`copy_groups`), one per chunk otherwise."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        own = srcs is self._own
        for g in self._groups:
            if g.stop - g.start == 1:  # no detach(): called under no_grad (one per chunk and publish adds up)
                dst.append(as_source(self.view(buf, self.slices[g.start]), srcs[g.start]))
                src.append(srcs[g.start])
            elif own or all(map(operator.is_, srcs[g.start:g.stop], g.members)):
                first, last = self.slices[g.start], self.slices[g.stop - 1]
                dst.append(buf[first.offset:last.offset + last.nbytes].view(first.torch_dtype))
                src.append(g.merged)
            else:
                dst += [as_source(self.view(buf, self.slices[k]), srcs[k]) for k in range(g.start, g.stop)]
                src += srcs[g.start:g.stop]
        return dst, src

    # ------------------------------------------------------------------ background thread
    def _on_device(self) -> ContextManager[Any]:
        """The shard's device as the calling thread's current device, for the calls that follow. Why: a new
        thread's current device is 0, and leaving a stream context on another device, or a CUDA call such as
        an event's synchronize, made from it creates a CUDA context on GPU 0 (~0.5 GB) in every rank of the node.
        The guard's exit switches back only to a device that already has one."""
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    @contextlib.contextmanager
    def _on_work_stream(self) -> Iterator[None]:
        """Device work of the publisher thread goes to its own stream (a new thread's current stream is the
        default one, which training uses), on the shard's device. Every such piece of work ends in a host copy,
        which waits for it, so nothing it reads can be staged into again before it is done."""
        if self._work is None:
            yield
            return
        with self._on_device(), torch.cuda.stream(self._work):
            yield

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
                return device_diff(buf, self.cache, self.slices, arena=self._arena)
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
            with self._on_device():
                event.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the copy helper and let go of every buffer. Why: a closed publisher's owner is often still held
        (a ``with`` block's name, a callback replaced after a resharding while the new one is built), and the slots
        and cache are twice the rank's shard, in device memory on a GPU trainer. Later acquires raise."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        self._arena.buf = None
        if self._stream is not None and self._work is not None:  # no copy may still write a buffer let go of
            with self._on_device():
                self._stream.synchronize()
                self._work.synchronize()
        with self._cond:
            self._free, self.cache, self._spare = [], None, None
            self._views.clear()
            self._plans.clear()
            # the chunks' sources too: views of the model's memory, which a closed publisher its owner still holds
            # must not keep alive once the model has let go of it
            self._own, self._groups, self._own_src, self._where, self._bits = [], [], [], [], []
        self.refuse()

    def refuse(self) -> None:
        """From now on :meth:`acquire` raises, also in a caller waiting there. Why: once its publisher gave up on a
        stuck snapshot, a trainer waiting for that snapshot's slot (the wait policy) would wait as long as it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
