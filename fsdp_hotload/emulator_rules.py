"""What the emulated service checks in a full snapshot against the model the deployment was created from.

Fireworks validates a full (non-LoRA) snapshot against its base model (protocol §6.2): the snapshot's
``config.json`` must match the base model's (§2.4 error kinds), its tensors must cover the base model's, and each
``.safetensors`` file may hold the tensors of one layer only. The emulator applies the same rules when given the
base model, so a producer that drops a tied ``lm_head``, renames a tensor, or packs two layers into one file fails
offline in the same way it would fail on a deployment (``stage == "error"``, the deployment keeps its weights).

Example::

    base = BaseModelSpec.from_folder("/models/qwen3-8b")  # config.json + the safetensors headers (no weights read)
    emu = HotLoadEmulator("/tmp/bucket", base_model=base)
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .arc import ArcError, parse_header
from .layout import INDEX_FILENAME, SPEC_FILENAME, LayoutError, check_layers_per_file

log = logging.getLogger(__name__)


class LoadError(Exception):
    """A snapshot could not be loaded; the message names the file/tensor and the reason."""


#: The file whose presence makes the service treat a snapshot folder as a LoRA adapter (protocol §2.2, §6.4).
LORA_MARKER = "adapter_config.json"


def carries_lora_marker(get_bytes: Callable[[str], bytes], identity: str) -> bool:
    """Whether ``<identity>/adapter_config.json`` exists. Why look: the service tells LoRA from full weights by
    the folder's contents, not by the signal, so a full-parameter publisher that carried the file by mistake
    gets an adapter load (never its weights served), and with delta metadata a crashed serving container."""
    try:
        get_bytes(f"{identity}/{LORA_MARKER}")
    except Exception:  # noqa: BLE001 - absent: each storage backend raises its own error type
        return False
    return True


@dataclass(frozen=True)
class BaseModelSpec:
    """The base model a deployment serves before any hot-load: its config and, optionally, its tensor shapes.

    ``shapes`` is None when only the config is known (a folder with config and tokenizer but no weights): then
    tensor coverage is not checked. Dtypes are not compared, because the service accepts a bf16 or quantised
    snapshot of a model whose base weights have another dtype.
    """

    config: dict[str, Any] | None = None
    shapes: dict[str, tuple[int, ...]] | None = None

    @classmethod
    def from_folder(cls, path: str | os.PathLike[str]) -> "BaseModelSpec":
        """Read ``config.json`` and the tensor names and shapes of a Hugging Face model folder.

        Only the safetensors headers are read, so a folder of a large model loads in milliseconds. The files are
        those the index names, or every ``*.safetensors`` file when there is no index. Raises ValueError naming
        the file for a missing or malformed config, index or header, or a tensor found in two files.
        """
        folder = os.fspath(path)
        config = _json_object(os.path.join(folder, "config.json"))
        index_path = os.path.join(folder, INDEX_FILENAME)
        if os.path.isfile(index_path):
            weight_map = _json_object(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index_path}: 'weight_map' must map tensor names to file names")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if not files:
            log.info("base model folder %s has no .safetensors files: only its config.json is checked", folder)
            return cls(config, None)
        shapes: dict[str, tuple[int, ...]] = {}
        for fname in files:
            for name, shape in _header_shapes(os.path.join(folder, fname)).items():
                if name in shapes:
                    raise ValueError(f"{folder}: tensor {name!r} appears in more than one .safetensors file")
                shapes[name] = shape
        return cls(config, shapes)


def _json_object(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            obj = json.loads(fh.read())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; a base model folder needs config.json") from None
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return obj


def _header_shapes(path: str) -> dict[str, tuple[int, ...]]:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        head += fh.read(min(n, max(0, size - 8)))  # a corrupt length would allocate its size before reading a byte
    try:
        header = parse_header(head, filename=path, total_size=size)
    except ArcError as exc:
        raise ValueError(f"{path}: not a safetensors file we read: {exc}") from None
    return {name: e.shape for name, e in header.entries.items()}


def check_config(config: dict[str, Any], base: dict[str, Any] | None, ignore: list[str], identity: str) -> None:
    """The server compares the snapshot's config.json with the base model's; same error kinds as the docs."""
    if base is None:
        return
    # quantization_config: allowed on a quantized snapshot (check_quantization decides whether it fits the
    # tensors); left out of a bf16 upload of a quantized base, it is a key the base alone has, unless ignored
    skip = set(ignore) | {"quantization_config"}
    only_base = sorted(k for k in base if k not in config and k not in ignore)
    only_snap = sorted(k for k in config if k not in base and k not in skip)
    if only_base:
        raise LoadError(f"{identity}/config.json: Extra base model config options: {', '.join(only_base)}")
    if only_snap:
        raise LoadError(f"{identity}/config.json: Extra snapshot model config options: {', '.join(only_snap)}")
    for k in sorted(base):
        if k not in skip and base[k] != config[k]:
            raise LoadError(f"{identity}/config.json: Config value mismatch for {k}: base {base[k]!r}, "
                            f"snapshot {config[k]!r}")


# torch dtype names of weights stored quantized (fp8/fp6/fp4, int8, packed bytes), as tensor_map spells them
_QUANTIZED_DTYPES = ("float8", "float6", "float4", "int8", "uint8", "int4", "uint4")


def check_quantization(identity: str, config: dict[str, Any], tensor_map: Mapping[str, Any]) -> None:
    """A ``quantization_config`` needs quantized tensors to dequantise: the service rejects a snapshot whose spec
    has none (protocol notes, full snapshot contents). Only their presence is checked here, not their scales."""
    if "quantization_config" not in config:
        return
    if not any(str(t.get("dtype", "")).lower().startswith(_QUANTIZED_DTYPES) for t in tensor_map.values()):
        raise LoadError(f"{identity}/config.json: has a quantization_config, but {SPEC_FILENAME} lists no "
                        "quantized tensor to dequantise")


def _listed(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")


def check_full_layout(identity: str, weight_map: Mapping[str, str], tensor_map: Mapping[str, Any],
                      base_shapes: Mapping[str, tuple[int, ...]] | None, reference: str = "the base model") -> None:
    """One layer per file, and (when the base model's shapes are known) the same tensor names and shapes;
    ``reference`` names what ``base_shapes`` come from in the errors."""
    files: dict[str, list[str]] = {}
    for name, fname in weight_map.items():
        files.setdefault(fname, []).append(name)
    try:
        check_layers_per_file(files)
    except LayoutError as exc:
        raise LoadError(f"{identity}/{INDEX_FILENAME}: {exc}; each .safetensors file may hold one layer's "
                        "tensors") from None
    if base_shapes is None:
        return
    missing = sorted(set(base_shapes) - set(weight_map))
    if missing:
        raise LoadError(f"{identity}/{INDEX_FILENAME}: does not cover {reference}: lacks {len(missing)} "
                        f"tensor(s): {_listed(missing)}")
    extra = sorted(set(weight_map) - set(base_shapes))
    if extra:
        raise LoadError(f"{identity}/{INDEX_FILENAME}: names {len(extra)} tensor(s) {reference} does not have: "
                        f"{_listed(extra)}")
    for name in sorted(weight_map):
        if tuple(tensor_map[name]["shape"]) != tuple(base_shapes[name]):
            raise LoadError(f"{identity}/{SPEC_FILENAME}: tensor {name!r} has shape "
                            f"{list(tensor_map[name]['shape'])}, {reference}'s is {list(base_shapes[name])}")
