"""How an emulated replica reads a snapshot from the bucket: the layout files, every shard, each delta applied.

Kept apart from the deployment and ledger state (``emulator_state.py``) so that what a load verifies reads in
one place, and so tests can rebuild snapshots with the same code the replicas run (``tests/snapshots.py``).

A load is real work: it reads the index and weight spec, downloads every shard, parses full files or applies
delta files to the tensors served now (the decoder verifies each tensor's Adler-32 and each chunk's CRC-32), and
checks the result against the index and spec.

Example::

    tensors, weight_map, config = load_snapshot(Storage(bucket).get_bytes, "step-2-ab", previous="step-1-cd",
                                                compression_format="arc_v2", parent=tensors,
                                                parent_weight_map=weight_map)
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .arc import (ArcError, RawTensor, apply_delta_file, code_from_name, is_delta_file, load_file, read_delta_info,
                  torch_name)
from .emulator_rules import LORA_MARKER, LoadError, carries_lora_marker, check_full_layout, check_quantization
from .fireworks_models import validate_filename
from .layout import INDEX_FILENAME as INDEX_FILE
from .layout import SPEC_FILENAME as SPEC_FILE

CONFIG_FILE = "config.json"


def _read_json(get_bytes: Callable[[str], bytes], identity: str, name: str) -> dict[str, Any]:
    path = f"{identity}/{name}"
    try:
        raw = get_bytes(path)
    except Exception as exc:  # the storage layer's own error types vary by backend
        raise LoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise LoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LoadError(f"{path} must hold a JSON object")
    return obj


def read_layout(get_bytes: Callable[[str], bytes], identity: str) -> tuple[dict[str, str], dict[str, Any]]:
    """Index weight_map and spec tensor_map of a snapshot, checked against each other."""
    index = _read_json(get_bytes, identity, INDEX_FILE)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise LoadError(f"{identity}/{INDEX_FILE}: 'weight_map' must be a non-empty object")
    for name, fname in weight_map.items():
        if not isinstance(fname, str):
            raise LoadError(f"{identity}/{INDEX_FILE}: weight_map[{name!r}] must be a file name")
        try:
            validate_filename(fname, field=f"weight_map[{name!r}]")
        except ValueError as exc:
            raise LoadError(f"{identity}/{INDEX_FILE}: {exc}") from None
    spec = _read_json(get_bytes, identity, SPEC_FILE)
    tensor_map = spec.get("tensor_map")
    if not isinstance(tensor_map, dict):
        raise LoadError(f"{identity}/{SPEC_FILE}: 'tensor_map' must be an object")
    missing = sorted(n for n in weight_map if n not in tensor_map)
    if missing:
        raise LoadError(f"{identity}/{SPEC_FILE}: tensor_map lacks {len(missing)} tensor(s) named in the index: "
                        f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for name in weight_map:
        entry = tensor_map[name]
        ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
              and all(isinstance(s, int) and s >= 0 for s in entry["shape"]))
        if not ok:
            raise LoadError(f"{identity}/{SPEC_FILE}: tensor_map[{name!r}] needs 'shape' (list of ints) and 'dtype'")
    return weight_map, tensor_map


def _check_tensor(identity: str, fname: str, name: str, t: RawTensor, spec: dict[str, Any]) -> None:
    try:
        want = code_from_name(spec["dtype"])
    except ArcError:
        raise LoadError(f"{identity}/{SPEC_FILE}: tensor {name!r} has unknown dtype {spec['dtype']!r}") from None
    if t.dtype != want or list(t.shape) != list(spec["shape"]):
        raise LoadError(f"{identity}/{fname}: tensor {name!r} is {torch_name(t.dtype)}{list(t.shape)}, the weight "
                        f"spec says {spec['dtype']}{spec['shape']}")


def load_snapshot(
    get_bytes: Callable[[str], bytes],
    identity: str,
    *,
    previous: str | None,
    compression_format: str | None,
    parent: dict[str, RawTensor],
    parent_weight_map: dict[str, str] | None,
    base_shapes: dict[str, tuple[int, ...]] | None = None,
    on_stage: Callable[[str], None] = lambda stage: None,
) -> tuple[dict[str, RawTensor], dict[str, str], dict[str, Any]]:
    """Download and rebuild one snapshot; returns (tensors, weight_map, config). Raises LoadError/ArcError.

    A full snapshot's layout is checked before any shard is downloaded: one layer per file and, when
    ``base_shapes`` is given, the base model's tensor names and shapes, else those of the snapshot served now
    (``parent``), as the service checks each snapshot against its base (a delta keeps its parent's layout)."""
    if carries_lora_marker(get_bytes, identity):
        raise LoadError(f"{identity}/{LORA_MARKER}: this folder is a LoRA adapter to the service (the file is its "
                        "marker), so its weights are never served as the deployment's; the emulator serves "
                        "full-parameter snapshots only, which must not carry the file")
    weight_map, tensor_map = read_layout(get_bytes, identity)
    config = _read_json(get_bytes, identity, CONFIG_FILE)
    check_quantization(identity, config, tensor_map)
    if previous is None:
        reference = "the base model"
        if base_shapes is None and parent:  # no base model given: the snapshot served now stands in for it
            base_shapes = {n: tuple(t.shape) for n, t in parent.items()}
            reference = "the snapshot this replica serves"
        check_full_layout(identity, weight_map, tensor_map, base_shapes, reference)
    else:
        if parent_weight_map is None:
            raise LoadError(f"delta {identity!r} needs parent {previous!r}, but this replica holds no weights")
        if weight_map != parent_weight_map:
            diff = sorted(set(weight_map.items()) ^ set(parent_weight_map.items()))
            raise LoadError(f"{identity}/{INDEX_FILE}: a delta must keep the parent's weight_map exactly; "
                            f"differs at {diff[0][0]!r}")
    files: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        files.setdefault(fname, []).append(name)
    out: dict[str, RawTensor] = {}
    for fname in sorted(files):
        on_stage("downloading")
        path = f"{identity}/{fname}"
        try:
            data = get_bytes(path)
        except Exception as exc:
            raise LoadError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
        on_stage("applying" if previous is not None else "verifying")
        want = set(files[fname])
        if previous is None:
            if is_delta_file(data):
                raise LoadError(f"{path} is a delta file, but {identity!r} was signalled as a full snapshot")
            got = load_file(data, filename=fname, require_checksums=True)
        else:
            if not is_delta_file(data):
                raise LoadError(f"{path} is not a delta file, but {identity!r} was signalled as a delta")
            info = read_delta_info(data, filename=fname)
            unchecked = [n for n, t in info.tensors.items() if any(c[1][2] is None for c in t.chunks)]
            if unchecked:  # the reader takes such files (written before chunks had one); a writer must not
                raise LoadError(f"{path}: tensor {unchecked[0]!r} has chunks without a CRC-32 (of "
                                f"{len(unchecked)} such tensors); every chunk this library writes carries one")
            codecs = {t.codec for t in info.tensors.values()}
            if compression_format is not None and codecs - {compression_format}:
                raise LoadError(f"{path} is encoded with {sorted(codecs)}, the signal said {compression_format!r}")
            got = apply_delta_file({n: parent[n] for n in files[fname]}, data, filename=fname,
                                   expected_parent=previous)
        if set(got) != want:
            raise LoadError(f"{path}: holds tensors {sorted(set(got) - want)} not mapped to it by the index and "
                            f"lacks {sorted(want - set(got))}")
        for name in files[fname]:
            _check_tensor(identity, fname, name, got[name], tensor_map[name])
        out.update(got)
    return out, weight_map, config


def summarize(tensors: dict[str, RawTensor]) -> dict[str, dict[str, Any]]:
    return {n: {"dtype": torch_name(t.dtype), "shape": list(t.shape), "digest": t.digest()}
            for n, t in sorted(tensors.items())}
