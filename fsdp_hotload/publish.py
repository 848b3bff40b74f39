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
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .arc.boxes import Box
from .config import HotloadConfig
from .dtype_policy import DtypePolicy
from .engine.metrics import PublishMetrics
from .engine.publisher import Publisher
from .hf_config import base_tensors, names_note, narrowed_note, shapes_note
from .layout import TensorSpec

log = logging.getLogger("fsdp_hotload")


@dataclass(frozen=True)
class WholeChunk:
    name: str
    shape: tuple[int, ...]
    dtype: str
    space: str
    box: Box
    source: torch.Tensor


def _flat_in_place(value: Any) -> bool:
    """Whether flattening ``value`` (as ``_as_torch(value).reshape(-1)``) gives a view of its memory, not a copy."""
    if isinstance(value, torch.Tensor):
        return value.is_contiguous()
    return bool(isinstance(value, np.ndarray) and value.flags.c_contiguous)


def _as_torch(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise TypeError(f"expected a torch tensor or numpy array, got {type(value).__name__}")


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

    Example::

        with TensorPublisher(state_dict, cfg) as pub:      # the names, shapes and dtypes of every publish
            pub.publish(step, gathered_state_dict)         # returns once staged; uploads run in the background
    """

    def __init__(self, tensors: Mapping[str, Any], config: HotloadConfig, **engine_kwargs: Any) -> None:
        self.names = list(tensors)
        self.chunks = []
        policy = DtypePolicy.of(config.snapshot_dtype, config.dtype_overrides)
        for name in self.names:
            t = _as_torch(tensors[name])
            n = t.numel()
            self.chunks.append(WholeChunk(name, tuple(t.shape), policy.code(name, t.dtype), "flat",
                                          Box.flat(0, n), t.reshape(-1)))
        # A non-contiguous tensor (a transposed or sliced view, a strided array) cannot be flattened in place: its
        # chunk holds a copy, frozen at construction. publish() without tensors then re-reads the caller's tensors.
        copied = [name for name in self.names if not _flat_in_place(tensors[name])]
        self._live: dict[str, Any] | None = {n: tensors[n] for n in self.names} if copied else None
        if copied:
            log.info("hotload: %d tensor(s) are not contiguous (first: %r); publish() without tensors copies them "
                     "again at each publishing step", len(copied), copied[0])
        for note in policy.notes({c.name: c.source.dtype for c in self.chunks}):
            log.warning("hotload: %s", note)
        specs = [TensorSpec(c.name, c.shape, c.dtype) for c in self.chunks]
        self.engine = Publisher(self.chunks, specs, config, **engine_kwargs)
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
        if tensors is None and self._live is not None:
            return self.engine.publish(step, self._read_live)  # called only on steps that publish; close reuses it
        return self.engine.publish(step, self._sources(tensors))

    def _read_live(self) -> list[torch.Tensor]:
        """The construction tensors' current values, flattened (copies for the non-contiguous ones)."""
        assert self._live is not None
        sources = self._sources(self._live)
        assert sources is not None  # a copied tensor never has its chunk's pointer
        return sources

    def _sources(self, tensors: Mapping[str, Any] | None) -> list[torch.Tensor] | None:
        """Flat views of ``tensors`` in construction order; None when they are the construction tensors
        themselves (the same memory), which ``close`` can then read again to publish a skipped newest step."""
        if tensors is None:
            return None
        missing = [n for n in self.names if n not in tensors]
        if missing or len(tensors) != len(self.names):
            raise KeyError(f"publish needs exactly the tensors given at construction; missing {missing[:5]}, "
                           f"unexpected {sorted(set(tensors) - set(self.names))[:5]}")
        sources = [_as_torch(tensors[n]).reshape(-1) for n in self.names]
        for c, s in zip(self.chunks, sources):
            if s.numel() != c.box.numel:
                raise ValueError(f"tensor {c.name!r} changed size: {s.numel()} elements, {c.box.numel} before")
        if all(s.data_ptr() == c.source.data_ptr() and s.stride() == c.source.stride() and s.dtype == c.source.dtype
               and s.device == c.source.device for c, s in zip(self.chunks, sources)):
            return None
        return sources

    def wait(self, timeout: float | None = None) -> None:
        self.engine.wait(timeout)

    def close(self, tensors: Mapping[str, Any] | None = None, *, raise_errors: bool = True,
              timeout: float | None = None) -> None:
        """Wait for in-flight snapshots and stop. With ``config.publish_on_close``, a skipped newest step is
        published first: from ``tensors`` when given, else from the construction tensors if ``publish`` read
        those (otherwise it is left out, with a warning). ``timeout``: as for ``HotloadCallback.close``."""
        try:
            sources = self._sources(tensors) if raise_errors else None
        except Exception:
            self.engine.close(raise_errors=False, timeout=timeout)  # the threads still stop; the caller sees why
            raise
        self.engine.close(raise_errors=raise_errors, sources=sources, timeout=timeout)

    @property
    def metrics(self) -> list[PublishMetrics]:
        return self.engine.metrics.records

    def __enter__(self) -> "TensorPublisher":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(raise_errors=exc_type is None)  # never mask the exception already on its way out
