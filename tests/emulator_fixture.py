"""Tiny snapshots in a local-folder bucket, and a running hot-load emulator as a pytest fixture.

Snapshots are written exactly as the protocol lays them out (index, weight spec, config.json, one layer per
shard), with the format layer's own writers, so the emulator's replicas do the same work on them as on a real
publish — only smaller.

Use from tests or conftest.py::

    from tests.emulator_fixture import emulator, write_full_snapshot, write_delta_snapshot, tiny_model
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from fsdp_hotload.arc import RawTensor, encode_delta_file, save_file, torch_name
from fsdp_hotload.emulator import HotLoadEmulator

EMULATOR_API_KEY = "test-key-0123456789"
CONFIG = {"architectures": ["TinyForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2, "model_type": "tiny"}


def tiny_model(seed: int = 0, layers: int = 2, hidden: int = 8) -> dict[str, RawTensor]:
    """Random bf16 weights (random bit patterns: the format is about bytes, not values)."""
    rng = np.random.default_rng(seed)

    def bf16(*shape: int) -> RawTensor:
        bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        return RawTensor("BF16", tuple(shape), bits.reshape(-1).view(np.uint8))

    tensors = {"model.embed_tokens.weight": bf16(16, hidden), "model.norm.weight": bf16(hidden)}
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = bf16(hidden, hidden)
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = bf16(hidden, 2 * hidden)
    return tensors


def perturb(tensors: Mapping[str, RawTensor], seed: int, fraction: float = 0.1) -> dict[str, RawTensor]:
    """A training step: a fraction of the elements of every tensor get new bit patterns."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in tensors.items():
        vals = t.data.copy().view(np.uint16)
        idx = rng.choice(vals.size, size=max(1, int(vals.size * fraction)), replace=False)
        vals[idx] ^= rng.integers(1, 1 << 16, size=idx.size, dtype=np.uint16)
        out[name] = RawTensor(t.dtype, t.shape, vals.view(np.uint8))
    return out


def shard_of(name: str) -> str:
    """One layer per file, as the protocol requires; non-layer tensors share the first file."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return f"model-{int(parts[2]) + 1:05d}.safetensors"
    return "model-00000.safetensors"


def _write_manifests(folder: Path, tensors: Mapping[str, RawTensor],
                     file_of: Callable[[str], str] = shard_of) -> dict[str, list[str]]:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {n: file_of(n) for n in sorted(tensors)}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    spec = {"tensor_map": {n: {"shape": list(t.shape), "dtype": torch_name(t.dtype)} for n, t in tensors.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "model.weight.spec.json").write_text(json.dumps(spec, indent=1))
    (folder / "config.json").write_text(json.dumps(CONFIG))
    files: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        files.setdefault(fname, []).append(name)
    return files


def write_full_snapshot(bucket: Path | str, identity: str, tensors: Mapping[str, RawTensor],
                        file_of: Callable[[str], str] = shard_of) -> Path:
    """``<bucket>/<identity>/`` as a full snapshot (``file_of`` maps a tensor to its file); returns the folder."""
    folder = Path(bucket) / identity
    for fname, names in _write_manifests(folder, tensors, file_of).items():
        (folder / fname).write_bytes(save_file({n: tensors[n] for n in names}))
    return folder


def write_delta_snapshot(bucket: Path | str, identity: str, parent_identity: str,
                         parent: Mapping[str, RawTensor], new: Mapping[str, RawTensor],
                         codec: str = "arc_v2") -> Path:
    """``<bucket>/<identity>/`` as an arc delta of ``new`` against ``parent``: same index and file names."""
    folder = Path(bucket) / identity
    for fname, names in _write_manifests(folder, new).items():
        blob = encode_delta_file({n: parent[n] for n in names}, {n: new[n] for n in names},
                                 parent_identity=parent_identity, codec=codec)
        (folder / fname).write_bytes(blob)
    return folder


def digest_map(tensors: Mapping[str, RawTensor]) -> dict[str, str]:
    return {n: t.digest() for n, t in sorted(tensors.items())}


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[HotLoadEmulator]:
    """A running emulator (2 replicas, API key :data:`EMULATOR_API_KEY`) over an empty folder bucket.

    The bucket folder is ``emulator.bucket``; write snapshots there with the helpers above.
    """
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    emu = HotLoadEmulator(str(bucket), replicas=2, api_key=EMULATOR_API_KEY)
    emu.start()
    try:
        yield emu
    finally:
        emu.stop()
