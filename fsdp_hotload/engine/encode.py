"""Encoding a staged slot: every chunk's payload and its share of the Adler-32 of the snapshot's tensors.

Why a stage of its own, with threads: on a GPU rank the device diff leaves only the changes to the host, and
framing them (one GIL-free numba call per chunk, then libzstd) becomes the longest part of a publish, about 1.2 s
of one core per 2 GB of shard at 2% changed. GPU machines have idle cores beside each rank, so chunks are
encoded on ``workers`` threads at once (largest first, so one big chunk does not end the publish alone). A CPU
trainer keeps one: training already uses the cores, and every extra core the publisher takes comes out of the
step. The bytes are the same whatever the number of threads; only the order in which chunks finish changes.

Example::

    enc = ChunkEncoder(chunks, stager, get_codec("arc_v2"), workers=4)
    out = enc.encode(slot, "delta", cache_parts)     # publisher thread; out.payloads[i]: chunk i's payload
    enc.close()
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..arc.adler import add_parts, chunk_parts, global_elements, update_parts
from ..arc.codecs import ElementDiff
from ..arc.dense import box_run_tables
from ..arc.dtypes import numel
from .pool import DaemonPool
from .staging import ChunkLike, Stager

log = logging.getLogger("fsdp_hotload")
AUTO_MAX_WORKERS = 4  # beyond this the largest chunk and the memory bus, not cores, bound a GPU rank's encode


EncodedChunk = tuple[bytes | np.ndarray, tuple[int, int], int]  # (payload, parts, changed): see :class:`Encoded`


@dataclass
class Encoded:
    """Every chunk's encoding, in chunk order, as columns.

    Why columns, not an object per chunk: a publish holds the encodings from the encode to the routing, long
    enough for them to reach the garbage collector's oldest generation, and at tens of thousands of chunks such
    objects alone set off a full collection, which holds the GIL, every publish or two (``benchmarks/RESULTS.md``).
    Bytes, arrays and tuples of ints are not tracked by the collector; a list is one object.
    """

    payloads: list[bytes | np.ndarray]  # a delta's codec payload, or a full snapshot's raw bytes (uint8)
    parts: list[tuple[int, int]]  # each chunk's Adler-32 shares of the new bytes
    changed: list[int]  # elements that differ from the cache (0 for a full snapshot)
    diff_s: float = 0.0  # the device diff's seconds (0 on the host path)


def auto_workers(device: torch.device, cpu_count: int | None = None, local_ranks: int | None = None) -> int:
    """Threads that encode one rank's chunks when the config leaves it open: 1 on a CPU trainer (its cores
    train), else half this rank's share of the cores, at most ``AUTO_MAX_WORKERS``."""
    if device.type == "cpu":
        return 1
    if cpu_count is None:
        cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks is None:
        local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    return max(1, min(AUTO_MAX_WORKERS, cpu_count // local_ranks // 2))


class ChunkEncoder:
    """Turns a staged slot into per-chunk payloads: full (the raw bytes), or a delta against the stager's cache
    (host buffers: one pass per chunk with the codec's ``encode_delta``; a device: the device diff first, then
    the codec frames each chunk's changes)."""

    def __init__(self, chunks: Sequence[ChunkLike], stager: Stager, codec: Any, *, workers: int = 1,
                 name: str = "hotload-encode", verbose: bool = False) -> None:
        if workers < 1:
            raise ValueError(f"encode workers must be >= 1, got {workers}")
        self.chunks = list(chunks)
        self.stager = stager
        self.codec = codec
        self.workers = workers
        self._name = name
        self._verbose = verbose  # rank 0 logs, once, how deltas are encoded
        self._pool: DaemonPool | None = None
        self._runs: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(self.chunks)  # per chunk, lazily
        # Largest chunks first: with several threads, a big chunk started last would end the publish alone.
        self._order = sorted(range(len(self.chunks)), key=lambda i: -stager.slices[i].nbytes)

    def encode(self, buf: torch.Tensor, kind: str, cache_parts: Sequence[tuple[int, int]]) -> Encoded:
        """Every chunk of ``buf`` encoded as ``kind`` ("full" or "delta"), in chunk order. ``cache_parts`` are
        the cache's Adler-32 shares per chunk."""
        cache = self.stager.cache
        dense = (kind == "delta" and cache is not None and buf.device.type == "cpu" and cache.device.type == "cpu"
                 and hasattr(self.codec, "encode_delta"))
        if kind == "delta" and self._verbose:
            self._verbose = False
            how = (self.codec.delta_path() if dense and hasattr(self.codec, "delta_path") else
                   "one pass per chunk" if dense else f"{buf.device.type} diff, then the changes of each chunk")
            log.info("%s deltas: %s; %d encode thread(s) per rank", self.codec.name, how, self.workers)
        old = self.stager.host_views(cache) if dense and cache is not None else None
        # A host slot's chunks as the numpy views kept per buffer: a full snapshot's chunk cut as a tensor, then
        # made an array, holds that tensor object until the file is written (one per chunk for the collector).
        new = self.stager.host_views(buf) if dense or (kind == "full" and buf.device.type == "cpu") else None
        diffs, diff_s = None, 0.0  # 0 where no separate diff runs: a full, or a diff fused into encoding (dense)
        if kind == "delta" and not dense:
            t0 = time.perf_counter()
            diffs = self.stager.diff(buf)
            diff_s = time.perf_counter() - t0

        def one(i: int) -> EncodedChunk:
            return self._chunk(i, buf, old, new, diffs, cache_parts[i])

        if self.workers == 1 or len(self.chunks) < 2:
            return _columns([one(i) for i in range(len(self.chunks))], diff_s)
        if self._pool is None:  # started from the publisher's thread, so its workers inherit that thread's nice
            self._pool = DaemonPool(self.workers, self._name)
        out: list[EncodedChunk | None] = [None] * len(self.chunks)
        errors: dict[int, BaseException] = {}
        taken = iter(self._order)  # each worker takes the next chunk: one task per worker, not one per chunk
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = next(taken, None)
                if i is None:
                    return
                try:
                    out[i] = one(i)
                except BaseException as exc:  # noqa: BLE001 - raised below, once every worker is done
                    errors[i] = exc

        futures = [self._pool.submit(work) for _ in range(min(self.workers, len(self.chunks)))]
        wait(futures)  # every worker is done with the buffers before the slot can be released
        for f in futures:
            f.result()
        if errors:
            raise errors[min(errors)]
        return _columns(out, diff_s)

    def _chunk(self, i: int, buf: torch.Tensor, old: list[np.ndarray] | None, new: list[np.ndarray] | None,
               diffs: list[ElementDiff] | None, cached: tuple[int, int]) -> EncodedChunk:
        c, s = self.chunks[i], self.stager.slices[i]
        space = (numel(c.shape),) if c.space == "flat" else tuple(c.shape)
        total = s.itemsize * numel(c.shape)
        if old is not None and new is not None:
            tables = self._runs[i]
            if tables is None:
                tables = self._runs[i] = box_run_tables(c.box, space, s.itemsize)
            payload, changed, delta = self.codec.encode_delta(old[i], new[i], s.itemsize, tables, total)
            return payload, add_parts(cached, delta), int(changed)
        if diffs is not None:
            d = diffs[i]
            parts = update_parts(cached, global_elements(d.idx, c.box, space), d.old, d.new, s.itemsize, total)
            return self.codec.encode(d), parts, int(d.changed)
        # The staged bytes themselves (a view on a host slot, which nothing writes until this publish settles;
        # a copy from a device): a full snapshot is the whole shard, so a copy here is that much memory more.
        raw = new[i] if new is not None else self.stager.host_bytes(buf, s)
        return raw, chunk_parts(raw, c.box, space, s.itemsize, total), 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _columns(chunks: Sequence[Any], diff_s: float) -> Encoded:
    # Not zip(*chunks): that holds an iterator object per chunk while it runs, enough to reach the oldest generation.
    return Encoded([c[0] for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks], diff_s)
