"""Base tensors the trainer does not hold, carried unchanged into every snapshot (``carry_base_tensors``).

Why: the service checks a full snapshot's tensors against its base model, and some checkpoints hold tensors that
no trainer builds. DeepSeek-V3's multi-token-prediction layer (``model.layers.61.*``, ~14 B parameters) is in its
checkpoint, while transformers' model class and the usual RL trainers leave it out; every full snapshot without it
is refused. Rank 0 reads such tensors from the base checkpoint's files in ``hf_config_dir`` and sends them to the
ranks that write their files: a full snapshot gets their bytes as the checkpoint stores them, a delta an unchanged
entry (a few bytes per tensor) whose Adler-32 is that of the bytes the last accepted full snapshot carried.

The files are memory-mapped, read-only: a full snapshot pulls their pages through the page cache, which the kernel
can reclaim, instead of holding a private copy. A base file replaced while training (a new download) fails the
next full snapshot with an error naming it, rather than carrying bytes the fleet's chain was not built from.

Example::

    found = find_carried("/models/dsv3", ["model.layers.61.*"], published={"model.embed_tokens.weight", ...})
    carrier = Carrier(found, get_codec("arc_v2"))
    pieces = list(carrier.pieces("full"))      # (name, "flat", (0,), (numel,), bytes, parts) per tensor
"""
from __future__ import annotations

import fnmatch
import json
import logging
import mmap
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ..arc.adler import segment_parts
from ..arc.codecs import Codec, ElementDiff
from ..arc.dtypes import UINT_BY_SIZE, itemsize, numel
from ..arc.errors import FormatError
from ..arc.stio import MAX_HEADER_BYTES, parse_header
from .assemble import RawPiece

log = logging.getLogger("fsdp_hotload")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_QUANTIZED = ("F8", "I8", "U8", "F4", "F6")


@dataclass(frozen=True)
class CarriedTensor:
    """One base tensor to carry: where its bytes are, and the file's size and mtime when they were found.

    Example::

        t = find_carried(folder, ["mtp.*"], published=set())[0]
        data = t.read()                      # read-only uint8 array of t.nbytes bytes
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code, as the checkpoint stores it (never cast: the fleet's base holds these bytes)
    file: str
    offset: int  # of the tensor's first byte in ``file``
    nbytes: int
    stamp: tuple[int, int]  # (size, mtime_ns) of ``file`` when found

    def read(self) -> np.ndarray:
        """The tensor's bytes, mapped from its file (read-only). Raises RuntimeError naming the file when it is not
        the file that was found at start (replaced or rewritten since)."""
        with open(self.file, "rb") as fh:
            st = os.fstat(fh.fileno())
            if (st.st_size, st.st_mtime_ns) != self.stamp:
                raise RuntimeError(f"carry_base_tensors: {self.file} changed since the publisher started (size or "
                                   f"modification time), so {self.name!r} may no longer hold the base model's bytes; "
                                   "restore it, or restart training to carry the new file")
            if self.nbytes == 0:
                return np.empty(0, dtype=np.uint8)
            start = self.offset - self.offset % mmap.ALLOCATIONGRANULARITY  # mmap offsets are page-aligned
            mapped = mmap.mmap(fh.fileno(), self.offset + self.nbytes - start, access=mmap.ACCESS_READ, offset=start)
        return np.frombuffer(mapped, dtype=np.uint8, count=self.nbytes, offset=self.offset - start)


def find_carried(hf_config_dir: str, patterns: Sequence[str], published: Iterable[str]) -> list[CarriedTensor]:
    """The base tensors in ``hf_config_dir`` that match any glob of ``patterns`` and are not ``published``, in the
    checkpoint's order. Only headers are read.

    Raises ValueError naming ``carry_base_tensors`` when a glob matches no base tensor (a typo would otherwise
    publish snapshots the fleet refuses), or the folder or a file needed holds no readable weights (a Git LFS
    pointer, a truncated download)."""
    names, files = _base_layout(hf_config_dir)
    published = set(published)
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            missing = [n for n in names if n not in published][:3]
            hint = f"; base tensors not published: {', '.join(map(repr, missing))}" if missing else \
                "; every base tensor is published already"
            raise ValueError(f"carry_base_tensors: {pattern!r} matches no tensor of the base checkpoint in "
                             f"{hf_config_dir}{hint}")
    wanted = [n for n in names if n not in published and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    headers: dict[str, tuple[Any, tuple[int, int]]] = {}
    out = []
    for name in wanted:
        path = os.path.join(hf_config_dir, files[name])
        if path not in headers:
            headers[path] = _read_header(path)
        header, stamp = headers[path]
        entry = header.entries.get(name)
        if entry is None:
            raise ValueError(f"carry_base_tensors: {path} does not hold {name!r}, which {INDEX} maps to it")
        out.append(CarriedTensor(name, tuple(entry.shape), entry.dtype, path, header.data_start + entry.begin,
                                 entry.nbytes, stamp))
    if out:
        size = sum(t.nbytes for t in out)
        log.info("hotload: carrying %d base tensor(s) the trainer does not hold (%.3g GB, e.g. %r) from %s into "
                 "every snapshot (carry_base_tensors)", len(out), size / 1e9, out[0].name, hf_config_dir)
        narrow = sorted({t.dtype for t in out if t.dtype.startswith(_QUANTIZED)})
        if narrow:
            log.warning("hotload: carried base tensors are %s as the checkpoint stores them, beside the trainer's "
                        "tensors: if the base is quantized (a quantization_config, scales), point hf_config_dir "
                        "at a bf16 copy of it so that every snapshot is one dtype", "/".join(narrow))
    else:
        log.info("hotload: carry_base_tensors matches only tensors the trainer publishes: nothing to carry")
    return out


def _base_layout(folder: str) -> tuple[list[str], dict[str, str]]:
    """The base tensors' names in order, and each one's file (relative to ``folder``)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, "rb") as fh:
                weight_map = json.loads(fh.read()).get("weight_map")
        except (OSError, ValueError, AttributeError, RecursionError) as exc:
            raise ValueError(f"carry_base_tensors: cannot read {index}: {exc}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"carry_base_tensors: {index} has no weight_map of tensor names to file names")
        return list(weight_map), dict(weight_map)
    single = os.path.join(folder, SINGLE)
    if not os.path.isfile(single):
        raise ValueError(f"carry_base_tensors: {folder} holds no base weights ({INDEX} or {SINGLE}) to carry "
                         "tensors from: point hf_config_dir at the base model's folder with its weights")
    header, _stamp = _read_header(single)
    return list(header.entries), dict.fromkeys(header.entries, SINGLE)


def _read_header(path: str) -> tuple[Any, tuple[int, int]]:
    """A base file's checked header (its data section must be whole) and (size, mtime_ns)."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            head = fh.read(8)
            if head.startswith(b"version "):  # "version https://git-lfs.github.com/spec/v1"
                raise ValueError(f"carry_base_tensors: {path} is a Git LFS pointer, not the weights (git lfs pull)")
            size = int.from_bytes(head, "little") if len(head) == 8 else 0
            header = parse_header(head + fh.read(min(size, MAX_HEADER_BYTES)), filename=path, total_size=st.st_size)
    except OSError as exc:
        raise ValueError(f"carry_base_tensors: cannot read {path}: {exc}") from None
    except FormatError as exc:
        raise ValueError(f"carry_base_tensors: {path} cannot be read as a whole safetensors file: {exc}") from None
    return header, (st.st_size, st.st_mtime_ns)


class Carrier:
    """Rank 0's pieces of the carried tensors, per snapshot: the engine side of ``carry_base_tensors``.

    Example::

        carrier = Carrier(find_carried(folder, ["model.layers.61.*"], published), codec)
        outgoing = list(carrier.pieces("full"))      # then carrier.accepted("full") once the fleet took it
    """

    def __init__(self, tensors: Sequence[CarriedTensor], codec: Codec) -> None:
        self.tensors = list(tensors)
        self._codec = codec
        self._frames: dict[str, bytes] = {}  # each tensor's unchanged payload: the same in every delta
        self._parts: dict[str, tuple[int, int]] = {}  # Adler-32 shares of what the last accepted full carried
        self._pending: dict[str, tuple[int, int]] = {}  # ... and of what the full in flight carries

    def pieces(self, kind: str) -> Iterator[RawPiece]:
        """One whole-tensor piece per carried tensor, as the publisher routes them (see ``assemble.Piece``)."""
        if kind == "full":
            self._pending = {}
        for t in self.tensors:
            box = ((0,), (numel(t.shape),))
            if kind == "full":
                data = t.read()
                self._pending[t.name] = segment_parts(data, 0, t.nbytes) if t.nbytes else (0, 0)
                yield (t.name, "flat", *box, data, (0, 0))
                continue
            parts = self._parts.get(t.name)
            if parts is None:  # a delta always follows an accepted full of this publisher
                raise RuntimeError(f"carried tensor {t.name!r}: a delta before any accepted full snapshot")
            frame = self._frames.get(t.name)
            if frame is None:
                size = itemsize(t.dtype)
                none = np.empty(0, dtype=UINT_BY_SIZE[size])
                frame = self._codec.encode(ElementDiff(numel(t.shape), size, np.empty(0, np.int64), none, none))
                self._frames[t.name] = frame
            yield (t.name, "flat", *box, frame, parts)

    def accepted(self, kind: str) -> None:
        """The snapshot just published was accepted: a full one's carried bytes are what later deltas refer to."""
        if kind == "full":
            self._parts, self._pending = self._pending, {}

    @property
    def elements(self) -> int:
        return sum(numel(t.shape) for t in self.tensors)


def agree_on_carried(ctrl: Any, patterns: Sequence[str], hf_config_dir: str | None, published: Iterable[str]
                     ) -> tuple[list[CarriedTensor], Exception | None]:
    """Rank 0's carried tensors, on every rank (their specs join every rank's shard plan), and rank 0's error
    reading them (the caller fails its set-up with it; the other ranks then learn of it there). With several ranks
    it broadcasts on ``ctrl`` always, carrying or not, so that no rank's setting can leave a peer waiting."""
    found: list[CarriedTensor] = []
    problem: Exception | None = None
    if ctrl.rank == 0 and patterns:
        try:
            assert hf_config_dir is not None  # the config requires it
            found = find_carried(hf_config_dir, patterns, published)
        except Exception as exc:  # noqa: BLE001 - raised by the caller's set-up, which every rank agrees on
            problem = exc
    if ctrl.world > 1:
        found = ctrl.broadcast(found)
    return found, problem
