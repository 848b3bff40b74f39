"""From module attribute paths to Hugging Face tensor names.

Wrappers that trainers put around a model (FSDP1, activation checkpointing, ``torch.compile``, DDP) insert
attribute segments into every parameter path. A rollout fleet loads the checkpoint with the plain HF names, so
the snapshot must be written under those, whatever wrappers the trainer happened to use. This module holds the
string side of that: stripping wrapper segments, applying the user's rename, and choosing which names of a
shared (tied) tensor to publish. The module walk that finds the tensors lives in :mod:`fsdp_hotload.fsdp`.

Example::

    clean_name("_orig_mod.model._fsdp_wrapped_module.layers.0._checkpoint_wrapped_module.mlp.weight")
    # -> "model.layers.0.mlp.weight"
    clean_name("module.lm_head.weight", wrapped={"module"})    # a DDP model
    # -> "lm_head.weight"
"""
from __future__ import annotations

import math
from typing import Any, Callable, Container, Hashable, Iterable, Sequence

# Attribute names that wrappers insert between a module and the module they wrap. They are stripped wherever
# they appear: no HF model uses them as real submodule names.
#   _fsdp_wrapped_module        FSDP1 (FullyShardedDataParallel)
#   _checkpoint_wrapped_module  torch.distributed.algorithms checkpoint_wrapper / offload_wrapper
#   _orig_mod                   torch.compile's OptimizedModule
#   _fpw_module                 FlatParamWrapper of early FSDP releases
#   _flat_param                 FSDP1's FlatParameter (a flat parameter's name maps to its owner module's path)
WRAPPER_SEGMENTS: frozenset[str] = frozenset(
    {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "_fpw_module", "_flat_param"}
)

# DDP and DataParallel keep the model as ``.module``. Unlike the segments above, "module" is a plausible real
# attribute name (a model's own top-level ``self.module``), so it is stripped only where the adapter found such a
# wrapper holding it (``wrapped`` of :func:`clean_name`, from :func:`fsdp_hotload.fsdp.wrapper_paths`).
HELD_MODULE_ATTR = "module"

# The output projection that HF drops from a checkpoint when ``tie_word_embeddings`` is set.
TIED_OUTPUT_SUFFIX = "lm_head.weight"

# A rename maps a cleaned path (a split's part: its name) to the published name, None to leave the tensor out, or
# ``(name, position)`` for a tensor that is one block of ``name``: the tensors given that name are concatenated
# along dim 0 in the order of their positions (a checkpoint that keeps q, k and v as one ``qkv`` tensor).
Rename = Callable[[str], "str | tuple[str, int] | None"]
# A split maps a tensor's cleaned path and full shape to the published tensors that tile it, each a contiguous
# range of its flattened elements: ``(name, first element, shape)``, or ``(name, first element, shape, dims)`` for
# one published as ``part.view(shape).permute(dims)`` (a checkpoint that stores it transposed), or ``(name, first
# element, shape, dims, as_shape)`` for one published as ``part.view(shape).permute(dims).reshape(as_shape)`` (rows
# reordered in groups, as a checkpoint's q and k permuted for RoPE); None publishes the tensor as it is.
Split = Callable[[str, "tuple[int, ...]"], "list[tuple[Any, ...]] | None"]
# A checked part: name, first element, shape (before ``dims``), ``dims`` (None: in that order), and the published
# shape where it is not the permuted one (None: it is).
Part = tuple[str, int, tuple[int, ...], "tuple[int, ...] | None", "tuple[int, ...] | None"]

# Parameter-name segments of unmerged low-rank adapters (peft's LoRA and its DoRA magnitudes).
ADAPTER_SEGMENTS: frozenset[str] = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                                              "lora_magnitude_vector"})


def clean_name(name: str, wrapped: Container[str] = frozenset()) -> str:
    """Strip wrapper segments from a parameter/buffer path, leaving the name the unwrapped model would use.

    ``wrapped`` holds the raw paths (``"module"``, ``"_orig_mod.module"``) through which a DDP-style wrapper holds
    the model; those segments go too, and any other ``module`` stays. Raises ValueError when nothing is left (the
    path named a wrapper itself, not a tensor).
    """
    parts: list[str] = []
    raw = ""
    for seg in name.split("."):
        raw = f"{raw}.{seg}" if raw else seg
        if seg not in WRAPPER_SEGMENTS and raw not in wrapped:
            parts.append(seg)
    if not parts or any(p == "" for p in parts):
        raise ValueError(f"tensor path {name!r} has no name left after stripping wrapper segments")
    return ".".join(parts)


def adapter_note(paths: Iterable[str]) -> str | None:
    """A warning when the model holds unmerged LoRA adapters (None otherwise).

    Why: the fleet serves the base architecture, whose checkpoint has no adapter tensors, and the policy is
    W + B·A·scale, which no single published tensor holds. Publishing the adapters fails the fleet's load;
    dropping them with ``rename`` publishes the base model without the update, which loads and is silently
    wrong. Adapters must be merged into the weights that are published (see the README).
    """
    found = [p for p in paths if ADAPTER_SEGMENTS.intersection(p.split("."))]
    if not found:
        return None
    return (f"the model holds {len(found)} unmerged LoRA adapter tensor(s) (e.g. {found[0]!r}): the fleet serves "
            "merged weights, so publish a merged state dict (merge_and_unload, or W + B@A*scale per step through "
            "TensorPublisher) rather than the adapters or the base weights alone")


def is_tied_output(name: str) -> bool:
    """True for ``lm_head.weight`` and prefixed forms (``language_model.lm_head.weight``)."""
    return name == TIED_OUTPUT_SUFFIX or name.endswith("." + TIED_OUTPUT_SUFFIX)


def apply_rename(raw: str, rename: Rename | None) -> tuple[str, int | None] | None:
    """The published name for a cleaned path, with its position where it is a block of a joined tensor:
    ``rename(raw)`` (None drops the tensor) or ``raw`` itself."""
    if rename is None:
        return raw, None
    try:
        out = rename(raw)
    except Exception as exc:  # noqa: BLE001 - re-raised with the tensor named (a bare KeyError said nothing)
        raise ValueError(f"rename({raw!r}) raised {type(exc).__name__}: {exc}") from exc
    if out is None:
        return None
    name, position = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if position is not None:
        try:
            if isinstance(position, bool):
                raise TypeError(position)
            position = _whole(position)
        except (TypeError, ValueError):
            name = None  # a position that is not a whole number: refused below
    if not isinstance(name, str) or not name:
        raise ValueError(f"rename({raw!r}) returned {out!r}; expected a non-empty str, (name, int position) for a "
                         "block of a tensor joined along dim 0, or None to drop the tensor")
    return name, position


def plan_names(
    slots: Sequence[tuple[str, Hashable]],
    *,
    rename: Rename | None = None,
    tie_word_embeddings: bool | None = None,
) -> list[tuple[str, int, int | None]]:
    """Choose the published names for a model's tensors.

    ``slots`` lists every place a tensor is registered, in module order, as ``(cleaned path, key)``; slots
    that share a tensor (tied weights, a module reachable by two paths) have equal keys. Returns
    ``(published name, index of the slot it comes from, position)`` in slot order; the position is None except
    for the blocks of a tensor joined along dim 0 (``rename`` gave ``(name, position)``), which share the name.

    Tied tensors follow the HF convention: with ``tie_word_embeddings=True`` the ``lm_head.weight`` name of a
    tensor shared with the input embedding is omitted (an ``lm_head`` shared with nothing is an error); every
    other name is published, each from its tensor's data, as with False. None (the config does not say) follows
    the model: an ``lm_head`` that is the input embedding's tensor is omitted, one of its own is published. Why:
    ``save_pretrained`` leaves the key out when it equals the model class's default, which is True for some
    classes (GPT-2) and False for others (Llama), and transformers ties the module's weights only when it is True.
    """
    named: list[tuple[str, int, int | None]] = []
    for i, (raw, _key) in enumerate(slots):
        out = apply_rename(raw, rename)
        if out is not None:
            named.append((out[0], i, out[1]))

    by_key: dict[Hashable, list[tuple[str, int, int | None]]] = {}
    for entry in named:
        by_key.setdefault(slots[entry[1]][1], []).append(entry)

    keep: set[int] = set()
    for group in by_key.values():
        # Names that point at the same tensor twice (same module under two paths, renamed alike) collapse.
        distinct: dict[tuple[str, int | None], int] = {}
        for out, i, position in group:
            distinct.setdefault((out, position), i)
        outputs = [n for n in distinct if is_tied_output(n[0])]
        inputs = [n for n in distinct if not is_tied_output(n[0])]
        if outputs and (tie_word_embeddings or (tie_word_embeddings is None and inputs)):
            # Only the output projection is left out (the receiver ties it to the input embedding); any other
            # name sharing a tensor is published as it is without tying.
            if not inputs:
                key = slots[group[0][1]][1]
                dropped = [raw for raw, k in slots if k == key and not is_tied_output(raw)]
                if dropped:  # shared after all: the rename left out the name it is shared under
                    raise ValueError(
                        f"tie_word_embeddings=True and {outputs[0][0]!r} is the input embedding's tensor, but "
                        f"the rename gives that tensor no name but this one (its name {dropped[0]!r} is renamed or "
                        "dropped), which tying leaves out: nothing would publish it. Keep the embedding's name in "
                        "the rename, or pass tie_word_embeddings=False.")
                raise ValueError(
                    f"tie_word_embeddings=True but {outputs[0][0]!r} is a tensor of its own, not shared with the "
                    "input embedding; publishing without it would lose weights. Pass tie_word_embeddings=False "
                    "(or None), or tie the weights in the model."
                )
            keep.update(distinct[n] for n in inputs)
        else:
            keep.update(distinct.values())

    result = [entry for entry in named if entry[1] in keep]
    by_name: dict[str, list[tuple[int, int | None]]] = {}
    for out, i, position in result:
        by_name.setdefault(out, []).append((i, position))
    for out, entries in by_name.items():
        first: dict[int | None, int] = {}  # position -> slot
        for i, position in entries:
            if position in first:  # two whole tensors, or two blocks at one position
                j, how = first[position], "" if position is None else f" at position {position}"
            elif first and (position is None or None in first):
                j, how = next(iter(first.values())), " (one whole, one as a block of a tensor joined along dim 0)"
            else:
                first[position] = i
                continue
            what = "one tensor would be published twice" if slots[i][1] == slots[j][1] else \
                "two different tensors would be published"
            raise ValueError(f"{what} as {out!r}{how}: {slots[j][0]!r} and {slots[i][0]!r} (check the rename "
                             "function)")
    return result


def split_parts(split: Split, path: str, shape: tuple[int, ...]) -> list[Part] | None:
    """``split(path, shape)``, checked: its parts by first element, with int starts and dims, tiling the tensor,
    each as ``(name, first element, shape, dims or None, published shape or None)``.

    Why: a split is user code run over every tensor of the model, and what goes wrong in it or in what it returns
    would otherwise surface as an unpacking or comparison error from inside the walk, with no word of which
    tensor it was dividing, or not at all (dims (-4, -32) have the element count of (4, 32)). Every such case is
    a ValueError that names the tensor."""
    where = f"split({path!r}, {shape})"
    try:
        parts = split(path, shape)
    except Exception as exc:  # noqa: BLE001 - re-raised with the tensor named, the original chained
        raise ValueError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if parts is None:
        return None
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Iterable):
        raise ValueError(f"{where} returned {parts!r}: expected a list of (name, first element, shape) or None")
    out: list[Part] = []
    for part in parts:
        try:
            name, start, dims, *order = part
            if len(order) > 2:
                raise ValueError(part)
            start, dims = _whole(start), tuple(_whole(d) for d in dims)
            perm = None if not order or order[0] is None else tuple(_whole(d) for d in order[0])
            as_shape = None if len(order) < 2 or order[1] is None else tuple(_whole(d) for d in order[1])
        except (TypeError, ValueError):
            raise ValueError(f"{where} returned the part {part!r}: expected (name, first element, shape), (name, "
                             "first element, shape, dims order) or (name, first element, shape, dims order, "
                             "published shape), the element and the dims integers") from None
        if not isinstance(name, str) or not name or any(d <= 0 for d in dims):
            raise ValueError(f"{where} returned the part {part!r}: expected a non-empty name and dims above 0")
        if perm is not None and sorted(perm) != list(range(len(dims))):
            raise ValueError(f"{where} returned the part {part!r}: its dims order {list(perm)} is not an order of "
                             f"its {len(dims)} dims")
        if as_shape is not None and (math.prod(as_shape) != math.prod(dims) or any(d <= 0 for d in as_shape)):
            raise ValueError(f"{where} returned the part {part!r}: its published shape {list(as_shape)} does not "
                             f"hold its {math.prod(dims)} elements")
        perm = None if perm == tuple(range(len(dims))) else perm
        permuted = dims if perm is None else tuple(dims[d] for d in perm)
        out.append((name, start, dims, perm, None if as_shape == permuted else as_shape))
    out.sort(key=lambda p: p[1])
    pos = 0
    for name, start, dims, _perm, _as_shape in out:
        if start != pos:
            raise ValueError(f"{where} must return (name, start, shape) parts that tile the tensor's elements in "
                             f"order; the part at element {pos} is {(name, start, dims)}")
        pos += math.prod(dims)
    if pos != math.prod(shape):
        raise ValueError(f"{where} covers {pos} of its {math.prod(shape)} elements")
    return out


def _whole(value: Any) -> int:
    """``value`` as an int when it is a whole number (numpy integers, 64.0), else ValueError."""
    out = int(value)
    if out != value:
        raise ValueError(f"{value!r} is not a whole number")
    return out


def split_fused_experts(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
    """A ``split`` for MoE experts as transformers 5 builds them, back to the per-expert tensors of checkpoints.

    Why: transformers 5 fuses each projection of a sparse MoE block's experts into one 3-D parameter, while the
    checkpoints of those models, and the fleet's loaders, name each expert's 2-D weight; a snapshot under the
    fused names is refused. This is the layout of the ``qwen2_moe`` family (Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4.5
    MoE, ...) and of Mixtral (rename ``.mlp.`` to ``.block_sparse_moe.`` and gate/up/down to w1/w3/w2 there):

    * ``<p>.experts.gate_up_proj``, shape ``(E, 2I, H)``: ``<p>.experts.<e>.gate_proj.weight`` is ``[e, :I]`` and
      ``<p>.experts.<e>.up_proj.weight`` is ``[e, I:]``, each ``(I, H)``;
    * ``<p>.experts.down_proj``, shape ``(E, H, I)``: ``<p>.experts.<e>.down_proj.weight`` is ``[e]``;
    * ``<p>.experts.up_proj``, shape ``(E, I, H)``, of experts without a gate (Nemotron-H):
      ``<p>.experts.<e>.up_proj.weight`` is ``[e]``.

    Each is a contiguous range of the fused tensor, so the split moves no bytes. Models whose checkpoints keep
    experts fused (gpt-oss, Llama 4, with a transposed layout) must not use it. Every other path is left alone.

    Example::

        HotloadCallback(model, cfg, split=split_fused_experts)
    """
    if len(shape) != 3:
        return None
    experts, rows, cols = (int(d) for d in shape)
    if path.endswith(".experts.gate_up_proj") and rows % 2 == 0:
        head, half = path[:-len("gate_up_proj")], rows // 2 * cols
        return [part for e in range(experts) for part in (
            (f"{head}{e}.gate_proj.weight", 2 * e * half, (rows // 2, cols)),
            (f"{head}{e}.up_proj.weight", (2 * e + 1) * half, (rows // 2, cols)))]
    if path.endswith((".experts.down_proj", ".experts.up_proj")):
        head, proj = path.rsplit(".", 1)
        return [(f"{head}.{e}.{proj}.weight", e * rows * cols, (rows, cols)) for e in range(experts)]
    return None


def transpose_fused_experts(path: str, shape: tuple[int, ...]) -> list[tuple[Any, ...]] | None:
    """A ``split`` that publishes transformers 5's fused expert tensors whole, with their last two dims swapped.

    Why: Qwen3-VL-MoE's checkpoints store ``<p>.experts.gate_up_proj`` as ``(E, H, 2I)`` and
    ``<p>.experts.down_proj`` as ``(E, I, H)``, under the names transformers 5's model uses, while the model holds
    them as ``(E, 2I, H)`` and ``(E, H, I)`` (transformers transposes them on loading, and its ``save_pretrained``
    keeps the model's layout). The fleet loads by the checkpoint's layout. Each rank's part is its shard viewed
    transposed, so no bytes move until the staging copy, which reads them in the published order. Square ones
    (``H == 2I``) are transposed too: the checkpoint's layout is transposed whatever the shapes (transformers,
    telling the layouts apart by shape, cannot load such a checkpoint right, and the start-up check cannot see
    it). Every other path is left alone.

    Example::

        HotloadCallback(model, cfg, split=transpose_fused_experts)
    """
    if len(shape) == 3 and path.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return [(path, 0, tuple(int(d) for d in shape), (0, 2, 1))]
    return None
