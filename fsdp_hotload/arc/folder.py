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

import contextlib
import errno
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from .codecs import get_codec
from .container import K_TENSORS, apply_delta_file, encode_delta_file, is_delta_file, read_delta_info
from .dtypes import RawTensor, itemsize, numel
from .errors import ArcError, FormatError, MismatchError, VendorOutputError
from .stio import CHECKSUM_KEY, MAX_HEADER_BYTES, load_file, parse_header, parse_json, write_file
from .vendor import vendor_encoder

INDEX = "model.safetensors.index.json"
# retention.COMMIT_MARKER, spelled out so the byte-format package does not import the storage layer. The marker
# vouches for one snapshot's files, so it is never carried from an input folder into an output folder.
COMMIT_MARKER = "hotload.commit.json"
# storage_local.TMP_PREFIX, spelled out for the same reason: what a local write in progress (or killed) is named.
TMP_PREFIX = ".hotload-tmp-"
Progress = Callable[[int, int, str], None]


class UnusableInputError(ValueError):
    """The paths cannot be compared at all (a folder without weight files, a file paired with a folder, a delta
    where a full snapshot is needed): bad usage rather than a corrupt or mismatched snapshot, which is why it is
    not an ArcError and the CLI answers it with its usage exit code."""


def weight_files(folder: str) -> list[str]:
    """The weight file names of a snapshot folder, from its index if it has one."""
    mapped = index_files(folder)
    if mapped is not None:
        return sorted(mapped)
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def index_files(folder: str) -> dict[str, set[str]] | None:
    """The tensors the folder's index maps to each weight file; None without an index (or for a file)."""
    index = os.path.join(folder, INDEX)
    if not os.path.isdir(folder) or not os.path.exists(index):
        return None
    with open(index, "rb") as f:
        doc = parse_json(f.read(), "index", file=index)
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        raise FormatError("bad index: no weight_map object", file=index)
    out: dict[str, set[str]] = {}
    for tensor, n in wm.items():
        if not isinstance(n, str) or "/" in n or n.startswith("."):
            raise FormatError(f"unsafe file name {n!r} in weight_map", file=index)
        out.setdefault(n, set()).add(tensor)
    return out


def _check_mapped(mapped: dict[str, set[str]] | None, name: str, tensors: Iterable[str], path: str) -> None:
    """The index must name exactly the tensors the file holds. Why: apply and verify took the index for its list of
    files only, so an index one bit off (a tensor renamed, or mapped to another file) was copied into OUT, under a
    commit marker, naming tensors its shards do not hold."""
    if mapped is None:
        return
    want, got = mapped.get(name, set()), set(tensors)
    if want != got:
        raise MismatchError(f"{INDEX} maps {sorted(want - got)[:3]} to this file, which holds "
                            f"{sorted(got - want)[:3]} instead (a damaged index)", file=path)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _read_head(path: str) -> tuple[bytes, int]:
    """A safetensors file's length prefix and header, and the file's size: what inspect needs of a weight file,
    which may be gigabytes of tensor data."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) == 8:
            hlen = int.from_bytes(head, "little")
            if hlen <= MAX_HEADER_BYTES:  # a larger one is refused by parse_header, naming the file
                head += f.read(hlen)
    return head, size


def _required_weight_files(folder: str, role: str) -> list[str]:
    """weight_files(), where an empty set is an error: with no weight file there is nothing to rebuild or verify,
    and an empty folder must not pass as a verified snapshot."""
    names = weight_files(folder)
    if not names:
        temp = sorted(n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)) if os.path.isdir(folder) else []
        why = (f": it holds only {len(temp)} temporary file(s) ({', '.join(temp[:2])}{', ...' * (len(temp) > 2)}) of an upload that has not finished "
               "or was killed; a snapshot is complete once its hotload.commit.json is written" if temp else "")
        raise UnusableInputError(f"{role + ' ' if role else ''}folder {folder!r} has no weight files (no {INDEX} "
                                 f"naming any, and no *.safetensors file){why}")
    return names


def _pairs(a: str, b: str, roles: tuple[str, str]) -> list[tuple[str, str, str]]:
    """(name, path in a, path in b) for each weight file; a and b are both files or both folders.

    For folders the weight-file sets of both sides must be the same (each from its index when it has one): a
    delta folder missing a file must not verify, nor rebuild into a snapshot missing that file.
    """
    if os.path.isdir(a) != os.path.isdir(b):
        raise UnusableInputError(f"{roles[0]} {a!r} and {roles[1]} {b!r} must both be files or both be folders")
    if not os.path.isdir(a):
        return [(os.path.basename(b), a, b)]
    names_a, names_b = _required_weight_files(a, roles[0]), _required_weight_files(b, roles[1])
    if names_a != names_b:
        only_a, only_b = sorted(set(names_a) - set(names_b)), sorted(set(names_b) - set(names_a))
        raise MismatchError(f"weight files differ from {roles[0]} {a!r}: only in {roles[0]}: {only_a}, only in "
                            f"{roles[1]}: {only_b}", file=b)
    pairs = [(n, os.path.join(a, n), os.path.join(b, n)) for n in names_b]
    for _, pa, pb in pairs:
        for path in (pa, pb):
            if not os.path.isfile(path):  # checked up front, so nothing is written for a partial folder
                raise FileNotFoundError(errno.ENOENT, "weight file named by the folder's index is missing", path)
    return pairs


def _full_blob(path: str, role: str) -> bytes:
    """The bytes of a weight file that must be a full snapshot's, refusing a delta with a message that says so
    (encoding or applying against a delta's U8 payload entries fails later with a puzzling tensor mismatch)."""
    data = _read(path)
    if is_delta_file(data):
        parent = read_delta_info(data, filename=path).parent_identity
        raise UnusableInputError(f"{path!r}: {role} is a hotload delta (made against {parent!r}), not a full "
                                 "snapshot; rebuild it first with 'hotload apply'")
    return data


def _delta_blob(path: str) -> bytes:
    """The bytes of a weight file that must be a delta, refusing a plain safetensors file (a full snapshot given
    as DELTA is a usage error, like the reverse; a damaged delta is left to the decoder, which names the fault)."""
    data = _read(path)
    if not is_delta_file(data):
        try:
            meta = parse_header(data, filename=path).metadata
        except ArcError:
            return data
        if K_TENSORS not in meta:
            raise UnusableInputError(f"{path!r}: DELTA is a full snapshot file, not a hotload delta; pass the "
                                     "delta ('hotload diff' makes one)")
    return data


def _reset_output(out: str) -> None:
    """Create an output folder and drop a commit marker left in it by an earlier run: until the caller marks the
    new content complete, nothing in the folder may claim to be a complete snapshot."""
    os.makedirs(out, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out, COMMIT_MARKER))


def folder_files(folder: str) -> Iterator[tuple[str, str]]:
    """``(name, path)`` of every file below ``folder`` but its commit marker, sorted, names '/'-separated and
    relative (``additional_chat_templates/tool_use.jinja``); hidden files and folders are skipped."""
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = os.path.relpath(root, folder).replace(os.sep, "/")
        for n in sorted(files):
            if not n.startswith(".") and not (rel == "." and n == COMMIT_MARKER):
                yield (n if rel == "." else f"{rel}/{n}"), os.path.join(root, n)


def _copy_aux(src: str, dst: str, weights: Iterable[str]) -> None:
    """Copy a snapshot folder's other files (configs, tokenizer, ``additional_chat_templates/``) into ``dst``:
    every file but the ``weights`` just written there, whatever its name. Why not by suffix: an index may name a
    weight file ``*.bin``, which a copy of the input's would then replace, and a ``*.safetensors`` file that is
    not a weight file (Mistral's ``consolidated.safetensors`` beside the shards) was dropped from the snapshot."""
    weights = set(weights)
    for name, path in folder_files(src):
        if name not in weights:
            os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
            shutil.copyfile(path, os.path.join(dst, name))


def diff_paths(parent: str, new: str, out: str, *, codec: str = "arc_v2", parent_identity: str | None = None,
               progress: Progress | None = None, vendor_module: str | None = None,
               unverified: list[str] | None = None) -> int:
    """Write the delta of ``new`` against ``parent`` to ``out`` (file or folder); returns bytes written.

    With ``vendor_module``, each weight file is encoded by that module's ``delta_compress_files_to_file``
    (see vendor.py) instead of our encoder, and checked (:func:`_check_vendor_file`); the files written in a
    layout our decoder does not read (Fireworks' own) are appended to ``unverified``.
    """
    ident = parent_identity or os.path.basename(os.path.abspath(parent))  # "." is the folder's own name
    vendor = vendor_encoder(vendor_module, codec) if vendor_module else None
    get_codec(codec)  # an unknown codec fails before OUT is touched
    pairs = _pairs(parent, new, ("PARENT", "NEW"))
    if os.path.isdir(new):
        _reset_output(out)
    total = 0
    for i, (name, pa, pb) in enumerate(pairs):
        dst = os.path.join(out, name) if os.path.isdir(new) else out
        parent_blob, new_blob = _full_blob(pa, "PARENT"), _full_blob(pb, "NEW")
        if vendor is not None:
            def encode(tmp: str) -> None:
                try:
                    vendor(pa, pb, tmp)
                except ArcError as exc:
                    raise exc.at(file=dst) from None  # OUT's name, not the temp file's
                with open(tmp, "rb") as f:
                    written = f.read()
                if not _check_vendor_file(written, dst, pa, pb, parent_blob, new_blob, ident) and \
                        unverified is not None:
                    unverified.append(dst)
            _through_temp(dst, encode)  # a file that is not a checked delta never lands where one is expected
        else:
            try:
                blob = encode_delta_file(load_file(parent_blob, filename=pa), load_file(new_blob, filename=pb),
                                         parent_identity=ident, codec=codec)
            except ArcError as exc:
                raise exc.at(file=pb) from None
            def write(tmp: str) -> None:
                with open(tmp, "wb") as f:
                    f.write(blob)
            _through_temp(dst, write)
        total += os.path.getsize(dst)
        if progress:
            progress(i + 1, len(pairs), name)
    if os.path.isdir(new):  # the index and config last: a failed run leaves no index naming missing files
        _copy_aux(new, out, (name for name, _, _ in pairs))
    return total


def _through_temp(dst: str, fill: Callable[[str], object]) -> None:
    """Write ``dst`` through a temp file beside it, renamed over it once ``fill(temp)`` returns. Why: a vendor
    module that failed, or wrote no delta, had its output removed, and in file mode that was the OUT file the
    user had there before the run; a failure now leaves OUT as it was. The temp file is in a folder of its own, so
    it has ``dst``'s name (a vendor module may read it)."""
    where = os.path.join(os.path.dirname(dst), f"{TMP_PREFIX}{secrets.token_hex(6)}")
    os.mkdir(where)
    try:
        tmp = os.path.join(where, os.path.basename(dst))
        fill(tmp)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _check_vendor_file(written: bytes, dst: str, pa: str, pb: str, parent_blob: bytes, new_blob: bytes,
                       ident: str) -> bool:
    """Whether what the vendor module wrote for ``dst`` (``written``) was checked bit for bit: a file in our layout
    must rebuild NEW from PARENT and record ``ident`` as its parent, as the commit marker will (ValueError where it
    does not: the module takes no identity, and an apply checking the marker's would refuse it). Fireworks' layout
    is not public and our decoder does not read it, so a file in any other layout is only checked to be a
    safetensors file other than NEW itself (VendorOutputError), and False is returned. Why not refuse it: producing
    that layout is what the vendor route is for."""
    if is_delta_file(written):
        recorded = read_delta_info(written, filename=dst).parent_identity
        if recorded != ident:
            raise ValueError(f"{dst}: the vendor module's delta records the parent {recorded!r}, not {ident!r} "
                             f"(PARENT's name or --parent-identity): pass --parent-identity {recorded} if PARENT is "
                             "that snapshot")
        try:
            rebuilt = apply_delta_file(load_file(parent_blob, filename=pa), written, filename=dst)
        except ArcError as exc:
            raise VendorOutputError(f"the vendor module's delta does not rebuild {pb}: {exc}", file=dst) from None
        want = load_file(new_blob, filename=pb)
        bad = sorted(n for n in {*rebuilt, *want} if n not in rebuilt or n not in want
                     or bytes(rebuilt[n].data) != bytes(want[n].data))
        if bad:
            raise VendorOutputError(f"the vendor module's delta does not rebuild {pb} (tensor {bad[0]!r} differs)",
                                    file=dst)
        return True
    try:
        parse_header(written, filename=dst)
    except FormatError as exc:
        raise VendorOutputError(f"the vendor module wrote no safetensors file: {exc.reason}", file=dst) from None
    if written == new_blob:
        raise VendorOutputError(f"the vendor module wrote a copy of {pb}, not a delta", file=dst)
    return False


def apply_paths(parent: str, delta: str, out: str | None, *, expected_parent: str | None = None,
                progress: Progress | None = None) -> dict[str, dict[str, RawTensor]]:
    """Rebuild ``delta`` on ``parent``; write the full snapshot to ``out`` unless it is None (verify only).

    Returns the rebuilt tensors by weight file only where ``out`` is None. Otherwise each file's are dropped once
    written and an empty dict is returned: a folder is rebuilt in one file's memory, not the whole model's (an
    apply of a 140 GB snapshot held all 140 GB until it returned)."""
    pairs = _pairs(parent, delta, ("PARENT", "DELTA"))
    mapped = index_files(delta)
    if out is not None and os.path.isdir(delta):
        _reset_output(out)
    result: dict[str, dict[str, RawTensor]] = {}
    for i, (name, pa, pd) in enumerate(pairs):
        parent_blob = _full_blob(pa, "PARENT")
        rebuilt = apply_delta_file(load_file(parent_blob, filename=pa), _delta_blob(pd), filename=pd,
                                   expected_parent=expected_parent)
        _check_mapped(mapped, name, rebuilt, pd)
        if out is None:
            result[name] = rebuilt
        if out is not None:
            dst = os.path.join(out, name) if os.path.isdir(delta) else out
            try:  # a full disk or a kill leaves no half-written file under a weight file's name, nor beside it
                with open(dst + ".tmp", "wb") as f:
                    meta = parse_header(parent_blob, filename=pa).metadata  # the file as its writer made it
                    write_file(f, rebuilt, meta, checksums=CHECKSUM_KEY in meta)
                os.replace(dst + ".tmp", dst)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(dst + ".tmp")
                raise
        del parent_blob, rebuilt  # not held while the next file is read and rebuilt
        if progress:
            progress(i + 1, len(pairs), name)
    if out is not None and os.path.isdir(delta):  # last, as in diff_paths
        _copy_aux(delta, out, [name for name, _, _ in pairs])
    return result


@dataclass
class TensorRow:
    file: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    stored: int  # payload bytes stored for this tensor (the file's header is counted in Report.file_bytes)
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
    files: int = 0  # weight files read
    file_bytes: int = 0  # their sizes on disk: payloads plus headers, what a transfer actually moves

    @property
    def ok(self) -> bool:
        return not self.errors


def inspect_path(path: str) -> Report:
    """Kind, parent, codecs and per-tensor sizes of a delta or full file/folder (headers only)."""
    files = [(os.path.basename(path), path)] if not os.path.isdir(path) else [
        (n, os.path.join(path, n)) for n in _required_weight_files(path, "")]
    report: Report | None = None
    file_bytes = 0
    for name, p in files:
        data, size = _read_head(p)
        file_bytes += size
        if is_delta_file(data, total_size=size):
            info = read_delta_info(data, filename=p, total_size=size)
            report = report or Report("delta", info.parent_identity)
            for t in info.tensors.values():
                report.rows.append(TensorRow(name, t.name, t.dtype, t.shape, t.codec,
                                             info.header.entries[t.name].nbytes, itemsize(t.dtype) * numel(t.shape)))
        else:
            header = parse_header(data, filename=p, total_size=size)
            report = report or Report("full", None)
            for e in header.entries.values():
                report.rows.append(TensorRow(name, e.name, e.dtype, e.shape, "raw", e.nbytes, e.nbytes))
    report = report or Report("full", None)
    report.files, report.file_bytes = len(files), file_bytes
    return report


def verify_paths(parent: str, delta: str, *, expected_parent: str | None = None,
                 progress: Progress | None = None) -> Report:
    """Rebuild in memory and check every checksum; failures are collected per file, not raised (a layout that
    cannot be checked at all, such as differing weight-file sets, raises)."""
    pairs = _pairs(parent, delta, ("PARENT", "DELTA"))
    mapped = index_files(delta)
    report = inspect_path(delta)
    by_file: dict[str, list[TensorRow]] = {}
    for r in report.rows:
        by_file.setdefault(r.file, []).append(r)
    for i, (name, pa, pd) in enumerate(pairs):
        bad: str | None = None
        try:
            rebuilt = apply_delta_file(load_file(_full_blob(pa, "PARENT"), filename=pa), _delta_blob(pd),
                                       filename=pd, expected_parent=expected_parent)
            _check_mapped(mapped, name, rebuilt, pd)
        except ArcError as exc:
            report.errors.append(str(exc))
            bad = exc.tensor or ""
        for r in by_file.get(name, []):
            # Tensors are rebuilt in order and the first failure stops the file: name the culprit precisely.
            r.status = "ok" if bad is None else ("BAD" if r.name == bad or not bad else "unverified")
        if progress:
            progress(i + 1, len(pairs), name)
    return report
