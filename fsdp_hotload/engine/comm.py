"""Collectives the publisher needs, over a side gloo group (never the training process group).

Two narrow operations cover the pipeline: ``exchange`` (each rank sends one byte blob to every other rank, used
to route chunk payloads to the rank that writes each file) and ``gather``/``broadcast`` of small Python objects
(statuses to rank 0, the outcome back). Max-reductions carry the ranks' agreements and their comparisons of
their copies of tensors. The publisher thread and the trainer's main thread each get their own
group, because two threads must never interleave collectives on one group.

Example::

    comm = GlooComm.create()                  # collective: every rank calls it, in the same order
    incoming = comm.exchange([b"to-0", b"to-1"])
"""
from __future__ import annotations

import logging
import pickle
import struct
import threading
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from .copies import empty_bytes


Blob = Any  # bytes-like: bytes, a writable memoryview (dumps_buffer), or a numpy uint8 array (received)


class StoreError(RuntimeError):
    """The job's key-value store could not be read or written: its host is gone, or did not answer within
    ``STORE_READ_S`` (:class:`StoreTimeout`), or torch gave none."""


class StoreTimeout(StoreError):
    """A call to the job's store did not return within ``STORE_READ_S`` (or an earlier one still has not): it may
    still take effect, and the store may answer again."""


class ExchangeSkipped(RuntimeError):
    """No blob moved in an exchange: a rank could not take its part. Raised on every rank of the group, after
    they agreed on it, so the group stays usable (unlike a collective that failed or timed out)."""


class Comm(Protocol):
    rank: int
    world: int

    def exchange(self, outgoing: Sequence[Blob]) -> list[Blob]:
        """``outgoing[d]`` goes to rank d; returns ``incoming[s]`` from rank s (own blob passed through). Blobs
        are bytes-like; writable ones (:func:`dumps_buffer`) are sent without a copy. Raises
        :class:`ExchangeSkipped` on every rank when a rank cannot take part."""
        ...

    def gather(self, obj: Any) -> list[Any] | None:
        """Objects from every rank on rank 0 (None elsewhere)."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object on every rank."""
        ...

    def allreduce_max_async(self, value: int) -> "Callable[..., int]":
        """Start a max-reduction; the returned function, ``result(timeout=None)``, waits for and returns the
        result: past ``timeout`` seconds it raises TimeoutError and the reduction stays pending."""
        ...

    def allreduce_max(self, values: "np.ndarray") -> "np.ndarray":
        """The element-wise maximum of every rank's int64 array (one shape on every rank), on every rank."""
        ...

    def note(self, key: str, value: str, *, at_exit: bool = False) -> None:
        """Leave ``value`` under ``key`` for the other ranks, outside any collective: it never waits for them
        (why: a rank leaving on an exception tells the others it will not take part, and must not wait for them,
        since they may be stuck elsewhere). Best effort: it never raises. ``at_exit``: from an atexit hook."""
        ...

    def noted(self, key: str) -> str | None:
        """The value some rank left under ``key`` (:meth:`note`), or None (also where it cannot be read)."""
        ...

    def count(self, key: str, n: int) -> int:
        """Add ``n`` to the counter ``key`` in the job's store, atomically; the new total (n=0 reads it).
        :class:`StoreError` where the store cannot be reached."""
        ...

    def settle(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless some rank set it first, atomically; the value it holds now (the first
        one set). Why: one decision every rank reads, whoever sets it. :class:`StoreError` as :meth:`count`."""
        ...

    def close(self) -> None:
        """Release what the collectives hold (the group); called once, after the last collective."""
        ...


class LocalComm:
    """The single-process case: every collective is the identity."""

    rank = 0
    world = 1

    def __init__(self) -> None:
        self._kv: dict[str, Any] = {}

    def exchange(self, outgoing: Sequence[Blob]) -> list[Blob]:
        return [outgoing[0]]

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj

    def allreduce_max_async(self, value: int) -> "Callable[..., int]":
        return lambda timeout=None: value

    def allreduce_max(self, values: "np.ndarray") -> "np.ndarray":
        return values.copy()

    def note(self, key: str, value: str, *, at_exit: bool = False) -> None:
        pass

    def noted(self, key: str) -> str | None:
        return None

    def count(self, key: str, n: int) -> int:
        self._kv[key] = self._kv.get(key, 0) + n
        return int(self._kv[key])

    def settle(self, key: str, value: str) -> str:
        return str(self._kv.setdefault(key, value))

    def close(self) -> None:
        pass


class GlooComm:
    """Collectives on a dedicated gloo group; payloads travel as uint8 CPU tensors point to point."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._closed = False
        self._async: list[Any] = []  # reductions a bounded wait gave up on (see close)
        self.kv = JobStore(_job_store())  # held: destroy_process_group() unregisters the default one
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, r) for r in range(self.world)] if group is not None else list(
            range(self.world))

    @classmethod
    def create(cls, timeout_s: float | None = None) -> "GlooComm":
        """A new gloo group over all ranks (collective; call on every rank in the same order).

        ``timeout_s`` bounds each collective. Why set it: a new group does not take the timeout given to
        ``init_process_group`` (it gets torch's default, 30 minutes), and a rank waits in a collective while
        rank 0 signals and waits for every replica, which may legitimately take longer.
        """
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        return cls(dist.new_group(backend="gloo", timeout=timeout))

    def close(self) -> None:
        """Destroy the group (local, not a collective). Why: each group holds gloo's threads and a socket per
        peer, so a job that makes a new callback after every resharding would otherwise leak them (they are freed
        with the group object, which is let go here). A collective started after (another thread's close()) then
        raises: with ``group=None`` it would run on torch's default group, the training one.

        A group with a reduction still pending (a busy agreement that close() gave up on) is left for the
        process's exit: gloo cannot cancel it, and destroying the group may wait for it until the group's timeout."""
        group, self._group, self._closed = self._group, None, True
        if any(not work.is_completed() for work in self._async):
            logging.getLogger("fsdp_hotload").info(
                "hotload: a side group with a reduction still pending is left for the process's exit")
            return
        self._async.clear()  # a work holds its group, whose sockets close only once none is left
        if group is not None and self._dist.is_initialized():
            self._dist.destroy_process_group(group)

    @property
    def group(self) -> Any:
        """The gloo group; RuntimeError once :meth:`close` destroyed it."""
        if self._closed:
            raise RuntimeError("this side group was destroyed (close() ran)")
        return self._group

    def exchange(self, outgoing: Sequence[Blob]) -> list[Blob]:
        """Received blobs are the receive buffers themselves (numpy arrays), not copies: a full snapshot's pieces
        are a rank's whole shard, so each copy here would cost that much host memory again.

        Raises :class:`ExchangeSkipped` on every rank, with nothing sent, when a rank cannot allocate its receive
        buffers. Why every rank agrees first (one small all-reduce): a rank that raised alone would leave the
        others waiting on its sends and receives until the group's timeout (an hour by default), and the group
        would be unusable for the rest of the job, for an error that fails one snapshot only.
        """
        import torch

        dist = self._dist
        if len(outgoing) != self.world:
            raise ValueError(f"exchange needs one blob per rank ({self.world}), got {len(outgoing)}")
        sizes = torch.tensor([_nbytes(b) for b in outgoing], dtype=torch.int64)
        table = [torch.empty(self.world, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(table, sizes, group=self.group)
        bufs: dict[int, Any] = {}
        failure: BaseException | None = None
        try:
            for peer in range(self.world):
                n_in = int(table[peer][self.rank])
                if peer != self.rank and n_in:
                    bufs[peer] = torch.empty(n_in, dtype=torch.uint8)
        except (MemoryError, RuntimeError) as exc:  # torch raises RuntimeError for an allocation it cannot make
            bufs.clear()
            failure = exc
        failed = torch.zeros(self.world, dtype=torch.int64)  # one flag per rank: the message names each that failed
        failed[self.rank] = failure is not None
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if int(failed.sum()):
            ranks = [int(r) for r in failed.nonzero().flatten()]
            shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
            who = (f"rank {shown} could not allocate its" if len(ranks) == 1
                   else f"ranks {shown} could not allocate their")
            mine = f" (this rank: {failure!r})" if failure is not None else ""
            raise ExchangeSkipped(f"{who} receive buffers{mine}")
        incoming: list[Blob] = [b""] * self.world
        incoming[self.rank] = outgoing[self.rank]
        reqs = []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            if peer in bufs:
                reqs.append(dist.irecv(bufs[peer], src=self._global[peer], group=self.group))
            if _nbytes(outgoing[peer]):
                reqs.append(dist.isend(_as_tensor(outgoing[peer]), dst=self._global[peer], group=self.group))
        for r in reqs:
            r.wait()
        for peer, buf in bufs.items():
            incoming[peer] = buf.numpy()
        return incoming

    def gather(self, obj: Any) -> list[Any] | None:
        """One fixed-size gather (statuses are small); a rank whose object does not fit sends it to rank 0 point
        to point after it. torch's ``gather_object`` needs two collectives, each ~0.5 ms of CPU per rank here."""
        import torch

        dist, root = self._dist, self._global[0]
        if self.rank != 0:
            blob = dumps(obj)
            dist.gather(_framed(blob), None, dst=root, group=self.group)
            if len(blob) > _INLINE:
                dist.send(_as_tensor(blob), dst=root, group=self.group)
            return None
        bufs = [torch.empty(_INLINE + 8, dtype=torch.uint8) for _ in range(self.world)]
        dist.gather(torch.empty(_INLINE + 8, dtype=torch.uint8), bufs, dst=root, group=self.group)
        out: list[Any] = [obj]
        for r in range(1, self.world):
            out.append(_unframed(bufs[r], lambda big, r=r: dist.recv(big, src=self._global[r], group=self.group)))
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object in one fixed-size broadcast, plus a second one only when it does not fit."""
        import torch

        dist, root = self._dist, self._global[0]
        if self.rank == 0:
            blob = dumps(obj)
            dist.broadcast(_framed(blob), src=root, group=self.group)
            if len(blob) > _INLINE:
                dist.broadcast(_as_tensor(blob), src=root, group=self.group)
            return obj
        buf = torch.empty(_INLINE + 8, dtype=torch.uint8)
        dist.broadcast(buf, src=root, group=self.group)
        return _unframed(buf, lambda big: dist.broadcast(big, src=root, group=self.group))

    def allreduce_max_async(self, value: int) -> "Callable[..., int]":
        import torch

        t = torch.tensor([value], dtype=torch.int64)
        work = self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group, async_op=True)
        ended: list[threading.Event] = []  # made at the first bounded wait: the busy agreement's start stays as is

        def result(timeout: float | None = None) -> int:
            if timeout is not None:
                if not ended:  # set on success and on failure; waited on, not work.wait(timeout), so a wait cut
                    ended.append(threading.Event())  # short is told from gloo's own errors
                    work.get_future().add_done_callback(lambda _: ended[0].set())
                if not ended[0].wait(timeout):
                    if work not in self._async:
                        self._async.append(work)  # may stay pending: close() must not destroy its group
                    raise TimeoutError(f"the max-reduction did not end within {timeout:g} s")
            work.wait()
            return int(t.item())

        return result

    def note(self, key: str, value: str, *, at_exit: bool = False) -> None:
        self.kv.note(key, value, at_exit=at_exit)

    def noted(self, key: str) -> str | None:
        return self.kv.noted(key)

    def count(self, key: str, n: int) -> int:
        return self.kv.count(key, n)

    def settle(self, key: str, value: str) -> str:
        return self.kv.settle(key, value)

    def allreduce_max(self, values: "np.ndarray") -> "np.ndarray":
        import torch

        t = torch.from_numpy(values.astype("int64", copy=True))  # a copy: reduced in place
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.group)
        return t.numpy()


class JobStore:
    """The job's key-value store (torch.distributed's, where the ranks met), for :meth:`Comm.note`,
    :meth:`Comm.count` and :meth:`Comm.settle`: what the ranks tell each other outside any collective.

    Why every call is bounded (``STORE_READ_S``, on a daemon thread): a call to a store whose host stopped
    answering (frozen, or lost without a TCP reset) blocks past the store's own timeout, 30 minutes by default.
    While such a call has not returned, every other one raises :class:`StoreTimeout` at once (``noted``: None), so
    at most one thread waits on the store; once it returns, the store is used again (a host paused for a while).

    Example::

        kv = JobStore(store)                     # a torch.distributed Store, or None
        kv.settle("hotload/x/decision", "skip")  # "skip", or what another rank set first
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self._stuck: threading.Thread | None = None  # a call that did not return within STORE_READ_S
        self._warned = False

    def note(self, key: str, value: str, *, at_exit: bool = False) -> None:
        """``at_exit``: set on this thread (no new thread can start at the interpreter's exit; a set returns at
        once, also where the store's host stopped answering)."""
        try:
            if at_exit and self._store is not None:
                self._store.set(key, value)
            else:
                self._call(lambda store: store.set(key, value))
        except Exception as exc:  # noqa: BLE001 - best effort: the others then wait on their own deadline
            logging.getLogger("fsdp_hotload").debug("hotload: could not leave a note for the other ranks: %s", exc)

    def noted(self, key: str) -> str | None:
        try:
            return self._call(lambda store: store.get(key).decode() if store.check([key]) else None)
        except StoreError:  # unreadable: as if none was left (the vote's own store calls raise it)
            return None

    def count(self, key: str, n: int) -> int:
        return int(self._call(lambda store: store.add(key, n)))

    def settle(self, key: str, value: str) -> str:
        held = self._call(lambda store: store.compare_set(key, "", value))  # "": set where it is not yet
        return bytes(held).decode()

    def _call(self, op: Callable[[Any], Any]) -> Any:
        """``op(store)``, run on a daemon thread and waited for at most ``STORE_READ_S``."""
        store, got = self._store, []
        if store is None:
            raise StoreError("torch.distributed has none")
        if self._stuck is not None and self._stuck.is_alive():
            raise StoreTimeout(f"an earlier call has not returned (it did not answer within {STORE_READ_S:g} s)")
        self._stuck = None

        def call() -> None:
            try:
                got.append((True, op(store)))
            except Exception as exc:  # noqa: BLE001 - told to the caller
                got.append((False, exc))

        caller = threading.Thread(target=call, name="hotload-store", daemon=True)
        caller.start()
        caller.join(STORE_READ_S)
        if caller.is_alive():
            self._stuck = caller
            if not self._warned:
                self._warned = True
                logging.getLogger("fsdp_hotload").warning(
                    "hotload: the job's store did not answer within %g s: it is not used until that call returns",
                    STORE_READ_S)
            raise StoreTimeout(f"it did not answer within {STORE_READ_S:g} s")
        ok, value = got[0]
        if not ok:
            raise StoreError(repr(value)) from value
        return value


STORE_READ_S = 2.0  # the longest a call to the job's store is waited for (JobStore)


def _job_store() -> Any:
    """The job's key-value store (the rendezvous one; torch has no public accessor for it), or None."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - none: no note is left, and close()'s vote ends at once (StoreError)
        return None


_INLINE = 8192 - 8  # object bytes that travel inside the fixed-size gather/broadcast buffer


def _framed(blob: bytes) -> Any:
    """A fixed-size uint8 tensor: the blob's length (8 bytes, little-endian), then the blob if it fits."""
    import torch

    buf = torch.zeros(_INLINE + 8, dtype=torch.uint8)
    buf[:8] = _as_tensor(len(blob).to_bytes(8, "little"))
    if 0 < len(blob) <= _INLINE:
        buf[8:8 + len(blob)] = _as_tensor(blob)
    return buf


def _unframed(buf: Any, receive_big: Callable[[Any], Any]) -> Any:
    """The object in a :func:`_framed` buffer, or (too big to fit) the one ``receive_big`` fills in after it."""
    import torch

    n = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    if n <= _INLINE:
        return loads(buf[8:8 + n].numpy())
    big = torch.empty(n, dtype=torch.uint8)
    receive_big(big)
    return loads(big.numpy())


def exchange_objects(comm: Comm, outgoing: list[Any], *, failed: bool = False) -> tuple[list[Any], str | None]:
    """``outgoing[d]`` (picklable) goes to rank d (the list is emptied); returns what each rank sent this one
    and this rank's error, if any. ``failed``: this rank's part already failed, so it sends nothing, and every
    peer reports that instead of writing files that cannot be committed (a full snapshot's, gigabytes).

    Why the error is returned, not raised: like every collective of a snapshot, the exchange must run on every
    rank, or the others wait for this one until the group's timeout. A rank that cannot pickle its objects (out
    of memory, say) sends nothing, and a rank that gets nothing from a peer reports it too (None in its place);
    when a rank cannot receive (:class:`ExchangeSkipped`), nothing moves and every rank reports that.
    Large objects are copied no more than the move needs: this rank's own is passed through, never pickled; the
    others are pickled once into buffers gloo sends as they are, their arrays out of band; a received blob stays
    while any array of it does (they are views of it, not copies), so it goes once its last piece is written.
    """
    own = outgoing[comm.rank]
    error: str | None = None
    try:
        blobs: list[Blob] = [b"" if r == comm.rank or failed else dumps_buffer(o) for r, o in enumerate(outgoing)]
    except Exception as exc:  # noqa: BLE001
        error = f"rank {comm.rank}: routing failed: {exc!r}"
        blobs = [b""] * comm.world
    outgoing.clear()
    try:
        received = comm.exchange(blobs)
    except ExchangeSkipped as exc:  # every rank took part in deciding it: the group is fine, the snapshot is not
        error = error or f"rank {comm.rank}: routing failed: {exc}"
        received = [b""] * comm.world
    del blobs
    incoming: list[Any] = []
    for r in range(comm.world):
        try:
            if r != comm.rank and not _nbytes(received[r]):
                raise RuntimeError(f"rank {r} sent nothing (its own part failed)")
            incoming.append(own if r == comm.rank else loads_buffer(received[r]))
        except Exception as exc:  # noqa: BLE001
            error = error or f"rank {comm.rank}: routing failed: {exc!r}"
            incoming.append(None)
        received[r] = b""
    return incoming, error


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


_ALIGN = 64  # each array's bytes start at a multiple of this in a blob, as a fresh allocation's would


def dumps_buffer(obj: Any) -> memoryview:
    """``obj`` pickled into a writable buffer, which :meth:`GlooComm.exchange` sends without copying it.

    Arrays travel out of band (pickle protocol 5) and are copied in by numpy, which releases the GIL: pickled in
    band into a growing BytesIO, a full snapshot's pieces held the GIL ~0.5 s per 128 MB, stalling the trainer.
    Layout: the pickle's length and the arrays' count and lengths (8-byte little-endian each), the pickle, then
    each array at the next multiple of 64 bytes."""
    raws: list[memoryview] = []
    meta = pickle.dumps(obj, protocol=5, buffer_callback=lambda b: raws.append(b.raw()))
    head = struct.pack(f"<QQ{len(raws)}Q", len(meta), len(raws), *(r.nbytes for r in raws))
    places, pos = [], len(head) + len(meta)
    for r in raws:
        pos = -(-pos // _ALIGN) * _ALIGN
        places.append(pos)
        pos += r.nbytes
    out = empty_bytes(pos)
    out[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[len(head):len(head) + len(meta)] = np.frombuffer(meta, dtype=np.uint8)
    for r, at in zip(raws, places):
        out[at:at + r.nbytes] = np.frombuffer(r, dtype=np.uint8)
    return memoryview(out)


def loads(blob: Blob) -> Any:
    # Blobs come from the other ranks of the same job over the side group, never from storage.
    return pickle.loads(blob) if _nbytes(blob) else None


def loads_buffer(blob: Blob) -> Any:
    """The object :func:`dumps_buffer` made; its arrays are views of ``blob`` (no copy, so no GIL held for it).
    Blobs come from the other ranks of the same job over the side group, never from storage."""
    if not _nbytes(blob):
        return None
    data = np.frombuffer(blob, dtype=np.uint8)
    n_meta, n_raw = struct.unpack_from("<QQ", data, 0)
    sizes = struct.unpack_from(f"<{n_raw}Q", data, 16)
    pos = 16 + 8 * n_raw + n_meta
    meta, buffers = data[pos - n_meta:pos], []
    for n in sizes:
        pos = -(-pos // _ALIGN) * _ALIGN
        buffers.append(data[pos:pos + n])
        pos += n
    if pos > data.size:
        raise ValueError(f"a routed blob of {data.size} bytes is cut short (its header says {pos})")
    return pickle.loads(meta, buffers=buffers)


def _nbytes(blob: Blob) -> int:
    return memoryview(blob).nbytes


def _as_tensor(blob: Blob) -> Any:
    """A uint8 tensor over ``blob``'s bytes: shared when the buffer is writable, else a copy (torch refuses to
    share read-only memory, e.g. ``bytes``)."""
    import torch

    view = memoryview(blob)
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view.cast("B"), dtype=torch.uint8)


def agree_on_start(ctrl: Comm, problem: BaseException | None, value: Any,
                   shared: dict[str, Any] | None = None) -> Any:
    """Collective at construction: rank 0's ``value`` on every rank, or, where any rank's set-up failed
    (``problem``) or its ``shared`` settings differ from rank 0's, an error on every rank: a failed rank raises its
    own, the others a RuntimeError naming it.

    Why: a rank that raised alone (rank 0 with an unreadable ``hf_config_dir``, a node without s3fs or without
    the API key in its environment) would leave the others training into the first publish's collective, where
    they wait out the side group's timeout instead of failing at start. And settings read per node (``HOTLOAD_*``
    variables) can differ: a rank with another codec had its pieces written under the owner's codec name, a
    committed delta no reader could decode.
    """
    gathered = ctrl.gather((None if problem is None else f"{type(problem).__name__}: {problem}", shared))
    verdict: Any = None
    if gathered is not None:
        ref = gathered[0][1]
        failed = [(r, text) for r, (text, _) in enumerate(gathered) if text is not None]
        for r, (text, theirs) in enumerate(gathered):
            if ref is None or theirs is None:  # a rank that failed has nothing to compare: its error is told
                continue
            differ = [k for k in sorted(set(ref) | set(theirs)) if theirs.get(k) != ref.get(k)]
            if differ:
                failed.append((r, "its settings differ from rank 0's: " + "; ".join(
                    f"{k} (rank {r}: {theirs.get(k)!r}, rank 0: {ref.get(k)!r})" for k in differ)))
        verdict = ("failed", sorted(failed)) if failed else ("ok", value)
    kind, agreed = ctrl.broadcast(verdict)
    if problem is not None:
        raise problem
    if kind == "failed":
        rank, first = agreed[0]
        more = f" (and {len(agreed) - 1} other rank(s))" if len(agreed) > 1 else ""
        raise RuntimeError(f"hotload could not start: rank {rank}{more} failed to set up: {first}")
    return agreed
