"""Publishing from in-memory tensors in one process, for trainers that gather their weights themselves.

This is the engine with one rank and one whole-tensor chunk per tensor: the same cadence (full first, every N,
after any failure), storage, manifests, commit marker and signalling as the FSDP callback.

Example::

    cfg = HotloadConfig(bucket_url="s3://bucket/prefix", hotload_api_url="https://api.fireworks.ai",
                        account_id="acct", model_id="m", deployment_id="d", hf_config_dir="/models/m",
                        full_every=10)
    with TensorPublisher(model.state_dict(), cfg) as pub:
        for step in range(100):
            train_step()
            pub.publish(step, model.state_dict())   # returns at once; uploads run in the background
"""
from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .arc.boxes import Box
from .config import HotloadConfig
from .dtype_policy import DtypePolicy
from .engine.metrics import PublishMetrics
from .engine.publisher import Publisher
from .hf_config import base_tensors, hf_tie_word_embeddings, names_note, narrowed_note, shapes_note
from .layout import TensorSpec
from .naming import is_tied_output

log = logging.getLogger("fsdp_hotload")


@dataclass(frozen=True)
class WholeChunk:
    name: str
    shape: tuple[int, ...]
    dtype: str
    space: str
    box: Box
    source: torch.Tensor


def _place(value: Any) -> tuple[Any, ...]:
    """Where a tensor or array's elements are and how they are read: its first element's address, strides, device,
    shape and dtype. While that memory is held, an equal place is the same tensor. Why the shape and dtype too: a
    view trimmed in place (``p.data = p.data[:6]``, ``t.resize_(6, 4)``) or reinterpreted (``p.data =
    p.data.view(torch.int32)``) keeps its address and strides, and was published in its old shape or dtype."""
    if isinstance(value, torch.Tensor):
        return int(value.data_ptr()), tuple(value.stride()), value.device, tuple(value.shape), value.dtype
    return int(value.__array_interface__["data"][0]), tuple(value.strides), "numpy", value.shape, value.dtype


def _copy_reason(value: np.ndarray) -> str | None:
    """Why ``torch.from_numpy`` cannot view ``value`` in place (it is then copied), or None where it can: a
    transposed (Fortran-order) or sliced array is viewed as it is, and the stager reads it in place."""
    if not value.dtype.isnative:
        return "not in the machine's byte order"
    if any(st < 0 for st in value.strides):
        return "negative strides"
    if value.itemsize and any(st % value.itemsize for st in value.strides):
        return "strides that are not a multiple of the element size (a field of a structured array)"
    return None


def _as_torch(name: str, value: Any) -> torch.Tensor:
    """``value`` as a torch tensor of its shape: a view of its memory, except for an array numpy must copy (see
    :func:`_copy_reason`). Sparse and nested tensors are refused here, naming the tensor: their values are not one
    strided block, and torch's own error ("Cannot access data pointer ...") named none."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_nested:
            kind = "a nested tensor" if value.is_nested else f"of layout {value.layout}"
            raise TypeError(f"tensor {name!r} is {kind}: give a dense tensor (.to_dense(), or one tensor per "
                            "component)")
        _check_held(name, value)
        return value.detach()
    if isinstance(value, np.ndarray):
        try:
            if _copy_reason(value) is None:
                if value.flags.writeable:
                    return torch.from_numpy(value)
                with warnings.catch_warnings():  # the array is only read (staged), never written through the view
                    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                    return torch.from_numpy(value)
            # reshaped: np.ascontiguousarray makes a 0-d array 1-d; a big-endian array (read from a file, say)
            # is copied as its values, in the machine's byte order
            native = value.dtype.newbyteorder("=")
            return torch.from_numpy(np.ascontiguousarray(value, dtype=native)).reshape(value.shape)
        except TypeError as exc:  # a dtype torch has no counterpart for (object, str, complex256, ...)
            raise TypeError(f"tensor {name!r}: {exc}") from None
    raise TypeError(f"tensor {name!r}: expected a torch tensor or numpy array, got {type(value).__name__}")


def _check_held(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor whose storage does not hold the elements it spans, naming it. Why: a parameter whose memory
    was freed (FSDP's unsharded views after the forward pass, ``untyped_storage().resize_(0)``) kept its shape, and
    the staging copy failed naming no tensor, or read address 0 and crashed the process (a copy without a cast)."""
    if not t.numel() or t.device.type == "meta":  # a meta tensor is refused by its device, with its own advice
        return
    span = t.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    need, have = span * t.element_size(), t.untyped_storage().nbytes()
    if have < need:
        raise ValueError(f"tensor {name!r} has no memory behind it: its storage holds {have} bytes of the {need} its "
                         "elements span (a parameter whose memory was freed, as FSDP frees its unsharded views): "
                         "give the tensor where its values are held (a gathered state dict)")


def _tied_duplicates(tensors: Mapping[str, Any], hf_config_dir: str | None) -> dict[str, str]:
    """The ``lm_head.weight`` entries (prefixed ones too) that are another entry's memory, each with that entry's
    name, unless ``hf_config_dir``'s config.json says ``tie_word_embeddings`` false. Why: ``state_dict()`` lists
    a tied tensor under both names, while ``save_pretrained`` (so the fleet's base model) holds it once, under the
    embedding's name; a snapshot naming it twice is refused on every publish. The callback leaves it out alike."""
    def place(value: Any) -> tuple[Any, ...] | None:
        if isinstance(value, torch.Tensor) and not (value.layout != torch.strided or value.is_nested
                                                    or value.device.type == "meta" or not value.numel()):
            return _place(value)
        return _place(value) if isinstance(value, np.ndarray) and value.size else None

    heads = [n for n in tensors if is_tied_output(n) and place(tensors[n]) is not None]
    if not heads:
        return {}
    by_place: dict[tuple[Any, ...], str] = {}
    for name, value in tensors.items():
        if not is_tied_output(name) and (where := place(value)) is not None:
            by_place.setdefault(where, name)
    shared = {n: by_place[where] for n in heads if (where := place(tensors[n])) in by_place}
    if shared and hf_tie_word_embeddings(hf_config_dir) is False:
        return {}
    return shared


def _warn_if_on_every_rank(engine_kwargs: Mapping[str, Any]) -> None:
    """A script run by torchrun builds one TensorPublisher per rank unless told otherwise: each publishes its own
    chain of snapshots, and with signalling their signals overwrite each other's on the deployment. Told on the
    ranks other than 0, so that a publisher built on rank 0 alone (the documented use) stays quiet."""
    dist = torch.distributed
    if "comm" in engine_kwargs or not (dist.is_available() and dist.is_initialized()):
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        log.warning("hotload: a TensorPublisher on rank %d of %d publishes its own snapshots, apart from rank 0's: "
                    "build it on one rank only (rank 0, from the gathered state dict), or use HotloadCallback for "
                    "a sharded model", rank, world)


def _warn_against_base(specs: Sequence[TensorSpec], hf_config_dir: str | None) -> None:
    """Said once at start: names the base checkpoint lacks (a tied ``lm_head.weight``, a ``_orig_mod.`` prefix
    from ``torch.compile``), other shapes, and tensors published narrower than it stores them. Why: the caller's
    names are published as given, and the fleet refuses such snapshots on every publish, or serves them rounded."""
    base, dtypes = base_tensors(hf_config_dir)
    if base is None:
        return
    notes = [names_note((s.name for s in specs), base),
             shapes_note(((s.name, s.shape) for s in specs), base, where="the base checkpoint in hf_config_dir"),
             narrowed_note(((s.name, s.dtype) for s in specs), dtypes)]
    for note in notes:
        if note:
            log.warning("hotload: %s", note)


class TensorPublisher:
    """Publishes a fixed set of named tensors (same names, shapes and dtypes at every step).

    ``publish(step)`` reads the tensors given at construction (views of a model's parameters, say), and
    ``publish(step, tensors)`` the ones given (a state dict gathered at each step). The first publish given other
    tensors than those lets go of the construction tensors, so that a gathered first state dict is not kept alive
    beside every later one: from then on, every publish must be given its tensors.

    Example::

        with TensorPublisher(state_dict, cfg) as pub:      # the names, shapes and dtypes of every publish
            pub.publish(step, gathered_state_dict)         # returns once staged; uploads run in the background
    """

    def __init__(self, tensors: Mapping[str, Any], config: HotloadConfig, **engine_kwargs: Any) -> None:
        config = config.checked()  # see HotloadConfig.checked
        self.names = list(tensors)
        bad = [n for n in self.names if not isinstance(n, str) or not n]
        if bad:  # before any name is split (the dtype policy, the layout)
            raise ValueError(f"tensor names must be non-empty strings, got {bad[0]!r}")
        # A tied lm_head is left out, as save_pretrained leaves it out; later publishes may give it or not.
        self._tied = _tied_duplicates(tensors, config.hf_config_dir)
        if self._tied:
            log.info("hotload: tied weights are left out of the snapshots, as save_pretrained leaves them out (the "
                     "fleet ties them to the embedding; no config.json in hf_config_dir says tie_word_embeddings "
                     "false): %s", "; ".join(f"{h!r} is the memory of {e!r}" for h, e in self._tied.items()))
            self.names = [n for n in self.names if n not in self._tied]
        chunks = []
        copied = []
        policy = DtypePolicy.of(config.snapshot_dtype, config.dtype_overrides)
        for name in self.names:
            # In its own shape: the stager copies a strided view (a transposed matrix) into its slot in C order in
            # one copy, where flattening it first made a copy, kept as the chunk's source for the publisher's life.
            t = _as_torch(name, tensors[name])
            if t.numel() and t.data_ptr() != _place(tensors[name])[0]:
                copied.append(name)  # an array numpy had to copy (see _copy_reason)
            box = Box.flat(0, t.numel())
            chunks.append(WholeChunk(name, tuple(t.shape), policy.code(name, t.dtype), "flat", box, t))
        # what every publish must give: a tensor on another device was refused by the stager after the engine took
        # its step, so the same step given again (the tensor moved) was refused as a repeat
        self._kinds = [(c.shape, c.source.dtype, c.source.device) for c in chunks]
        # The caller's tensors, read again by publish() without tensors: all of them at each publish where one was
        # copied (its chunk holds a copy frozen at construction), else only to follow a swapped storage.
        self._live: dict[str, Any] | None = {n: tensors[n] for n in self.names}
        self._reread = bool(copied)
        # Where the construction tensors are, to know them when given again: their memory stays held (by the stager's
        # views of it, or by _live) until both let go of it, and these with them.
        self._origin: list[tuple[Any, ...]] | None = [_place(tensors[n]) for n in self.names]
        self._given_from: int | None = None  # the step of the first publish given other tensors
        if copied:
            log.info("hotload: %d array(s) had to be copied (first: %r, which has %s); publish() without tensors "
                     "copies them again at each publishing step", len(copied), copied[0],
                     _copy_reason(tensors[copied[0]]))
        for note in policy.notes({c.name: c.source.dtype for c in chunks}):
            log.warning("hotload: %s", note)
        specs = [TensorSpec(c.name, c.shape, c.dtype) for c in chunks]
        comm = engine_kwargs.get("comm")
        if comm is not None and comm.world > 1:  # every rank's whole tensors would cover each tensor world times
            raise ValueError(f"TensorPublisher publishes whole tensors from one process, and comm= spans {comm.world} "
                             "ranks: build it on rank 0 alone from the gathered state dict, without comm= (or use "
                             "HotloadCallback, which publishes a sharded model from every rank)")
        _warn_if_on_every_rank(engine_kwargs)
        engine_kwargs.setdefault("owner", type(self).__name__)  # named in the engine's advice (a lower step)
        engine_kwargs.setdefault("retake_failed_steps", True)  # the caller names the steps: it may give one again
        self.engine = Publisher(chunks, specs, config, **engine_kwargs)
        del chunks  # the engine's stager holds the sources now, and lets go of them as they are replaced
        if self.engine.rank == 0:
            try:
                carried = [TensorSpec(t.name, t.shape, t.dtype) for t in self.engine.carried]
                _warn_against_base([*specs, *carried], config.hf_config_dir)
            except Exception as exc:  # noqa: BLE001 - advice only: it must not stop rank 0 alone
                log.warning("hotload: the start-up checks against the base checkpoint failed: %r", exc)

    def publish(self, step: int, tensors: Mapping[str, Any] | None = None) -> bool:
        """Stage ``tensors`` (or the ones given at construction) and publish them in the background.

        On CUDA the copy is ordered after the work queued so far on the current stream only: tensors written on
        another stream must be waited for first (``torch.cuda.current_stream().wait_stream(s)``)."""
        if self.engine.closed or self.engine._closing:  # first: after close() the construction tensors are let go
            raise RuntimeError(f"{type(self).__name__} is closed: create a new one to publish again")
        sources = self._sources(tensors)
        if sources is not None:
            started = self.engine.publish(step, sources)  # refused (a repeated step, another device): nothing let go
            if self._origin is not None:  # let go of the construction tensors (the stager's copy plans held them)
                self._origin, self._live, self._given_from = None, None, step
                self.engine.stager.forget_sources()
            return started
        if tensors is None and self._given_from is not None:
            raise ValueError(f"publish({step}) without tensors reads the tensors given at construction, which were "
                             f"let go when publish({self._given_from}) was given others: give every publish its "
                             "tensors")
        if self._reread:
            return self.engine.publish(step, self._read_live)  # called only on steps that publish; close too
        self._follow_swaps()
        return self.engine.publish(step)

    def _follow_swaps(self) -> None:
        """Read the construction tensors from where they are now. Why: a Parameter whose storage was replaced
        (``p.data = new``) is the same object in the caller's dict, while the stager still read the memory it let
        go of: every later publish served the old weights, with no error. Another shape or dtype
        (``model.bfloat16()``) is refused, naming the tensor. A new object on the module (``load_state_dict(sd,
        assign=True)``) is not in the dict, so it cannot be followed: the README says to pass the tensors then."""
        if self._live is None or self._origin is None:
            return
        places = [_place(self._live[n]) for n in self.names]
        if places == self._origin:
            return
        sources = self._checked(self._live)
        self.engine.fence()  # no copy may read the old sources while the stager lets go of them
        self.engine.stager.rebind(sources)
        self._origin = places

    def _read_live(self) -> list[torch.Tensor]:
        """The construction tensors' current values (copies for the arrays numpy must copy)."""
        assert self._live is not None
        return self._checked(self._live)

    def _sources(self, tensors: Mapping[str, Any] | None) -> list[torch.Tensor] | None:
        """``tensors`` as torch tensors in construction order, checked against the construction's shapes and dtypes;
        None when there are none, or they are the construction tensors themselves (the same places), which the
        engine reads (again at ``close``, to publish a skipped newest step)."""
        if tensors is None:
            return None
        given = self._checked(tensors)
        origin = self._origin  # None once a tensor is not where its construction one is
        if origin is not None and any(_place(tensors[n]) != o for n, o in zip(self.names, origin)):
            origin = None
        return None if origin is not None else given

    def _checked(self, tensors: Mapping[str, Any]) -> list[torch.Tensor]:
        """``tensors`` as torch tensors in construction order, with the construction's names, shapes, dtypes and
        devices: refused here, before the engine takes the step, so that the same step can be given again."""
        missing = [n for n in self.names if n not in tensors]
        if missing or len(tensors) != len(self.names) + sum(n in tensors for n in self._tied):
            raise KeyError(f"publish needs exactly the tensors given at construction; missing {missing[:5]}, "
                           f"unexpected {sorted(set(tensors) - set(self.names) - set(self._tied))[:5]}")
        given = []
        for name, (shape, dtype, device) in zip(self.names, self._kinds):
            t = _as_torch(name, tensors[name])
            # Same element count is not enough: a transposed matrix, or an int tensor given floats, would be published
            # under the construction's shape and dtype without an error.
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"tensor {name!r} is {t.dtype} {list(t.shape)}, and was {dtype} {list(shape)} at "
                                 "construction: give every publish the same shapes and dtypes")
            if t.device != device:
                raise ValueError(f"tensor {name!r} is on {t.device}, and was on {device} at construction: give "
                                 f"every publish its tensors on {device}")
            given.append(t)
        return given

    def wait(self, timeout: float | None = None) -> None:
        self.engine.wait(timeout)

    def close(self, tensors: Mapping[str, Any] | None = None, *, raise_errors: bool = True,
              timeout: float | None = None) -> None:
        """Wait for in-flight snapshots and stop. With ``config.publish_on_close``, a skipped newest step is
        published first: from ``tensors`` when given, else from the construction tensors if ``publish`` read
        those (otherwise it is left out, with a warning). ``timeout``: as for ``HotloadCallback.close``."""
        self._close(tensors, raise_errors, timeout, None)

    def _close(self, tensors: Mapping[str, Any] | None, raise_errors: bool, timeout: float | None,
               propagating: bool | None) -> None:
        try:
            sources = self._sources(tensors) if raise_errors else None
            newest_skipped = self.engine.latest_step > self.engine._last_staged
            # close() publishes the newest step from where the tensors are now; not on another thread (a watchdog),
            # where it publishes nothing more, and a rebind would race a publish() on the trainer's thread
            if (raise_errors and tensors is None and newest_skipped and not self._reread and self._given_from is None
                    and threading.get_ident() == self.engine._stepping_thread):
                self._follow_swaps()
        except Exception:
            self.engine.close(raise_errors=False, timeout=timeout)  # the threads still stop; the caller sees why
            raise
        try:
            self.engine.close(raise_errors=raise_errors, sources=sources, timeout=timeout, propagating=propagating)
        finally:  # the stager let go of its sources: so does this, for an owner that is still held
            self._origin, self._live = None, None

    @property
    def metrics(self) -> list[PublishMetrics]:
        return self.engine.metrics.records

    def __enter__(self) -> "TensorPublisher":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # never mask the exception already on its way out; a clean exit inside an except clause is clean
        self._close(None, exc_type is None, None, exc_type is not None)
