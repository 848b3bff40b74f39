"""The base model's files as a snapshot carries them, with ``config.json`` made to describe the weights published.

A snapshot carries the non-weight files of ``hf_config_dir`` that :func:`hf_aux_files` allows (config, tokenizer,
templates, remote code). Why ``config.json`` may need one change: the bases of many large models (DeepSeek-V3/R1,
Kimi-K2, Qwen3-*-FP8, gpt-oss) ship pre-quantized, so their ``config.json`` has a ``quantization_config``; a
trainer publishes 16-bit weights with no scale tensors. A server reading that config
builds quantized layers and finds nothing to fill them (Fireworks rejects a snapshot whose ``quantization_config``
has no dequantisable tensors), so the key is left out unless some published tensor is itself quantized.

Example::

    aux = snapshot_files("/models/base", [spec.dtype for spec in plan.specs.values()])
    # aux["config.json"]: the base config, minus an fp8 quantization_config when every tensor is bf16
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import math
import struct
from typing import Any, Callable, Iterable, Mapping

from .arc.container import FORMAT_NAME, K_FORMAT
from .arc.stio import MAX_HEADER_BYTES
from .layout import LayoutError

__all__ = ["AUX_FILENAMES", "AUX_PATTERNS", "AUX_SUBFOLDERS", "base_tensor_shapes", "carried_files",
           "dropped_config_keys", "dtype_note", "hf_aux_files", "hf_tie_word_embeddings", "ignored_config_keys",
           "is_aux_file", "names_note", "snapshot_files", "weight_dtypes", "weight_elements",
           "without_unbacked_quantization"]

log = logging.getLogger("fsdp_hotload")

# safetensors dtype codes narrower than 16 bits: weights stored quantized (fp8/fp6/fp4, int8, packed bytes).
_QUANTIZED_PREFIXES = ("F8", "F6", "F4", "I8", "U8", "I4", "U4")

# Files of the base folder that snapshots carry (an allowlist; see hf_aux_files).
AUX_FILENAMES: tuple[str, ...] = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
    "merges.txt", "chat_template.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json", "tekken.json",
    # tokenizers that read one more file of a fixed name: GPT-NeoX-Japanese's emoji table, DeBERTa-v2's and
    # RemBERT's sentencepiece models, Whisper's English spelling normaliser
    "emoji.json", "spm.model", "sentencepiece.model", "normalizer.json",
)
# Chat templates, tiktoken vocabularies, and remote code: every top-level module, since an "auto_map" may name
# processors as well as models and tokenizers, and those modules import siblings (e.g. tool_declaration_ts.py).
# Modules only go with a folder whose JSON files name remote code (see _remote_code_named).
# mistral-common's tokenizers (tekken.json above, tokenizer[.mm].model.v*) are what vLLM's mistral mode reads.
AUX_PATTERNS: tuple[str, ...] = ("*.jinja", "*.tiktoken", "tiktoken.model", "*.py", "tokenizer.model.v*",
                                 "tokenizer.mm.model.v*")
# Sub-folders that are carried, with the patterns of their files: transformers (2025 on) saves a tokenizer's named
# chat templates (tool use, RAG) as additional_chat_templates/<name>.jinja beside chat_template.jinja.
AUX_SUBFOLDERS: dict[str, tuple[str, ...]] = {"additional_chat_templates": ("*.jinja",)}


def is_aux_file(name: str) -> bool:
    """Whether a file of the base folder's top level is one a snapshot carries (``AUX_FILENAMES``, ``AUX_PATTERNS``)."""
    return name in AUX_FILENAMES or any(fnmatch.fnmatchcase(name, p) for p in AUX_PATTERNS)


def hf_aux_files(hf_config_dir: str | os.PathLike[str] | None) -> dict[str, bytes]:
    """The non-weight files of a base model folder that a snapshot carries: config, tokenizer, templates.

    Only known names are copied (an allowlist): weights, index and spec files are written by the publisher,
    and some files must never be carried, e.g. ``adapter_config.json`` would turn the snapshot into a LoRA
    one. Symlinks (HF cache folders) are followed; of the sub-folders only those of ``AUX_SUBFOLDERS`` are
    entered (their files keep the folder in their name: ``additional_chat_templates/tool_use.jinja``). Returns
    ``{}`` for None.
    Raises FileNotFoundError if the folder or its ``config.json`` is missing, LayoutError if ``config.json``
    is not a JSON object or a carried file is a Git LFS pointer.
    """
    if hf_config_dir is None:
        return {}
    path = os.fspath(hf_config_dir)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"HF config folder {path!r} does not exist or is not a folder")
    config_path = os.path.join(path, "config.json")
    if os.path.islink(config_path) and not os.path.exists(config_path):
        raise FileNotFoundError(f"HF config folder {path!r}: config.json is a link to {os.readlink(config_path)!r}, "
                                "which does not exist (a copy of an HF cache snapshot folder without its blobs?); "
                                "copy it with the links followed (cp -L), or point at the cache's snapshot folder")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"HF config folder {path!r} has no config.json; point it at the base model's folder (the one with "
            "config.json and the tokenizer files)"
        )
    out = _read_matching(path, "", is_aux_file)
    for sub, patterns in AUX_SUBFOLDERS.items():
        if os.path.isdir(os.path.join(path, sub)):
            out.update(_read_matching(os.path.join(path, sub), f"{sub}/",
                                      lambda name, pats=patterns: any(fnmatch.fnmatchcase(name, p) for p in pats)))
    try:
        config = json.loads(out["config.json"].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise LayoutError(f"{os.path.join(path, 'config.json')}: not valid JSON ({e})") from None
    except RecursionError:  # the decoder recurses per nesting level
        raise LayoutError(f"{os.path.join(path, 'config.json')}: not JSON we read, nested too deeply; point "
                          "hf_config_dir at the base model's own config.json") from None
    if not isinstance(config, dict):
        kind = "nothing" if config is None else type(config).__name__
        raise LayoutError(f"{os.path.join(path, 'config.json')}: must be a JSON object, got {kind}")
    if not _remote_code_named(out):
        modules = [name for name in out if name.endswith(".py")]
        for name in modules:
            del out[name]
        if modules:
            log.info("hotload: %s names no remote code (no auto_map), so its .py files are not carried: %s", path,
                     ", ".join(modules))
    if not any(name.startswith(_TOKENIZER_PREFIXES) or name.endswith(".tiktoken") for name in out):
        log.warning("hotload: %s holds no tokenizer file (tokenizer.json, tokenizer.model, vocab.json, ...), so the "
                    "snapshots carry none, and a server that loads the tokenizer from the model's folder (vLLM's "
                    "default) cannot start from them: point hf_config_dir at the base model's folder", path)
    return out


# Names of the carried files that are a tokenizer's (any one is enough to load one; tokenizer_config.json is
# not: it only configures one)
_TOKENIZER_PREFIXES = ("tokenizer.", "vocab.", "merges.txt", "spiece.model", "sentencepiece.", "spm.model",
                       "tekken.json", "tiktoken.model")


# What a file cloned without `git lfs pull` holds instead of its bytes (https://git-lfs.com/spec/v1)
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"


def _read_matching(folder: str, prefix: str, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    """The visible files of ``folder`` (symlinks followed, not recursive) whose names ``wanted`` accepts, keyed
    ``prefix + name``."""
    out: dict[str, bytes] = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if not wanted(entry.name) or entry.name.startswith("."):
            continue
        try:
            is_file = entry.is_file(follow_symlinks=True)
        except OSError as exc:  # a link that loops
            log.warning("hotload: %s cannot be followed (%s): the snapshots do not carry it", entry.path, exc)
            continue
        if is_file:
            with open(entry.path, "rb") as fh:
                data = fh.read()
            if data.startswith(_LFS_POINTER):
                raise LayoutError(f"{entry.path} is a Git LFS pointer, not the file itself, and every snapshot "
                                  "would carry it so: run `git lfs pull` in the folder, or point hf_config_dir at "
                                  "a full download")
            out[prefix + entry.name] = data
        elif entry.is_symlink() and not os.path.exists(entry.path):  # would otherwise be left out without a word
            log.warning("hotload: %s is a link to %r, which does not exist: the snapshots do not carry it",
                        entry.path, os.readlink(entry.path))
    return out


def _remote_code_named(files: dict[str, bytes]) -> bool:
    """Whether a carried JSON file (config, tokenizer or processor config) has an ``auto_map``: remote code the
    server may import. Why ask: without one the folder's ``.py`` files are nobody's code, and a folder that is
    also a working directory would upload its scripts (and whatever they hold) to the bucket."""
    for name, raw in files.items():
        if name.endswith(".json"):
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                continue
            if isinstance(obj, dict) and "auto_map" in obj:
                return True
    return False


def hf_tie_word_embeddings(hf_config_dir: str | os.PathLike[str] | None) -> bool | None:
    """``tie_word_embeddings`` from the HF config.json, so snapshots name tied weights the way the receiver's
    model class expects; None when there is no config, it does not say, or it says two things.

    Multimodal configs keep the language model's setting under ``text_config``, read when the top level does not
    say. Why None when both say and disagree: which one a model follows depends on its class and the transformers
    version (transformers 5 copies a nested true over a top-level false for LLaVA, Qwen2-VL, GLM-4V and others,
    and the other way round for some; 4.x read ``get_text_config()`` first), so the model the trainer built
    decides: an ``lm_head`` that is the input embedding's tensor is left out, one of its own is published. A
    warning names both values; ``tie_word_embeddings=`` on ``HotloadCallback`` forces one.
    Raises LayoutError for a config.json nested too deeply to read."""
    if not hf_config_dir:
        return None
    path = os.path.join(os.fspath(hf_config_dir), "config.json")
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError):  # ValueError: not JSON, or not UTF-8 (hf_aux_files says so where it matters)
        return None
    except RecursionError:  # the decoder recurses per nesting level
        raise LayoutError(f"{path}: not JSON we read, nested too deeply; point hf_config_dir at the base model's "
                          "own config.json") from None
    if not isinstance(config, dict):
        return None
    value = config.get("tie_word_embeddings")
    text_config = config.get("text_config")
    nested = text_config.get("tie_word_embeddings") if isinstance(text_config, dict) else None
    if not isinstance(value, bool):
        value = nested
    elif isinstance(nested, bool) and nested != value:
        log.warning("hotload: %s says tie_word_embeddings=%s at the top level and %s under text_config; the model "
                    "decides (an lm_head that is the input embedding's tensor is left out, one of its own is "
                    "published): pass tie_word_embeddings= to HotloadCallback to force one", path, value, nested)
        return None
    return value if isinstance(value, bool) else None


def snapshot_files(hf_config_dir: str | os.PathLike[str] | None, dtypes: Iterable[str]) -> dict[str, bytes]:
    """:func:`hf_aux_files`, then :func:`carried_files`."""
    return carried_files(hf_aux_files(hf_config_dir), dtypes)


def carried_files(base_files: dict[str, bytes], dtypes: Iterable[str] | Mapping[str, int]) -> dict[str, bytes]:
    """What snapshots carry of ``base_files`` (:func:`hf_aux_files`) for tensors of safetensors codes ``dtypes``
    (or codes and their element counts, :func:`weight_elements`): :func:`without_unbacked_quantization`, after
    logging :func:`dtype_note` if there is one."""
    if not isinstance(dtypes, Mapping):
        dtypes = list(dtypes)
    note = dtype_note(base_files, dtypes)
    if note is not None:
        log.warning("%s", note)
    return without_unbacked_quantization(base_files, dtypes)


def dropped_config_keys(base_files: dict[str, bytes], files: dict[str, bytes]) -> list[str]:
    """Top-level keys of the base ``config.json`` (in ``base_files``, :func:`hf_aux_files`)
    that the snapshots' ``config.json`` (in ``files``) leaves out.

    Why: the server compares the two configs and rejects a key present in only one ("Extra base model config
    options"), so each signal names these in ``validation.extra_fields_ignore``."""
    base = base_files.get("config.json")
    ours = files.get("config.json")
    if base is None or ours is None or base == ours:
        return []
    base_keys, our_keys = json.loads(base), json.loads(ours)
    if not isinstance(base_keys, dict) or not isinstance(our_keys, dict):
        return []
    return sorted(set(base_keys) - set(our_keys))


def ignored_config_keys(base_files: dict[str, bytes], files: dict[str, bytes], dtypes: Iterable[str],
                        named: Iterable[str] | None = None) -> list[str]:
    """What each signal names in ``validation.extra_fields_ignore``: :func:`dropped_config_keys`, and ``named``
    (``HotloadConfig.extra_fields_ignore``), or where that is None and the snapshots carry a ``config.json`` and
    none of ``dtypes`` (the published tensors' safetensors codes) is quantized, each of :data:`QUANTIZATION_KEYS`
    that their ``config.json`` lacks.

    Why the second part: the server compares with the deployment's base model, which may be quantized while
    ``hf_config_dir`` holds a config without the key (an earlier run's snapshot, or a bf16 copy of an FP8 base,
    as the README advises for ``carry_base_tensors``). Nothing was dropped then, so nothing was named, and every
    publish was refused with "Extra base model config options". That naming a key neither config has leaves the
    comparison as it was is inferred (the API documents the field, not that case): ``named`` (``[]``) turns this
    part off."""
    names = set(dropped_config_keys(base_files, files))
    if named is not None:
        return sorted(names | set(named))
    ours = files.get("config.json")
    if ours is not None and not any(map(is_quantized, dtypes)):
        config = json.loads(ours)
        if isinstance(config, dict):
            names |= {key for key in QUANTIZATION_KEYS if key not in config}
    return sorted(names)


_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}


def dtype_note(files: dict[str, bytes], dtypes: Iterable[str] | Mapping[str, int]) -> str | None:
    """A warning when the base ``config.json`` names a load dtype (``torch_dtype``, or ``dtype`` in recent
    transformers) other than the one most of the published floating-point elements have; else None. ``dtypes``:
    safetensors codes and their element counts (:func:`weight_elements`), or one code per tensor (each counted
    once). The dtype is read where vLLM reads it: the top level, else the text config's, else ``vision_config``'s.

    Why: ``config.json`` is carried unchanged (a rewritten value would differ from the base's, which the server
    rejects), so a server that loads in the config's dtype converts every weight: bf16 to float16 overflows
    past 65504 and rounds, and the fleet no longer serves the trainer's bytes. Why the most elements: one small
    tensor in the config's dtype (a buffer, a ``dtype_overrides`` glob) leaves every other weight converted."""
    raw = files.get("config.json")
    config = json.loads(raw) if raw is not None else None
    if not isinstance(config, dict):
        return None
    named = _config_dtype(config)
    code = _CONFIG_DTYPES.get(str(named).removeprefix("torch.")) if named is not None else None
    counts: dict[str, int] = {}
    for d, n in (dtypes.items() if isinstance(dtypes, Mapping) else ((d, 1) for d in dtypes)):
        if str(d).upper() in _FLOAT_CODES:
            counts[str(d).upper()] = counts.get(str(d).upper(), 0) + n
    if code is None or not counts or counts.get(code, -1) == max(counts.values()):
        return None
    most = max(sorted(counts), key=counts.__getitem__)
    share = counts[most] / (sum(counts.values()) or 1)
    what = most if len(counts) == 1 else (f"mostly {most} ({share:.1%} of their elements; the rest "
                                          f"{', '.join(c for c in sorted(counts) if c != most)})")
    return (f"hotload: the base config.json says the weights are {named}, but the snapshots' floating tensors are "
            f"{what}; a server that loads in the config's dtype converts them, so the fleet would not serve the "
            f"trainer's bytes: set snapshot_dtype to {named} if that is what the fleet loads")


_FLOAT_CODES = ("BF16", "F16", "F32", "F64")
# Where transformers' get_text_config() finds a composite model's text config (it refuses a config with two)
_TEXT_CONFIG_KEYS = ("text_encoder", "decoder", "generator", "text_config")


def _config_dtype(config: dict[str, Any]) -> Any:
    """The load dtype a config names, where vLLM looks for it: the top level's ``torch_dtype`` (or ``dtype``),
    else the text config's, else ``vision_config``'s (None where none names one)."""
    texts = [config[k] for k in _TEXT_CONFIG_KEYS if isinstance(config.get(k), dict)]
    vision = config.get("vision_config")
    for part in (config, texts[0] if len(texts) == 1 else None, vision if isinstance(vision, dict) else None):
        if part is not None:
            named = part.get("torch_dtype", part.get("dtype"))
            if named is not None:
                return named
    return None


# The config keys that describe quantized weights: vLLM reads compressed-tensors' older ``compression_config`` too.
QUANTIZATION_KEYS = ("quantization_config", "compression_config")


def is_quantized(code: str) -> bool:
    """Whether a safetensors dtype code is a quantized one (8 bits or fewer), which keeps the base config's
    ``quantization_config`` in the snapshots' (:func:`without_unbacked_quantization`)."""
    return str(code).upper().startswith(_QUANTIZED_PREFIXES)


def weight_dtypes(tensors: Iterable[tuple[str, str]]) -> list[str]:
    """The safetensors codes of ``tensors`` (name, code) that say whether the weights are quantized: all but those
    of 8-bit integer tensors named as masks (the name's last part holds ``mask``, or is ``bias``, as in GPT-2's
    causal-mask buffers). Why: every I8/U8 tensor counted as quantized, so a bf16 model with one byte mask kept an
    FP8 base's ``quantization_config``, and a server would read its bf16 weights as FP8. Other byte tensors still
    count: packed 4-bit weights (``weight``), MXFP4 blocks and scales (``*_blocks``, ``*_scales``), int8 weights.

    Example::

        weight_dtypes([("model.norm.weight", "BF16"), ("model.layers.0.attn.mask", "U8")])  # ["BF16"]
    """
    return [code for name, code in tensors if str(code).upper() not in ("I8", "U8") or not _is_mask(name)]


def _is_mask(name: str) -> bool:
    last = str(name).rsplit(".", 1)[-1].lower()
    return "mask" in last or last == "bias"


def weight_elements(tensors: Iterable[tuple[str, str, Iterable[int]]]) -> dict[str, int]:
    """The codes :func:`weight_dtypes` keeps of ``tensors`` (name, code, shape), each with its element count:
    what :func:`dtype_note` weighs the config's dtype against."""
    out: dict[str, int] = {}
    for name, code, shape in tensors:
        if weight_dtypes([(name, code)]):
            out[code] = out.get(code, 0) + math.prod(shape)
    return out


def without_unbacked_quantization(files: dict[str, bytes], dtypes: Iterable[str]) -> dict[str, bytes]:
    """``files`` with ``quantization_config`` (and ``compression_config``) removed from ``config.json`` when none
    of ``dtypes`` (safetensors codes of the published tensors) is quantized; unchanged otherwise, byte for byte."""
    raw = files.get("config.json")
    if raw is None:
        return files
    config = json.loads(raw)
    if not isinstance(config, dict) or any(map(is_quantized, dtypes)):
        return files
    nested = [path for path in _quantization_paths(config) if "." in path]
    if nested:
        log.warning("hotload: the base config.json has %s, but every published tensor is 16 bits or wider; it is "
                    "carried unchanged (the hot-load API can be told to ignore top-level keys only, so leaving out a "
                    "nested one could fail the config check): a server that reads it expects quantized weights, so "
                    "point hf_config_dir at a copy without it if the fleet fails to load", " and ".join(nested))
    if not any(k in config for k in QUANTIZATION_KEYS):
        return files
    for key in QUANTIZATION_KEYS:
        quant = config.pop(key, None)
        if quant is None:
            continue
        method = quant.get("quant_method", quant.get("format", "?")) if isinstance(quant, dict) else "?"
        log.warning("hotload: the base config.json has a %s (quant_method %s), but every published tensor is 16 "
                    "bits or wider; the snapshots' config.json leaves it out, since a server would otherwise expect "
                    "quantized weights and their scales", key, method)
    return {**files, "config.json": (json.dumps(config, indent=2) + "\n").encode()}


def _quantization_paths(config: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of the quantization keys in ``config`` and the configs nested in it (``text_config``, ...)."""
    found = []
    for key, value in config.items():
        if key in QUANTIZATION_KEYS:
            found.append(prefix + key)
        elif isinstance(value, dict):
            found += _quantization_paths(value, f"{prefix}{key}.")
    return found


# Parameters that transformers 5 fuses across a sparse MoE block's experts (one 3-D tensor per projection), while
# checkpoints, and the fleet's loaders, name each expert's 2-D weight (``experts.<e>.gate_proj.weight``, ...).
_FUSED_EXPERT_SUFFIXES = (".experts.gate_up_proj", ".experts.down_proj", ".experts.gate_proj", ".experts.up_proj")


Shape = tuple[int, ...]


def base_tensor_shapes(hf_config_dir: str | os.PathLike[str] | None) -> dict[str, Shape | None] | None:
    """The tensors of the base checkpoint in ``hf_config_dir``, by name, each with its shape where a
    ``*.safetensors`` header there gives it (only headers are read, no weights): its index's ``weight_map`` names,
    else those of ``model.safetensors`` (transformers reads no other file there: a ``consolidated.safetensors``
    beside it is Mistral's own format). With an index, a file that is absent or unreadable (a Git LFS pointer)
    leaves its tensors' shapes unknown. None when the folder holds no weights (config and tokenizer only), or,
    without an index, a header cannot be read: there is then nothing to compare with. Never raises: what it reads
    only feeds start-up checks."""
    return base_tensors(hf_config_dir)[0]


def base_tensors(hf_config_dir: str | os.PathLike[str] | None
                 ) -> tuple[dict[str, Shape | None] | None, dict[str, str] | None]:
    """The base checkpoint's shapes (as :func:`base_tensor_shapes`) and the safetensors dtype codes (``F32``,
    ``BF16``, ...) of the tensors whose headers give one, from one read of its headers; ``(None, None)`` where
    there is nothing to compare with."""
    entries = _base_entries(hf_config_dir)
    if entries is None:
        return None, None
    return ({k: _shape(v) for k, v in entries.items()},
            {k: v["dtype"] for k, v in entries.items() if isinstance(v, dict) and isinstance(v.get("dtype"), str)})


def _base_entries(hf_config_dir: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The base checkpoint's header entries by name (None for a name only its index gives), as
    :func:`base_tensor_shapes` reads them."""
    if hf_config_dir is None:
        return None
    path = os.fspath(hf_config_dir)
    try:
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index, "rb") as fh:
                weight_map = json.loads(fh.read()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(k, str) for k in weight_map):
                return None
            files = sorted({f for f in weight_map.values() if isinstance(f, str)})
        else:  # one file, as transformers reads it: a consolidated.safetensors beside it is another format's
            weight_map = {}
            files = ["model.safetensors"] if os.path.isfile(os.path.join(path, "model.safetensors")) else []
        entries: dict[str, Any] = {name: None for name in weight_map}
        for name in files:
            header = _header(os.path.join(path, name))
            if header is None:
                if weight_map:  # names only, from the index
                    continue
                return None
            meta = header.get("__metadata__")
            delta = isinstance(meta, dict) and meta.get(K_FORMAT) == FORMAT_NAME  # a hotload delta snapshot's file
            entries.update((k, None if delta else v) for k, v in header.items()  # its entries are U8 payloads
                           if k != "__metadata__" and (not weight_map or k in weight_map))
        return entries or None
    except Exception as exc:  # noqa: BLE001 - any malformed index (deep nesting, odd types): no comparison
        log.debug("hotload: the base checkpoint's index in %s could not be read: %s", path, exc)
        return None


def narrowed_note(published: Iterable[tuple[str, str]], base: dict[str, str] | None) -> str | None:
    """A warning when floating tensors the base checkpoint stores wider (``F32``) than others are published
    narrower (``BF16``), named with the override that keeps them; else None.

    Why: a model's authors keep some tensors in F32 on purpose (DeepSeek-V3's ``e_score_correction_bias``, which
    steers MoE routing; norms in some checkpoints), and the fleet's loader keeps them so. Published as BF16 they
    lose precision, and the fleet serves a routing the trainer never had, with no error anywhere."""
    if not base:
        return None
    # Only where the base itself stores floats as narrow as those published: an all-F32 checkpoint (gpt2's) is
    # published as BF16 by the config's choice, while F32 tensors among BF16 ones were kept wide on purpose.
    narrowest = min((_float_bits(c) for c in base.values() if _is_float(c)), default=0)
    bad = [(n, code, theirs) for n, code in published
           if (theirs := base.get(n)) is not None and _is_float(code) and _is_float(theirs)
           and narrowest <= _float_bits(code) < _float_bits(theirs)]
    if not bad:
        return None
    name, ours, theirs = bad[0]
    return (f"{len(bad)} tensor(s) the base checkpoint stores as a wider float are published narrower (e.g. "
            f"{name!r}: {theirs} there, {ours} published): dtype_overrides={{{name!r}: 'keep'}} (a glob may name "
            "them all) publishes them as the trainer holds them")


def _is_float(code: str) -> bool:
    return code.startswith(("F", "BF")) and code != "F8_E8M0"


def _float_bits(code: str) -> int:
    digits = "".join(ch for ch in code.split("_")[0] if ch.isdigit())
    return int(digits) if digits else 0


def _header(file: str) -> dict[str, Any] | None:
    """A safetensors file's header, or None when the file is absent, is not one (a Git LFS pointer claims more
    than any header may hold) or holds malformed JSON."""
    try:
        with open(file, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > MAX_HEADER_BYTES:
                return None
            header = json.loads(fh.read(size))
    except Exception:  # noqa: BLE001 - OSError, struct.error, bad JSON, RecursionError: not a header
        return None
    return header if isinstance(header, dict) else None


def _shape(entry: Any) -> Shape | None:
    """A header entry's shape: a list of non-negative integers, else unknown."""
    dims = entry.get("shape") if isinstance(entry, dict) else None
    if not isinstance(dims, list) or not all(type(d) is int and d >= 0 for d in dims):
        return None
    return tuple(dims)


def names_note(published: Iterable[str], base: Iterable[str] | None, *, saved: Iterable[str] | None = None
               ) -> str | None:
    """A warning when the published tensor names are not the base checkpoint's (:func:`base_tensor_shapes`), or,
    when the base's names are unknown, when some look like transformers 5's fused MoE experts; else None.

    Why: the fleet checks a full snapshot's tensors against its base model and its loaders look weights up by
    the checkpoint's names, so such a snapshot fails to load on every publish. transformers 5 itself loads either
    form, so a trainer can miss it. The usual cause is a MoE model built with transformers 5, whose experts are
    fused parameters (``mlp.experts.gate_up_proj``) while checkpoints name every expert: the callback's
    ``split=split_fused_experts`` publishes those per expert."""
    names = set(published)
    base = None if base is None else set(base)
    saved = None if saved is None else set(saved)
    if base is None and saved is not None:  # no weights to compare with: what transformers would save says it
        extra = sorted(names - saved)
        if not extra:
            return None
        fused = sorted(n for n in extra if n.endswith(_FUSED_EXPERT_SUFFIXES))
        fix = (": pass split=split_fused_experts to HotloadCallback (the layout of the qwen2_moe family and "
               "Mixtral)") if fused else (" (rename= maps names, as in the README's Mixtral recipe, leaves a "
                                         "name out where it returns None, and joins tensors given one name with "
                                         "positions; split= divides a tensor)")
        instead = sorted(saved - names)
        example = f"; it writes e.g. {instead[0]!r}" if instead else ""
        return (f"{len(extra)} published tensor name(s) are not among those transformers' save_pretrained writes "
                f"for this model (e.g. {extra[0]!r}{example}), so a fleet that loads by the checkpoint's names will "
                f"not load these snapshots{fix}")
    fused = sorted(n for n in names if n.endswith(_FUSED_EXPERT_SUFFIXES))
    fix = "pass split=split_fused_experts to HotloadCallback (the layout of the qwen2_moe family and Mixtral)"
    hint = (f"; {len(fused)} of them look like transformers 5's fused MoE experts (e.g. {fused[0]!r}), which "
            f"checkpoints store per expert ('experts.<e>.gate_proj.weight'): {fix}") if fused else ""
    if base is None:
        if not fused:
            return None
        return (f"the model has fused MoE expert parameters (e.g. {fused[0]!r}, {len(fused)} in all) as "
                "transformers 5 builds them; unless the base checkpoint stores its experts fused too (gpt-oss, "
                "Llama 4), it names each expert ('experts.<e>.gate_proj.weight') and the fleet will not load "
                f"these snapshots: {fix}")
    missing, extra = sorted(base - names), sorted(names - base)
    if not missing and not extra:
        return None
    parts = [f"{len(missing)} base tensor(s) are not published (e.g. {missing[0]!r})" if missing else "",
             f"{len(extra)} published tensor(s) are not in the base checkpoint (e.g. {extra[0]!r})" if extra else ""]
    advice = hint if extra and fused else " (check the model against its checkpoint, rename=, tie_word_embeddings=)"
    return ("the snapshots' tensor names differ from the base checkpoint's in hf_config_dir, so the fleet will not "
            "load them: " + " and ".join(p for p in parts if p) + advice)


def shapes_note(published: Iterable[tuple[str, Shape]], checkpoint: dict[str, Shape | None] | None, *,
                where: str) -> str | None:
    """A warning when a published tensor has another shape than the tensor of that name in ``checkpoint``
    (the base checkpoint's shapes, or what transformers' ``save_pretrained`` writes: ``where`` says which).

    Why: the names alone can match while the layout does not. transformers 5 converts some models' tensors on
    loading (Qwen3-VL-MoE holds its experts transposed against its checkpoint's, ``[E, 2I, H]`` for ``[E, H, 2I]``,
    and its ``save_pretrained`` writes them as held), so the published tensor has the checkpoint's name and another
    shape, which the fleet's loader refuses on every publish."""
    if not checkpoint:
        return None
    bad = [(n, tuple(s), theirs) for n, s in published
           if (theirs := checkpoint.get(n)) is not None and tuple(theirs) != tuple(s)]
    if not bad:
        return None
    name, ours, theirs = bad[0]
    same = " (the same dims in another order: a transposed layout)" if sorted(ours) == sorted(theirs) else ""
    experts = all(n.endswith(_FUSED_EXPERT_SUFFIXES) and len(s) == 3 and t == (s[0], s[2], s[1]) for n, s, t in bad)
    fix = (": pass split=transpose_fused_experts to HotloadCallback (the layout of Qwen3-VL-MoE's checkpoints)"
           if experts else ": publish them in its layout (a split's part may give a dims order)")
    return (f"{len(bad)} published tensor(s) have another shape than in {where} (e.g. {name!r}: {list(ours)} "
            f"published, {list(theirs)} there{same}), so the fleet will not load these snapshots as that "
            f"checkpoint's tensors{fix}")
