"""Snapshot layout: which tensors go into which file of a snapshot, and the manifests that say so.

Why this layer exists: the Fireworks loader accepts a full snapshot only when it is a Hugging Face model folder
with one layer per ``.safetensors`` file (each under about 5 GB), an index (``model.safetensors.index.json``)
and a weight spec (``model.weight.spec.json``), and it accepts a delta only when it keeps its parent's index
exactly. The publisher, the reference decoder and the emulator all need the same answer to "which file holds
this tensor", so the answer lives here, as pure planning over names, shapes and dtypes. Nothing in this module
touches object storage: callers upload the bytes it returns.

Planning rules (:func:`plan_shards`):

* Tensors are grouped: the non-layer "head" tensors (embeddings), then one group per transformer layer, then
  the remaining non-layer tensors (final norm, lm_head). A layer is identified by its stack prefix and index
  (``model.layers.7`` and ``visual.blocks.7`` are different layers), so no file mixes two layers, and no file
  mixes layer and non-layer tensors.
* Groups come in the order head, layers (by stack prefix, then numeric index), tail. Inside a group tensors are
  sorted by name with numbers compared as numbers (``experts.2`` before ``experts.10``). Sorting, rather than
  keeping the caller's order, is what makes the plan independent of how the caller enumerated the model (dict
  order, FSDP wrapping order, a shuffled list): the same tensors always give byte-identical manifests.
* A group is packed greedily into files of at most ``max_file_bytes``; the bound counts the tensor bytes plus a
  safe upper estimate of the safetensors header, so a full-snapshot file written by the safetensors library is
  within the cap. A tensor that alone exceeds the cap gets a file of its own, with a warning. Delta files reuse
  the plan of their parent, so their sizes are whatever the codec produced.
* Files are named ``model-00001-of-000NN.safetensors`` (1-based, five digits, the HF convention).

Example::

    specs = [TensorSpec("model.embed_tokens.weight", (32000, 4096), "BF16"),
             TensorSpec("model.layers.0.mlp.up_proj.weight", (11008, 4096), "BF16"),
             TensorSpec("lm_head.weight", (32000, 4096), "BF16")]
    plan = plan_shards(specs)
    plan.file_of("lm_head.weight")                     # 'model-00003-of-00003.safetensors'
    same = ShardPlan.from_index_and_spec(plan.to_index_json(), plan.to_spec_json())
    check_same_layout(same, plan)                      # a delta against `same` may use `plan`
"""
from __future__ import annotations

import json
import logging
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .arc.dtypes import code_from_name, itemsize, numel, torch_name
from .arc.errors import FormatError

log = logging.getLogger(__name__)

INDEX_FILENAME = "model.safetensors.index.json"
SPEC_FILENAME = "model.weight.spec.json"
DEFAULT_MAX_FILE_BYTES = 5 * 10**9
_MAX_FILES = 99_999  # five digits in the file names
# Header room reserved per file for a ``__metadata__`` block (safetensors writers add e.g. {"format": "pt"}).
_METADATA_ALLOWANCE = 1024
# 8-byte length prefix, the header's outer braces, and up to 7 bytes of padding to an 8-byte boundary.
_FILE_OVERHEAD = 8 + 2 + 7 + _METADATA_ALLOWANCE


class LayoutError(ValueError):
    """A tensor list, plan or manifest breaks a layout rule; the message names the tensor or file."""


# --------------------------------------------------------------------------------------------------- tensors


def _check_tensor_name(name: object, where: str = "") -> str:
    if not isinstance(name, str) or not name:
        raise LayoutError(f"{where}tensor names must be non-empty strings, got {name!r}")
    if name == "__metadata__":
        raise LayoutError(f"{where}'__metadata__' is reserved by safetensors and cannot name a tensor")
    return name


def _norm_shape(shape: object, where: str) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise LayoutError(f"{where}: shape must be a list of integers, got {shape!r}")
    dims: list[int] = []
    for d in shape:  # type: ignore[union-attr]
        try:
            v = -1 if isinstance(d, bool) else operator.index(d)
        except TypeError:
            v = -1
        if v < 0:
            raise LayoutError(f"{where}: shape entries must be non-negative integers, got {d!r} in {shape!r}")
        dims.append(v)
    return tuple(dims)


def _norm_dtype(dtype: object, where: str) -> str:
    try:
        code = code_from_name(str(dtype))
        itemsize(code)
    except FormatError as e:
        raise LayoutError(f"{where}: {e}") from None
    return code


@dataclass(frozen=True)
class TensorSpec:
    """Name (HF naming), full shape and dtype of one model tensor; what a layout is planned from.

    ``dtype`` is a safetensors code (``"BF16"``); torch names (``"bfloat16"``) and ``torch.dtype`` objects are
    accepted and stored as the code, so specs compare equal however they were written.

    Example::

        s = TensorSpec("model.layers.0.mlp.up_proj.weight", (11008, 4096), "bfloat16")
        assert s.dtype == "BF16" and s.nbytes == 11008 * 4096 * 2
        TensorSpec.of("model.norm.weight", torch.ones(4096))   # shape and dtype from a tensor
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        _check_tensor_name(self.name)
        where = f"tensor {self.name!r}"
        object.__setattr__(self, "shape", _norm_shape(self.shape, where))
        object.__setattr__(self, "dtype", _norm_dtype(self.dtype, where))

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * itemsize(self.dtype)

    @staticmethod
    def of(name: str, tensor: Any) -> "TensorSpec":
        """Spec of a torch tensor (a DTensor gives its global shape), numpy array or RawTensor."""
        return TensorSpec(name, tuple(tensor.shape), str(tensor.dtype))


# ---------------------------------------------------------------------------------------- names and groups

# A layer is "<stack>.<index>." where the stack's last segment is one of the usual HF container names. The
# prefix is matched lazily, so the first such segment wins: "model.layers.3.mlp.experts.7" is layer 3.
_LAYER_RE = re.compile(r"^((?:[^.]+\.)*?(?:layers|layer|h|blocks|block))\.([0-9]+)(?:\.|$)")
_DIGIT_RUNS = re.compile(r"([0-9]+)")


def _layer_key(name: str) -> tuple[str, int] | None:
    m = _LAYER_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def layer_of(name: str) -> int | None:
    """Layer index of an HF tensor name, or None for non-layer tensors (embeddings, final norm, lm_head).

    Handles ``model.layers.N.``, ``model.language_model.layers.N.``, ``transformer.h.N.``,
    ``gpt_neox.layers.N.``, ``model.decoder.layers.N.`` and in general any ``<prefix>.{layers,layer,h,blocks,
    block}.N.``. Only the index is returned; two stacks in one model (a vision tower and the language model)
    both have a layer 0, and the planner keeps them apart by their prefix.
    """
    key = _layer_key(name)
    return None if key is None else key[1]


def _is_head(name: str) -> bool:
    # Input embeddings go first. GPT-NeoX calls its output projection "embed_out": that one is a tail tensor.
    return any(("embed" in seg and seg != "embed_out") or seg in ("wte", "wpe") for seg in name.split("."))


def _natural_key(name: str) -> tuple[Any, ...]:
    """Sort key comparing digit runs as numbers (without int(): names may hold absurdly long digit runs)."""
    parts = _DIGIT_RUNS.split(name)
    key = tuple(p if i % 2 == 0 else (len(p.lstrip("0")), p.lstrip("0")) for i, p in enumerate(parts))
    return (key, name)


def _group_order(name: str) -> tuple[Any, ...]:
    """Which file group a tensor belongs to, as a sort key: head (0), one group per layer (1), tail (2)."""
    key = _layer_key(name)
    if key is not None:
        return (1, _natural_key(key[0]), key[1])
    return (0, (), 0) if _is_head(name) else (2, (), 0)


def _check_filename(filename: object, where: str) -> str:
    if not isinstance(filename, str) or not filename:
        raise LayoutError(f"{where}: file names must be non-empty strings, got {filename!r}")
    if "/" in filename or "\\" in filename:
        raise LayoutError(f"{where}: file name {filename!r} must not contain a path separator")
    if ".." in filename or filename.startswith("."):
        raise LayoutError(f"{where}: file name {filename!r} must not contain '..' or start with '.'")
    if any(ord(c) < 32 or ord(c) == 127 for c in filename) or len(filename) > 255:
        raise LayoutError(f"{where}: file name {filename!r} has control characters or is too long")
    if not filename.endswith(".safetensors"):
        raise LayoutError(f"{where}: weight file {filename!r} must end with '.safetensors'")
    return filename


def shard_filename(number: int, total: int) -> str:
    """HF shard name, 1-based: ``shard_filename(1, 12) == 'model-00001-of-00012.safetensors'``."""
    if not 1 <= number <= total <= _MAX_FILES:
        raise LayoutError(f"shard {number} of {total}: needs 1 <= number <= total <= {_MAX_FILES}")
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def _entry_bytes(spec: TensorSpec, offset_digits: int) -> int:
    """Upper bound of one tensor's entry in a safetensors header (compact JSON, trailing comma included)."""
    shape = ",".join(str(d) for d in spec.shape)
    # "<name>":{"dtype":"<code>","shape":[<shape>],"data_offsets":[<begin>,<end>]},
    fixed = len(':{"dtype":"","shape":[],"data_offsets":[,]},')
    checksum = 8  # its Adler-32 in the file's __metadata__ (hex digits; the key is in _METADATA_ALLOWANCE)
    return len(json.dumps(spec.name)) + fixed + len(spec.dtype) + len(shape) + 2 * offset_digits + checksum


# ------------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class ShardPlan:
    """The weight files of a snapshot and which tensors each holds, plus every tensor's spec.

    ``files`` maps file name to tensor names in index order (a file's data section puts the largest
    item sizes first: ``arc.stio.data_order``); ``weight_map`` is the inverse. A plan is checked
    for consistency when built (every tensor in exactly one file, a spec for each, safe file names) and holds
    its own copies of the dicts. Build one with :func:`plan_shards` (new layout) or
    :meth:`from_index_and_spec` (the layout of a snapshot already in storage).

    Example::

        plan = plan_shards(specs)
        for filename, names in plan.files.items():
            write_file(filename, {n: tensors[n] for n in names})
        upload(INDEX_FILENAME, plan.to_index_json()); upload(SPEC_FILENAME, plan.to_spec_json())
    """

    files: dict[str, list[str]]
    weight_map: dict[str, str]
    specs: dict[str, TensorSpec]

    def __post_init__(self) -> None:
        files = {f: list(names) for f, names in self.files.items()}
        weight_map = dict(self.weight_map)
        specs = dict(self.specs)
        seen: dict[str, str] = {}
        for filename, names in files.items():
            _check_filename(filename, "shard plan")
            if not names:
                raise LayoutError(f"shard plan: file {filename!r} holds no tensors")
            for name in names:
                _check_tensor_name(name, "shard plan: ")
                if name in seen:
                    raise LayoutError(f"shard plan: tensor {name!r} is in both {seen[name]!r} and {filename!r}")
                seen[name] = filename
        if weight_map != seen:
            bad = next(n for n in sorted({*weight_map, *seen}, key=str) if weight_map.get(n) != seen.get(n))
            raise LayoutError(f"shard plan: weight_map disagrees with files for tensor {bad!r}")
        for name in seen:
            spec = specs.get(name)
            if not isinstance(spec, TensorSpec) or spec.name != name:
                raise LayoutError(f"shard plan: tensor {name!r} has no TensorSpec of that name")
        extra = sorted(set(specs) - set(seen))
        if extra:
            raise LayoutError(f"shard plan: tensor {extra[0]!r} has a spec but is in no file")
        object.__setattr__(self, "files", files)
        object.__setattr__(self, "weight_map", weight_map)
        object.__setattr__(self, "specs", specs)

    def check_chunks(self, chunks: Iterable[Any]) -> None:
        """ValueError unless each chunk (``name``, ``shape``, ``dtype``) is a piece of a planned tensor of that
        shape and dtype: the adapter's walk and the specs must describe the same model."""
        for c in chunks:
            spec = self.specs.get(c.name)
            if spec is None or tuple(spec.shape) != tuple(c.shape) or spec.dtype != c.dtype:
                raise ValueError(f"chunk {c.name!r} ({c.dtype}{list(c.shape)}) does not match the tensor specs "
                                 f"({spec})")

    def file_of(self, name: str) -> str:
        """File holding tensor ``name``; KeyError naming it if the plan has no such tensor."""
        try:
            return self.weight_map[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in this shard plan") from None

    @property
    def total_size(self) -> int:
        """Sum of all tensors' bytes (the index's ``metadata.total_size``)."""
        return sum(s.nbytes for s in self.specs.values())

    def file_nbytes(self, filename: str) -> int:
        """Tensor bytes stored in one file (header excluded)."""
        return sum(self.specs[n].nbytes for n in self.files[filename])

    def file_size_bound(self, filename: str) -> int:
        """Upper bound of the file's size when written as a plain safetensors file (header included)."""
        payload = self.file_nbytes(filename)
        digits = len(str(payload))
        return _FILE_OVERHEAD + payload + sum(_entry_bytes(self.specs[n], digits) for n in self.files[filename])

    def to_index_json(self) -> bytes:
        """``model.safetensors.index.json``; tensors listed file by file, in plan order."""
        return _dump({"metadata": {"total_size": self.total_size}}, "weight_map", self.weight_map)

    def to_spec_json(self) -> bytes:
        """``model.weight.spec.json``: shape and torch dtype name of every tensor, in the index's order."""
        tensor_map = {
            n: {"shape": list(self.specs[n].shape), "dtype": torch_name(self.specs[n].dtype)} for n in self.weight_map
        }
        return _dump({}, "tensor_map", tensor_map)

    @staticmethod
    def from_index_and_spec(index: bytes | str, spec: bytes | str) -> "ShardPlan":
        """Parse a snapshot's index and weight spec, strictly (they may come from an untrusted bucket).

        Rejected, with the file and tensor named: bytes that are not UTF-8 JSON objects, duplicate keys,
        unknown top-level keys, a missing ``weight_map`` / ``tensor_map``, a weight_map tensor missing from
        ``tensor_map`` (or the reverse), bad shapes and dtypes, unknown keys in a ``tensor_map`` entry (they
        could not be carried forward into the next snapshot), file names with a path separator or ``..``, and a
        ``metadata.total_size`` that disagrees with the spec. The one-layer-per-file rule is not applied here
        (base models from the Hub often break it); use :func:`check_one_layer_per_file` for that.
        """
        idx = _load_object(index, INDEX_FILENAME)
        _only_keys(idx, ("metadata", "weight_map"), INDEX_FILENAME)
        weight_map = idx.get("weight_map")
        if not isinstance(weight_map, dict):
            raise LayoutError(f"{INDEX_FILENAME}: needs a 'weight_map' object, got {_kind(weight_map)}")
        if not weight_map:
            raise LayoutError(f"{INDEX_FILENAME}: 'weight_map' is empty")
        for name, filename in weight_map.items():
            _check_tensor_name(name, f"{INDEX_FILENAME}: ")
            _check_filename(filename, f"{INDEX_FILENAME}: tensor {name!r}")
        metadata = idx.get("metadata", {})
        if not isinstance(metadata, dict):
            raise LayoutError(f"{INDEX_FILENAME}: 'metadata' must be an object, got {_kind(metadata)}")
        total = metadata.get("total_size")
        if "total_size" in metadata and (type(total) is not int or total < 0):
            raise LayoutError(f"{INDEX_FILENAME}: metadata.total_size must be a non-negative integer, got {total!r}")

        doc = _load_object(spec, SPEC_FILENAME)
        _only_keys(doc, ("tensor_map",), SPEC_FILENAME)
        tensor_map = doc.get("tensor_map")
        if not isinstance(tensor_map, dict):
            raise LayoutError(f"{SPEC_FILENAME}: needs a 'tensor_map' object, got {_kind(tensor_map)}")
        for name in weight_map:
            if name not in tensor_map:
                raise LayoutError(f"{SPEC_FILENAME}: tensor {name!r} is in the weight_map but not in tensor_map")
        for name in tensor_map:
            if name not in weight_map:
                raise LayoutError(f"{SPEC_FILENAME}: tensor {name!r} is in tensor_map but in no weight file")
        specs = {name: _parse_spec_entry(name, tensor_map[name]) for name in weight_map}

        if "total_size" in metadata:
            computed = sum(s.nbytes for s in specs.values())
            if total != computed:
                raise LayoutError(
                    f"{INDEX_FILENAME}: metadata.total_size is {total} but the tensors in {SPEC_FILENAME} "
                    f"add up to {computed} bytes"
                )
        files: dict[str, list[str]] = {}
        for name in sorted(weight_map, key=_natural_key):
            files.setdefault(weight_map[name], []).append(name)
        files = {f: files[f] for f in sorted(files)}
        ordered = {n: f for f, names in files.items() for n in names}
        return ShardPlan(files=files, weight_map=ordered, specs=specs)


def _parse_spec_entry(name: str, entry: object) -> TensorSpec:
    where = f"{SPEC_FILENAME}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise LayoutError(f"{where}: entry must be an object with 'shape' and 'dtype', got {_kind(entry)}")
    for key in ("shape", "dtype"):
        if key not in entry:
            raise LayoutError(f"{where}: entry has no {key!r}")
    extra = sorted(set(entry) - {"shape", "dtype"})
    if extra:
        raise LayoutError(f"{where}: unsupported key(s) {extra} (only 'shape' and 'dtype' are understood)")
    shape, dtype = entry["shape"], entry["dtype"]
    if not isinstance(shape, list):
        raise LayoutError(f"{where}: shape must be a list of integers, got {shape!r}")
    if not isinstance(dtype, str):
        raise LayoutError(f"{where}: dtype must be a string such as 'bfloat16', got {dtype!r}")
    return TensorSpec(name, _norm_shape(shape, where), _norm_dtype(dtype, where))


def _dump(head: dict[str, Any], key: str, mapping: dict[str, Any]) -> bytes:
    """Pretty JSON with one tensor per line: readable and diffable, without a line per shape entry."""

    def enc(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    lines = ["{"] + [f"  {enc(k)}: {enc(v)}," for k, v in head.items()] + [f"  {enc(key)}: {{"]
    lines.append(",\n".join(f"    {enc(k)}: {enc(v)}" for k, v in mapping.items()))
    lines += ["  }", "}", ""]
    return "\n".join(lines).encode("utf-8")


def _kind(value: object) -> str:
    return "nothing" if value is None else type(value).__name__


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _reject_constant(token: str) -> None:
    raise ValueError(f"{token} is not valid JSON")


def _load_object(data: object, what: str) -> dict[str, Any]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise LayoutError(f"{what}: not UTF-8 text ({e})") from None
    elif isinstance(data, str):
        text = data
    else:
        raise LayoutError(f"{what}: expected bytes, got {type(data).__name__}")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except _DuplicateKey as e:
        raise LayoutError(f"{what}: key {e.args[0]!r} appears twice") from None
    except ValueError as e:
        raise LayoutError(f"{what}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise LayoutError(f"{what}: top level must be a JSON object, got {_kind(obj)}")
    return obj


def _only_keys(obj: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    extra = sorted(set(obj) - set(allowed))
    if extra:
        raise LayoutError(f"{what}: unknown top-level key(s) {extra} (expected {list(allowed)})")


# -------------------------------------------------------------------------------------------------- planning


def plan_shards(specs: Iterable[TensorSpec], *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                warn: bool = True) -> ShardPlan:
    """Lay out a model's tensors as HF shards: one layer per file, each file within ``max_file_bytes``.

    See the module docstring for the rules. The result depends only on the set of specs and the cap, never on
    the order they were given in. Raises LayoutError for an empty list, a duplicate name, or a bad cap. Tensors
    larger than the cap are warned about in one line, unless ``warn`` is false (the ranks other than 0).
    """
    if isinstance(max_file_bytes, bool) or not isinstance(max_file_bytes, int) or max_file_bytes <= 0:
        raise LayoutError(f"max_file_bytes must be a positive integer, got {max_file_bytes!r}")
    by_name: dict[str, TensorSpec] = {}
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"plan_shards needs TensorSpec objects, got {type(spec).__name__} ({spec!r})")
        if spec.name in by_name:
            raise LayoutError(f"tensor {spec.name!r} is listed twice")
        by_name[spec.name] = spec
    if not by_name:
        raise LayoutError("no tensors to lay out")

    groups: dict[tuple[Any, ...], list[str]] = {}
    for name in by_name:
        groups.setdefault(_group_order(name), []).append(name)
    digits = len(str(max_file_bytes))
    chunks: list[list[str]] = []
    oversized: list[str] = []
    for key in sorted(groups):
        names = sorted(groups[key], key=_natural_key)
        chunks.extend(_pack(names, by_name, max_file_bytes, digits, oversized))
    if oversized and warn:  # one line, not one per tensor (a small cap on a large model: thousands)
        largest = max(oversized, key=lambda n: by_name[n].nbytes)
        log.warning("%d tensor(s) do not fit in one file of max_file_bytes=%d (the largest: %r, %d bytes): each "
                    "gets a file of its own that exceeds the cap", len(oversized), max_file_bytes, largest,
                    by_name[largest].nbytes)
    if len(chunks) > _MAX_FILES:
        raise LayoutError(f"{len(chunks)} files needed, more than {_MAX_FILES}; raise max_file_bytes")
    files = {shard_filename(i + 1, len(chunks)): names for i, names in enumerate(chunks)}
    weight_map = {name: filename for filename, names in files.items() for name in names}
    return ShardPlan(files=files, weight_map=weight_map, specs={n: by_name[n] for n in weight_map})


def _pack(names: list[str], specs: dict[str, TensorSpec], cap: int, digits: int, oversized: list[str]
          ) -> list[list[str]]:
    """Greedy, order-keeping split of one group into files whose size bound stays within ``cap``; a tensor over
    it gets a file of its own, and its name is added to ``oversized``."""
    out: list[list[str]] = []
    current: list[str] = []
    size = _FILE_OVERHEAD
    for name in names:
        cost = specs[name].nbytes + _entry_bytes(specs[name], digits)
        if _FILE_OVERHEAD + cost > cap:
            oversized.append(name)
            if current:
                out.append(current)
            out.append([name])
            current, size = [], _FILE_OVERHEAD
            continue
        if current and size + cost > cap:
            out.append(current)
            current, size = [], _FILE_OVERHEAD
        current.append(name)
        size += cost
    if current:
        out.append(current)
    return out


# ------------------------------------------------------------------------------------------ layout checks


def check_same_layout(parent: ShardPlan, child: ShardPlan) -> None:
    """Raise LayoutError unless ``child`` keeps ``parent``'s layout exactly (what a delta must do).

    Same tensors, each in the same file, with the same shape and dtype (dtypes never change along a chain).
    The message lists every difference (the first ten), naming the tensor and what changed.
    """
    problems: list[str] = []
    for name, pfile in parent.weight_map.items():
        if name not in child.weight_map:
            problems.append(f"tensor {name!r} was removed (parent has it in {pfile!r})")
            continue
        cfile = child.weight_map[name]
        if cfile != pfile:
            problems.append(f"tensor {name!r} moved from {pfile!r} to {cfile!r}")
        p, c = parent.specs[name], child.specs[name]
        if p.dtype != c.dtype:
            problems.append(f"tensor {name!r} changed dtype {torch_name(p.dtype)} -> {torch_name(c.dtype)}")
        if p.shape != c.shape:
            problems.append(f"tensor {name!r} changed shape {list(p.shape)} -> {list(c.shape)}")
    for name, cfile in child.weight_map.items():
        if name not in parent.weight_map:
            problems.append(f"tensor {name!r} was added (in {cfile!r}); the parent does not have it")
    if not problems and set(parent.files) != set(child.files):  # only reachable with empty-file plans
        problems.append(f"file names differ: {sorted(set(parent.files) ^ set(child.files))}")
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise LayoutError("layout differs from the parent snapshot: " + "; ".join(problems[:10]) + more)


def check_one_layer_per_file(plan: ShardPlan) -> None:
    """Raise LayoutError if a file mixes two layers, or layer and non-layer tensors (Fireworks rule, §6.2)."""
    check_layers_per_file(plan.files)


def check_layers_per_file(files: Mapping[str, Sequence[str]]) -> None:
    """:func:`check_one_layer_per_file` for a plain ``{file name: [tensor names]}`` mapping (a read index)."""
    for filename, names in files.items():
        if not names:
            continue
        first = names[0]
        key = _layer_key(first)
        for name in names[1:]:
            if _layer_key(name) != key:
                raise LayoutError(f"file {filename!r} mixes layers: {first!r} and {name!r}")

