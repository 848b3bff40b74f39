"""Base tensors the trainer does not hold, carried unchanged into every snapshot (``carry_base_tensors``).

Why: the service checks a full snapshot's tensors against its base model, and some checkpoints hold tensors that
no trainer builds. DeepSeek-V3's multi-token-prediction layer (``model.layers.61.*``, ~14 B parameters) is in its
checkpoint, while transformers' model class and the usual RL trainers leave it out; every full snapshot without it
is refused. Rank 0 reads such tensors from the base checkpoint's files in ``hf_config_dir`` and writes every
snapshot file that holds one (:func:`~.assemble.assign_owners` gives it those files): a full snapshot gets their
bytes as the checkpoint stores them, a delta an unchanged entry (one zstd frame of zeros with ``arc_v2``, ~100
bytes per MB of tensor; 19 bytes with ``arc_sparse_v1``) whose Adler-32 is that of the bytes the last accepted full
snapshot carried.

A full snapshot reads each carried tensor only when its file is assembled (the piece's data is a function), with
plain reads straight into the tensor's place in the file's buffer: memory-mapping the files held a descriptor per tensor (~800 for DeepSeek-V3's
MTP layer, past the usual limit of 1024 open files) and turned a file truncated under a full into a SIGBUS. A base
file replaced or rewritten while training fails the next full snapshot with an error naming it, rather than
carrying bytes the fleet's chain was not built from.

Example::

    found = find_carried("/models/dsv3", ["model.layers.61.*"], published={"model.embed_tokens.weight": "BF16"})
    carrier = Carrier(found, get_codec("arc_v2"))
    pieces = list(carrier.pieces("full"))      # (name, "flat", (0,), (numel,), read, parts) per tensor
"""
from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from ..arc.adler import segment_parts
from ..arc.codecs import Codec, ElementDiff
from ..arc.container import FORMAT_NAME, K_FORMAT, K_PARENT
from ..arc.dtypes import UINT_BY_SIZE, itemsize, numel
from ..arc.errors import FormatError
from ..arc.stio import MAX_HEADER_BYTES, parse_header
from ..hf_config import QUANTIZATION_KEYS, is_quantized, weight_dtypes
from .assemble import RawPiece

log = logging.getLogger("fsdp_hotload")

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class CarriedTensor:
    """One base tensor to carry: where its bytes are, and the file's size and mtime when they were found.

    Example::

        t = find_carried(folder, ["mtp.*"], published={"model.norm.weight": "BF16"})[0]
        data = np.empty(t.nbytes, np.uint8)
        t.read_into(data)                     # the tensor's bytes, as the checkpoint stores them
    """

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code, as the checkpoint stores it (never cast: the fleet's base holds these bytes)
    file: str
    offset: int  # of the tensor's first byte in ``file``
    nbytes: int
    stamp: tuple[int, int]  # (size, mtime_ns) of ``file`` when found

    def check(self) -> None:
        """Raise RuntimeError (as :meth:`read_into`) if the file is not the one found at start."""
        try:
            self._check(os.stat(self.file))
        except OSError as exc:
            raise RuntimeError(f"carry_base_tensors: cannot read {self.name!r} from {self.file}: {exc}") from None

    def read_into(self, out: np.ndarray) -> None:
        """Read the tensor's bytes into ``out`` (flat uint8, ``nbytes`` long: its place in a snapshot file, so no
        other copy is held). Raises RuntimeError naming ``carry_base_tensors`` and the file when it cannot be read,
        or is not the file found at start (replaced or rewritten, before or while read)."""
        if out.dtype != np.uint8 or out.shape != (self.nbytes,):
            raise ValueError(f"carried tensor {self.name!r}: a {out.dtype}{list(out.shape)} buffer for {self.nbytes} "
                             "bytes")
        try:
            with open(self.file, "rb", buffering=0) as fh:
                self._check(os.fstat(fh.fileno()))
                fh.seek(self.offset)
                view, got = memoryview(out), 0
                while got < self.nbytes:
                    n = fh.readinto(view[got:])
                    if not n:
                        raise OSError(f"the file ends {self.nbytes - got} bytes before the tensor does")
                    got += n
                self._check(os.fstat(fh.fileno()))  # rewritten in place while it was read
        except OSError as exc:
            raise RuntimeError(f"carry_base_tensors: cannot read {self.name!r} from {self.file}: {exc}") from None

    def _check(self, st: os.stat_result) -> None:
        if (st.st_size, st.st_mtime_ns) != self.stamp:
            raise RuntimeError(f"carry_base_tensors: {self.file} changed since the publisher started (its size or "
                               f"modification time), so {self.name!r} may no longer hold the base model's bytes; "
                               "restart training to carry the file as it is now")


def find_carried(hf_config_dir: str, patterns: Sequence[str], published: Mapping[str, str]) -> list[CarriedTensor]:
    """The base tensors in ``hf_config_dir`` that match any glob of ``patterns`` and are not ``published`` (the
    trainer's tensors: name to dtype code), in the checkpoint's order. Only headers are read.

    Raises ValueError naming ``carry_base_tensors`` when a glob matches no base tensor (a typo would otherwise
    publish snapshots the fleet refuses), the folder or a file needed holds no readable weights (a Git LFS
    pointer, a truncated download), or the carried tensors are quantized where the trainer's are not (below)."""
    hf_config_dir = os.path.abspath(hf_config_dir)  # read again at every full: a later chdir must not matter
    names, files = _base_layout(hf_config_dir)
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
        _check_quantization(hf_config_dir, out, weight_dtypes(published.items()))
        size = sum(t.nbytes for t in out)
        log.info("hotload: carrying %d base tensor(s) the trainer does not hold (%.3g GB, e.g. %r) from %s into "
                 "every snapshot (carry_base_tensors)", len(out), size / 1e9, out[0].name, hf_config_dir)
    else:
        log.info("hotload: carry_base_tensors matches only tensors the trainer publishes: nothing to carry")
    return out


def _check_quantization(folder: str, carried: Sequence[CarriedTensor], published: Iterable[str]) -> None:
    """Quantized carried tensors beside a trainer's unquantized ones. Why an error where the base config has a
    ``quantization_config``: snapshots keep it while any tensor is quantized, so the carried tensors alone would
    keep it, and the server would read the trainer's bf16 tensors as quantized ones (without their scales)."""
    narrow = [t for t in carried if any(map(is_quantized, weight_dtypes([(t.name, t.dtype)])))]
    if not narrow or any(map(is_quantized, published)):
        return
    try:
        with open(os.path.join(folder, "config.json"), "rb") as fh:
            config = json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        config = None
    keys = [k for k in QUANTIZATION_KEYS if isinstance(config, dict) and k in config]
    if keys:
        raise ValueError(f"carry_base_tensors: {len(narrow)} carried tensor(s) are quantized (e.g. {narrow[0].name!r}: "
                         f"{narrow[0].dtype}), the trainer's tensors are not, and the base config.json "
                         f"has a {keys[0]}: the snapshots would keep it, and the server would read the trainer's "
                         "tensors as quantized; point hf_config_dir at an unquantized (bf16) copy of the base model")
    log.warning("hotload: %d carried base tensor(s) are %s as the checkpoint stores them (e.g. %r), beside the "
                "trainer's unquantized tensors", len(narrow), "/".join(sorted({t.dtype for t in narrow})),
                narrow[0].name)


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
        outside = [v for v in weight_map.values()
                   if os.path.isabs(v) or ".." in v.replace("\\", "/").split("/")]
        if outside:  # the bytes would be read from elsewhere on this machine and uploaded to the bucket
            raise ValueError(f"carry_base_tensors: {index} maps tensors to {outside[0]!r}, a file outside "
                             f"{folder}: weight_map names files relative to the folder")
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
    if header.metadata.get(K_FORMAT) == FORMAT_NAME:  # its entries are U8 payloads, not the tensors
        raise ValueError(f"carry_base_tensors: {path} is a hotload delta (made against "
                         f"{header.metadata.get(K_PARENT)!r}), not the base model's weights: point hf_config_dir at "
                         "the base model's folder, or at a full snapshot")
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
            # A changed file fails the full here, before any rank writes a file: found only at assembly, on rank 0's
            # upload threads, every other rank's files would be uploaded (and discarded) first, at every full.
            for t in {t.file: t for t in self.tensors}.values():
                t.check()
        for t in self.tensors:
            box = ((0,), (numel(t.shape),))
            if kind == "full":  # read into its file as that is assembled, on this rank (which writes it)
                yield (t.name, "flat", *box, functools.partial(self._read, t), (0, 0))
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

    def _read(self, t: CarriedTensor, out: np.ndarray) -> tuple[int, int]:
        """Read ``t`` into its place in the file; returns its Adler-32 shares (the file's checksum, and the next
        deltas' base)."""
        t.read_into(out)
        parts = self._pending[t.name] = segment_parts(out, 0, t.nbytes) if t.nbytes else (0, 0)
        return parts

    def accepted(self, kind: str) -> None:
        """The snapshot just published was accepted: a full one's carried bytes are what later deltas refer to."""
        if kind == "full":
            self._parts, self._pending = self._pending, {}

    @property
    def elements(self) -> int:
        return sum(numel(t.shape) for t in self.tensors)


def agree_on_carried(ctrl: Any, patterns: Sequence[str], hf_config_dir: str | None, published: Mapping[str, str]
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
