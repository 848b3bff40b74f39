"""Which dtype each published tensor has in a snapshot.

Why per tensor: one ``snapshot_dtype`` (bf16) suits the matrices, but some checkpoints keep a few floating
tensors in fp32 on purpose (DeepSeek-V3 stores its MoE router bias, ``mlp.gate.e_score_correction_bias``, in
fp32), and rounding those to bf16 changes the policy the fleet serves (here: which experts a token reaches).
``dtype_overrides`` maps globs on the published (Hugging Face) name to a dtype, or to ``"keep"`` for the
trainer's own dtype. The first matching glob wins; tensors no glob matches get ``snapshot_dtype``. Integer and
bool tensors always keep their dtype, and so do 8-bit floats unless a glob names them: they are quantised weights,
whose values mean something only with their scales and the config's ``quantization_config`` (which is dropped
from snapshots without quantised tensors), so a silent cast to bf16 would publish a different model.

Example::

    policy = DtypePolicy.of("bfloat16", {"*.e_score_correction_bias": "keep", "*.norm.weight": "float32"})
    policy.code("model.layers.3.mlp.gate.e_score_correction_bias", torch.float32)   # "F32"
    policy.code("model.layers.3.mlp.gate.weight", torch.float32)                    # "BF16"
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping

import torch

from .arc.dtypes import DTYPES, FLOAT_CODES, code_from_name, itemsize, torch_name
from .arc.errors import ArcError

KEEP = "keep"
# Masters are kept wide on purpose, and publishing them narrower is the expected mixed-precision path; a cast
# from any other floating dtype to one no wider is a change of format the user may not know about.
_MASTER_CODES = frozenset({"F32", "F64"})


_ALIASES = {"bf16": "BF16", "fp16": "F16", "half": "F16", "fp32": "F32", "float": "F32", "fp64": "F64",
            "double": "F64"}


def float_code(name: str, what: str, *, eight_bit: bool = True) -> str:
    """The safetensors code of a floating dtype name (``bfloat16``, ``BF16``, ``bf16``, ``half``, ...);
    ValueError names ``what`` and lists only what ``what`` accepts (no 8-bit dtypes unless ``eight_bit``)."""
    text = str(name).strip()
    try:
        code: str | None = code_from_name(_ALIASES.get(text.lower(), text))
    except ArcError:
        try:  # BFLOAT16, Float32: torch's names in another case
            code = code_from_name(text.lower())
        except ArcError:
            code = None
    if code is not None and not eight_bit and code in FLOAT_CODES and itemsize(code) == 1:
        raise ValueError(f"{what} {name!r} would cast every floating tensor to 8 bits without scales; use a 16-bit "
                         "or wider dtype (8-bit weights the trainer holds keep their dtype, and dtype_overrides "
                         "can name single tensors)")
    if code is None or code not in FLOAT_CODES:
        accepted = ", ".join(torch_name(c) for c in DTYPES if c in FLOAT_CODES and (eight_bit or itemsize(c) > 1))
        raise ValueError(f"{what} {name!r} is not a floating dtype; accepted: {accepted} "
                         "(or their safetensors codes, e.g. BF16, or bf16, fp16, half, fp32, float)")
    return code


def override_dtype(pattern: str, value: str) -> str:
    """A ``dtype_overrides`` value normalised to its torch name, or ``"keep"``; ValueError names the glob."""
    if value.strip().lower() == KEEP:
        return KEEP
    try:
        return torch_name(float_code(value, f"dtype_overrides[{pattern!r}]"))
    except ValueError as exc:
        raise ValueError(f"{exc}, or 'keep' for the trainer's own dtype") from None


@dataclass(frozen=True)
class DtypePolicy:
    """``snapshot_dtype`` plus the ordered ``(glob, dtype code or "keep")`` overrides."""

    default: str
    overrides: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, snapshot_dtype: str, overrides: Mapping[str, str] | None = None) -> "DtypePolicy":
        """From the config's ``snapshot_dtype`` and ``dtype_overrides``; ValueError names a bad value."""
        default = float_code(snapshot_dtype, "snapshot_dtype", eight_bit=False)  # as the config checks it
        pairs = []
        for pattern, value in (overrides or {}).items():
            if not pattern:
                raise ValueError("dtype_overrides has an empty glob")
            kept = override_dtype(pattern, value)
            pairs.append((pattern, KEEP if kept == KEEP else code_from_name(kept)))
        return cls(default, tuple(pairs))

    def code(self, name: str, dtype: torch.dtype) -> str:
        """The published dtype code of tensor ``name`` whose trainer dtype is ``dtype``.

        Raises ValueError for dtypes a safetensors snapshot cannot hold (complex, or unknown to the format)."""
        if dtype.is_complex:
            raise ValueError(f"tensor {name!r} is complex ({dtype}); safetensors snapshots cannot hold it: leave it "
                             "out (a rename returning None for it, include_buffers=False for a buffer such as "
                             "RoPE's freqs_cis, or a dict without it)")
        try:
            source = code_from_name(str(dtype))
        except ArcError as exc:
            why = str(exc).partition(": ")[2] or "leave it out with a rename returning None for it"
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which snapshots cannot hold: {why}") from None
        if not dtype.is_floating_point:
            return source
        target = next((c for p, c in self.overrides if fnmatch.fnmatchcase(name, p)), None)
        if target is None:
            return source if itemsize(source) < 2 else self.default  # quantised weights keep their format
        return source if target == KEEP else target

    def notes(self, sources: Mapping[str, torch.dtype]) -> list[str]:
        """Warnings about a model's tensors under this policy: globs that match no floating tensor (a typo
        would otherwise publish the wrong dtype in silence) or decide none (an earlier glob takes them all), casts
        between two narrow formats (an fp16 trainer published as bf16 loses 3 mantissa bits; bf16 published as fp16
        turns values above 65504 into inf; fp32 tensors in a mostly 16-bit model; any tensor cast to 8 bits by a
        glob, which has no scales to go with it), an FP8 model's scale tensors cast to another dtype, and its 8-bit
        weights widened by a glob while it holds scales (the raw values without their scales: another model)."""
        out = []
        floating = [n for n, d in sources.items() if d.is_floating_point]
        for k, (pattern, _) in enumerate(self.overrides):
            matched = [n for n in floating if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                out.append(f"dtype_overrides glob {pattern!r} matches no floating tensor of the model")
                continue
            # the first glob that matches a name decides it: a later one taken over for every tensor it names
            # does nothing (the router bias under a "model.layers.*" entry listed first)
            earlier = [next((p for p, _ in self.overrides[:k] if fnmatch.fnmatchcase(n, p)), None) for n in matched]
            if all(e is not None for e in earlier):
                out.append(f"dtype_overrides glob {pattern!r} decides none of the {len(matched)} tensor(s) it "
                           f"matches (e.g. {matched[0]!r}): the earlier glob {earlier[0]!r} takes them, since the "
                           "first match wins; list the narrower glob first")
        codes = {n: (code_from_name(str(sources[n])), self.code(n, sources[n])) for n in floating}  # source, target
        # fp32 tensors are masters when most tensors are (mixed precision); among mostly 16-bit ones they were kept
        # wide on purpose (transformers' _keep_in_fp32_modules: DeepSeek-V3's router gate and bias)
        # (an FP8 model's 8-bit weights and fp32 scales do not count: the scales note below covers the scales)
        weights = [s for n, (s, _) in codes.items() if itemsize(s) >= 2 and "scale" not in n.rsplit(".", 1)[-1]]
        masters = 2 * sum(s in _MASTER_CODES for s in weights) > len(weights)
        fp8 = any(itemsize(s) < 2 for s, _ in codes.values())
        narrowed: dict[tuple[str, str, str | None], list[str]] = {}  # (source, target, the glob that cast them)
        for name, (source, target) in codes.items():
            if source != target and itemsize(target) <= itemsize(source) and not (
                    masters and source in _MASTER_CODES and itemsize(target) >= 2) and not (
                    fp8 and "scale" in name.rsplit(".", 1)[-1]):
                glob = next((p for p, _ in self.overrides if fnmatch.fnmatchcase(name, p)), None)
                narrowed.setdefault((source, target, glob), []).append(name)
        narrow_sources = {s for s, _ in codes.values() if s not in _MASTER_CODES and itemsize(s) >= 2}
        for (source, target, glob), names in narrowed.items():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            if glob is not None:
                fix = f"they match dtype_overrides glob {glob!r}: narrow or drop it, or list {{'<their glob>': " \
                      "'keep'} before it"
            elif source in _MASTER_CODES:
                fix = (f"most of the model is {', '.join(torch_name(s) for s in sorted(narrow_sources))}, so these "
                       "were likely kept wide on purpose (a router's gate or bias): add dtype_overrides "
                       "{'<their glob>': 'keep'}")
            elif narrow_sources == {source}:
                fix = f"set snapshot_dtype={torch_name(source)!r}"
            else:  # snapshot_dtype would cast the model's other narrow format instead (an fp16 head on a bf16 model)
                fix = (f"add dtype_overrides {{'<their glob>': 'keep'}} (the model also holds "
                       f"{', '.join(torch_name(s) for s in sorted(narrow_sources - {source}))} tensors)")
            out.append(f"{len(names)} {torch_name(source)} tensor(s) ({names[0]!r}{more}) are published as "
                       f"{torch_name(target)}, a lossy change of format; {fix} to publish them as trained")
        quantised = [n for n, (_, target) in codes.items() if itemsize(target) < 2]
        scales = [n for n, (source, target) in codes.items()
                  if "scale" in n.rsplit(".", 1)[-1] and source != target and itemsize(target) >= 2]
        held_scales = [n for n in floating if "scale" in n.rsplit(".", 1)[-1]]
        widened: dict[tuple[str, str], list[str]] = {}  # (glob, target): the 8-bit weights (not scales) it widens
        for name, (source, target) in codes.items():
            if itemsize(source) < 2 <= itemsize(target) and "scale" not in name.rsplit(".", 1)[-1]:
                glob = next(p for p, _ in self.overrides if fnmatch.fnmatchcase(name, p))
                widened.setdefault((glob, target), []).append(name)
        for (glob, target), names in widened.items() if held_scales else ():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            out.append(f"{len(names)} 8-bit tensor(s) ({names[0]!r}{more}) are cast to {torch_name(target)} by "
                       f"dtype_overrides glob {glob!r}, but the model holds scale tensors ({held_scales[0]!r}): a "
                       "cast keeps each raw value without its scale, so the fleet would serve another model; "
                       "dequantise in the trainer before publishing, or add {'<their glob>': 'keep'} before that "
                       "glob to publish them as quantised weights")
        if quantised and scales:
            more = f" and {len(scales) - 1} more" if len(scales) > 1 else ""
            out.append(f"{len(quantised)} 8-bit tensor(s) are published as quantised weights, but {len(scales)} "
                       f"scale tensor(s) ({scales[0]!r}{more}) are cast to another dtype; add dtype_overrides "
                       "{'*scale*': 'keep'} to publish them as trained")
        return out
