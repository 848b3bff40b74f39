"""Folder-level diff / apply / verify / inspect over local snapshot folders or single safetensors files.

A snapshot folder is a Hugging Face layout: ``model.safetensors.index.json`` plus the ``*.safetensors`` files it
names (a folder without an index is read as every ``*.safetensors`` file in it), and non-weight files (config,
tokenizer, manifests) that are carried over unchanged. These functions back the ``hotload`` CLI and the
emulator's replicas; they read local paths only.

Example::

    diff_paths("snap_a", "snap_b", "delta_b", codec="arc_v2")      # parent identity defaults to "snap_a"
    report = verify_paths("snap_a", "delta_b")
    assert report.ok
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .container import apply_delta_file, encode_delta_file, is_delta_file, read_delta_info
from .dtypes import RawTensor, itemsize, numel
from .errors import ArcError, FormatError
from .stio import load_file, parse_header, parse_json, write_file
from .vendor import vendor_encoder

INDEX = "model.safetensors.index.json"
Progress = Callable[[int, int, str], None]


def weight_files(folder: str) -> list[str]:
    """The weight file names of a snapshot folder, from its index if it has one."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index, "rb") as f:
            doc = parse_json(f.read(), "index", file=index)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise FormatError("bad index: no weight_map object", file=index)
        for n in wm.values():
            if not isinstance(n, str) or "/" in n or n.startswith("."):
                raise FormatError(f"unsafe file name {n!r} in weight_map", file=index)
        return sorted(set(wm.values()))
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _pairs(a: str, b: str) -> Iterator[tuple[str, str, str]]:
    """(name, path in a, path in b) for each weight file; a and b are both files or both folders."""
    if os.path.isdir(a) != os.path.isdir(b):
        raise FormatError(f"{a!r} and {b!r} must both be files or both be folders")
    if not os.path.isdir(a):
        yield os.path.basename(b), a, b
        return
    names_b = weight_files(b)
    for n in names_b:
        yield n, os.path.join(a, n), os.path.join(b, n)


def _copy_aux(src: str, dst: str) -> None:
    for n in sorted(os.listdir(src)):
        p = os.path.join(src, n)
        if os.path.isfile(p) and not n.endswith(".safetensors"):
            shutil.copyfile(p, os.path.join(dst, n))


def diff_paths(parent: str, new: str, out: str, *, codec: str = "arc_v2", parent_identity: str | None = None,
               progress: Progress | None = None, vendor_module: str | None = None) -> int:
    """Write the delta of ``new`` against ``parent`` to ``out`` (file or folder); returns bytes written.

    With ``vendor_module``, each weight file is encoded by that module's ``delta_compress_files_to_file``
    (see vendor.py) instead of our encoder.
    """
    ident = parent_identity or os.path.basename(os.path.normpath(parent))
    vendor = vendor_encoder(vendor_module) if vendor_module else None
    pairs = list(_pairs(parent, new))
    if os.path.isdir(new):
        os.makedirs(out, exist_ok=True)
        _copy_aux(new, out)
    total = 0
    for i, (name, pa, pb) in enumerate(pairs):
        dst = os.path.join(out, name) if os.path.isdir(new) else out
        if vendor is not None:
            vendor(pa, pb, dst)
        else:
            blob = encode_delta_file(load_file(_read(pa), filename=pa), load_file(_read(pb), filename=pb),
                                     parent_identity=ident, codec=codec)
            with open(dst, "wb") as f:
                f.write(blob)
        total += os.path.getsize(dst)
        if progress:
            progress(i + 1, len(pairs), name)
    return total


def apply_paths(parent: str, delta: str, out: str | None, *, expected_parent: str | None = None,
                progress: Progress | None = None) -> dict[str, dict[str, RawTensor]]:
    """Rebuild ``delta`` on ``parent``; write the full snapshot to ``out`` unless it is None (verify only)."""
    pairs = list(_pairs(parent, delta))
    if out is not None and os.path.isdir(delta):
        os.makedirs(out, exist_ok=True)
        _copy_aux(delta, out)
    result: dict[str, dict[str, RawTensor]] = {}
    for i, (name, pa, pd) in enumerate(pairs):
        parent_blob = _read(pa)
        rebuilt = apply_delta_file(load_file(parent_blob, filename=pa), _read(pd), filename=pd,
                                   expected_parent=expected_parent)
        result[name] = rebuilt
        if out is not None:
            dst = os.path.join(out, name) if os.path.isdir(delta) else out
            with open(dst + ".tmp", "wb") as f:
                write_file(f, rebuilt, parse_header(parent_blob, filename=pa).metadata)
            os.replace(dst + ".tmp", dst)
        if progress:
            progress(i + 1, len(pairs), name)
    return result


@dataclass
class TensorRow:
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    stored: int  # bytes on disk for this tensor
    raw: int  # bytes of the tensor itself
    status: str = ""

    @property
    def ratio(self) -> float:
        return self.raw / self.stored if self.stored else float("inf")


@dataclass
class Report:
    kind: str  # "full" | "delta"
    parent: str | None
    rows: list[TensorRow] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def inspect_path(path: str) -> Report:
    """Kind, parent, codecs and per-tensor sizes of a delta or full file/folder (headers only)."""
    files = [(os.path.basename(path), path)] if not os.path.isdir(path) else [
        (n, os.path.join(path, n)) for n in weight_files(path)]
    report: Report | None = None
    for name, p in files:
        data = _read(p)
        if is_delta_file(data):
            info = read_delta_info(data, filename=p)
            report = report or Report("delta", info.parent_identity)
            for t in info.tensors.values():
                report.rows.append(TensorRow(name, t.name, t.dtype, t.shape, t.codec,
                                             info.header.entries[t.name].nbytes, itemsize(t.dtype) * numel(t.shape)))
        else:
            header = parse_header(data, filename=p)
            report = report or Report("full", None)
            for e in header.entries.values():
                report.rows.append(TensorRow(name, e.name, e.dtype, e.shape, "raw", e.nbytes, e.nbytes))
    return report or Report("full", None)


def verify_paths(parent: str, delta: str, *, expected_parent: str | None = None,
                 progress: Progress | None = None) -> Report:
    """Rebuild in memory and check every checksum; failures are collected per file, not raised."""
    report = inspect_path(delta)
    by_file: dict[str, list[TensorRow]] = {}
    for r in report.rows:
        by_file.setdefault(r.file, []).append(r)
    pairs = list(_pairs(parent, delta))
    for i, (name, pa, pd) in enumerate(pairs):
        bad: str | None = None
        try:
            apply_delta_file(load_file(_read(pa), filename=pa), _read(pd), filename=pd,
                             expected_parent=expected_parent)
        except ArcError as exc:
            report.errors.append(str(exc))
            bad = exc.tensor or ""
        for r in by_file.get(name, []):
            # Tensors are rebuilt in order and the first failure stops the file: name the culprit precisely.
            r.status = "ok" if bad is None else ("BAD" if r.name == bad or not bad else "unverified")
        if progress:
            progress(i + 1, len(pairs), name)
    return report
