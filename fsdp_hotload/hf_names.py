"""A transformers model's checkpoint names, derived from transformers itself, as a ``split`` and a ``rename``.

Why: transformers 5 loads a checkpoint through a conversion mapping (renamed modules; each projection of a MoE
block's experts fused into one 3-D parameter) and reverts it when it saves, so a model's attribute names are not
always its checkpoint's, and the fleet loads by the checkpoint's. Where every tensor ``save_pretrained`` writes is
one of the model's tensors renamed, or a contiguous range of one (``naming.split_fused_experts``; rows of a tensor
the model concatenated on loading), or runs of rows of the model's tensors joined along dim 0 (a checkpoint's
``qkv`` that the model splits on loading; a tensor's rows regrouped, as RoPE's permutation within each head does,
count as one run, a reshaped permuted part), the callback can publish under the checkpoint's names with no copy.
:func:`checkpoint_names` finds the ``split`` and ``rename`` that do so and checks them against transformers' own
revert: the names at the model's real shapes (on meta tensors, no memory), and which elements each part holds on a
small probe whose values are their positions (a fused expert tensor at a few rows and columns; another tensor the
revert changes at its real rows, each of a few distinct small dims). A tensor that transformers transposes on
loading is published transposed where the base checkpoint stores it so (Qwen3-VL-MoE's experts; transformers' own
``save_pretrained`` keeps the model's layout, so only the base's shapes can tell). Anything else (values reordered
within rows, more than ``MAX_ROW_RUNS`` runs of rows in one saved tensor, an unknown conversion) gives None, and
the start-up checks warn instead.

Example::

    plan = checkpoint_names(model, lambda: full_tensor_specs(model))
    if plan is not None:
        chunks = local_chunks(model, split=plan.split, rename=plan.rename)
"""
from __future__ import annotations

import bisect
import itertools
import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .naming import Rename, Split, clean_name, split_fused_experts

log = logging.getLogger("fsdp_hotload")

Specs = Callable[[], Iterable[tuple[str, tuple[int, ...], str]]]
Base = Callable[[], "dict[str, tuple[int, ...] | None] | None"]  # the base checkpoint's shapes, read when asked
# Most values of the probe of a tensor that the revert changes (8 bytes each, see _row_probe): larger get no plan.
MAX_PROBE_ELEMENTS = 1 << 22
# Most runs of rows of the model's tensors that one saved tensor may be made of. A join has a few (q, k and v), and
# one tensor's rows regrouped (RoPE's permutation) count as one; rows of two tensors interleaved have one per row,
# each a chunk that the hook copies and every delta carries (as runs, a vision tower's q and k came to ~120k chunks,
# a hook of 0.3-1 s and deltas 4x larger and 20x slower than the model published as it is: benchmarks/RESULTS.md),
# so such a checkpoint gets no plan.
MAX_ROW_RUNS = 64


@dataclass(frozen=True)
class NamesPlan:
    """How the model's tensors become the checkpoint's: ``split`` (None: nothing split) then ``rename``."""

    split: Split | None
    rename: Rename  # may give (name, position): a block of a tensor joined along dim 0
    split_tensors: int  # the model's tensors divided into parts (per expert, or into ranges of rows)
    changed: dict[str, str]  # published name -> checkpoint name, where they differ
    transposed: tuple[str, ...] = ()  # tensors published with their last two dims swapped, as the base stores them
    joined: int = 0  # the checkpoint's tensors published as blocks joined along dim 0 (``rename`` gives positions)


def _revert() -> Callable[[Any, dict[str, Any]], dict[str, Any]] | None:
    """transformers' revert of its conversion mapping, where transformers is already imported (a model of it has
    been built; importing it here would cost seconds for nothing) and has one."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except Exception:  # noqa: BLE001 - a version without the mapping: nothing to follow
        return None
    return revert_weight_conversion


def transformers_model(model: Any) -> Any:
    """The transformers model that ``model`` is, or holds through wrappers only (``torch.compile``'s
    ``_orig_mod``, FSDP1's ``_fsdp_wrapped_module``, a checkpoint wrapper, DDP's ``module``: the segments
    :func:`naming.clean_name` strips, so the published names are the inner model's own); None otherwise.

    Why: a wrapped model is not itself a ``PreTrainedModel``, and hf_names then did nothing, silently: a compiled
    or FSDP1-wrapped model published its attribute names, which the fleet refuses."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    named = getattr(model, "named_modules", None)
    if named is None:
        return None
    from .fsdp import wrapper_paths
    from .naming import clean_name

    wrapped = wrapper_paths(model)
    for path, mod in named():
        if isinstance(mod, PreTrainedModel):  # the outermost one, which is the model only if held by wrappers
            try:
                clean_name(path, wrapped)
            except ValueError:  # nothing left of its path: wrapper segments only
                return mod
            return None  # a submodule of a model of the user's own
    return None


def transformers_saved_shapes(model: Any, specs: Specs) -> dict[str, tuple[int, ...]] | None:
    """The tensors transformers' ``save_pretrained`` writes for ``model`` (a transformers model), by name with
    their shapes, given the model's own tensor names and shapes (``specs()``, without split or rename; called only
    for such a model); None for another model, or where transformers cannot say. Reverted on meta tensors: no
    memory."""
    revert = _revert()
    model = transformers_model(model) if revert is not None else None
    if model is None:
        return None
    import torch

    try:
        aliases = tied_aliases(model)
        saved = revert(model, {n: torch.empty(s, device="meta") for n, s, _d in specs() if n not in aliases})
        return {k: tuple(int(d) for d in _first(v).shape) for k, v in saved.items()}
    except Exception as exc:  # noqa: BLE001 - a warning's input: its absence must not stop training
        log.debug("hotload: transformers could not name the checkpoint's tensors: %s", exc)
        return None


def tied_aliases(model: Any) -> set[str]:
    """The names ``save_pretrained`` leaves out of a transformers model's checkpoint as aliases of a tensor it
    writes under another name: among names sharing one tensor, those matching the model's ``_tied_weights_keys``
    but the last (T5's ``encoder.embed_tokens.weight`` beside ``shared.weight``), as transformers 5 decides it.
    Why: the tie handling here knows ``lm_head.weight`` only, so the check of the published names against what
    ``save_pretrained`` writes must know what else it drops. Empty where transformers does not say."""
    import re

    try:
        from transformers.modeling_utils import _get_tied_weight_keys

        patterns = [re.compile(p) for p in _get_tied_weight_keys(model)]
    except Exception:  # noqa: BLE001 - another transformers: the check falls back to the tied lm_head alone
        return set()
    groups: dict[int, set[str]] = {}
    for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                   model.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(t), set()).add(clean_name(name))
    out: set[str] = set()
    for names in groups.values():
        tied = [n for n in sorted(names) if any(p.search(n) for p in patterns)]
        out.update(tied[:len(names) - 1])  # at least one name of the tensor stays
    return out


def checkpoint_names(model: Any, specs: Specs, base: Base | None = None) -> NamesPlan | None:
    """The ``split`` and ``rename`` that publish ``model`` under the names its ``save_pretrained`` writes, checked
    against transformers' revert; None when the names are already those, or the model is not a transformers model,
    or its conversion is not renames, contiguous ranges and joins along dim 0 (see the module docstring). Where the
    names are already those, tensors that transformers transposes on loading and that the base checkpoint
    (``base()``: its shapes by name, ``hf_config.base_tensor_shapes``) stores transposed are published so
    (:func:`_transposes`)."""
    revert = _revert()
    model = transformers_model(model) if revert is not None else None
    if model is None:
        return None
    import torch

    own = [(n, tuple(int(d) for d in s)) for n, s, _d in specs()]
    try:
        metas = {n: torch.empty(s, device="meta") for n, s in own}
        saved = revert(model, dict(metas))
        saved_shapes = {k: tuple(_first(v).shape) for k, v in saved.items()}
        if set(saved_shapes) == {n for n, _s in own}:  # renames within the same names do not exist
            transposed = _transposes(model, own, base)
            if not transposed:
                return None
            names = set(transposed)
            return NamesPlan(lambda path, shape: [(path, 0, shape, (0, 2, 1))] if path in names else None,
                             lambda name: name, 0, {}, tuple(transposed))
        kept = {id(_first(v)) for v in saved.values()}  # tensors the revert passes on as they are (renamed or not)
        probe, parts, origin = {}, {}, {}
        rows: list[tuple[int, tuple[int, ...], str, tuple[int, ...]]] = []  # (first value, probe, name, real shape)
        at = 0
        for name, shape in own:
            small = _probe_shape(name, shape)
            row = _row_probe(shape) if small is None and id(metas[name]) not in kept else None
            if row is not None:
                # changed by the revert: its real rows, each a few positions long (distinct sizes), so that a cut
                # along dim 0 (the reverse of a concatenation) shows which rows each saved tensor is, and anything
                # done within the rows (a transpose, a reordering) shows as other shapes or values
                n = math.prod(row)
                probe[name] = torch.arange(at, at + n, dtype=torch.int64).reshape(row)
                rows.append((at, row, name, shape))
                at += n
                continue
            if small is None:  # not split: a meta tensor of its own, found again by identity
                probe[name] = metas[name]
                origin[id(probe[name])] = name
                continue
            n = small[0] * small[1] * small[2]
            probe[name] = torch.arange(at, at + n, dtype=torch.int64).reshape(small)
            parts[(at, small)] = (name, name)  # saved whole (a checkpoint that keeps the experts fused)
            for part, start, part_shape in split_fused_experts(name, small) or []:
                parts[(at + start, part_shape)] = (part, name)
            at += n
        rename: dict[str, str | tuple[str, int]] = {}
        divided: set[str] = set()  # fused tensors saved per expert
        cut: dict[str, list[tuple[str, int, tuple[int, ...]]]] = {}  # tensors saved as ranges of rows
        # tensors saved with dim d regrouped, (part, d, b, c): viewed as (n / (b c), b, c), the last two swapped (c
        # None: n / b)
        regrouped: dict[str, tuple[str, int, int, int | None]] = {}
        stacked: set[str] = set()  # fused tensors whose parts are saved stacked, each projection of all experts
        flipped: dict[str, str] = {}  # matrices saved transposed: the saved name
        for target, t in revert(model, probe).items():
            t = _first(t)
            if t.device.type == "meta":
                source = origin.get(id(t))
            else:  # a probe part: which of our parts (or whole tensors) holds exactly these elements, in this order
                flat = t.reshape(-1)
                first = int(flat[0]) if flat.numel() else -1
                source, whole = parts.get((first, tuple(t.shape)), (None, None))
                if source is not None and not _consecutive(flat, first):
                    if source == whole and target not in rename and _halves_interleaved(flat, first, tuple(t.shape)):
                        # a fused expert tensor saved with its two halves' rows interleaved in each expert (Inkling-2)
                        regrouped[whole] = (target, 1, 2, None)
                        rename[target] = target
                        continue
                    source = None
                if source is not None and source != whole:
                    divided.add(whole)
                per_expert = _stacked(parts, t) if source is None else None
                if per_expert and not any(part in rename for part, _whole in per_expert):
                    # one expert's part per index of dim 0: a checkpoint that stacks each projection of the experts
                    rename.update((part, (target, e)) for e, (part, _whole) in enumerate(per_expert))
                    stacked.update(whole for _part, whole in per_expert)
                    continue
                turned = _transposed_rows(rows, t) if source is None else None
                if turned is not None and turned not in flipped and target not in rename:
                    # a matrix the checkpoint stores transposed (Ernie-4.5-VL-MoE's routers): one permuted part
                    flipped[turned] = target
                    rename[target] = target
                    continue
                runs = _segments(_row_runs(rows, t)) if source is None else None
                if runs and len(runs) > MAX_ROW_RUNS:
                    log.debug("hotload: transformers saves %r as %d runs of rows of the model's tensors, which would "
                              "cost a chunk each on every publish", target, len(runs))
                    return None
                if runs and not any(name in rename for name, *_rest in runs):
                    # rows of the model's tensors, in order: one tensor renamed, a range of its rows, a tensor with
                    # its rows regrouped (RoPE's permutation), or several of these joined (a qkv the model splits)
                    for i, (name, row, n, real, groups) in enumerate(runs):
                        key = target if len(runs) == 1 else (target, i)
                        part = target if len(runs) == 1 else f"{target}[{i}]"
                        if groups is not None:
                            regrouped[name] = (part, 0, groups[1], groups[2])
                            rename[part] = key
                        elif row == 0 and n == real[0]:
                            rename[name] = key
                        else:
                            cut.setdefault(name, []).append((part, row * math.prod(real[1:]), (n, *real[1:])))
                            rename[part] = key
                    continue
            if source is None or source in rename:
                log.debug("hotload: transformers saves %r as nothing hotload can publish in place", target)
                return None
            rename[source] = target
    except Exception as exc:  # noqa: BLE001 - an unknown conversion: the start-up names check warns instead
        log.debug("hotload: transformers' checkpoint names could not be followed: %s", exc)
        return None
    shapes = dict(own)
    for name, pieces in cut.items():  # each tensor's rows, all of them, once and in order
        pieces.sort(key=lambda p: p[1])
        real = shapes[name]
        if [p[1] for p in pieces] != list(itertools.accumulate((math.prod(p[2]) for p in pieces[:-1]), initial=0)) \
                or sum(math.prod(p[2]) for p in pieces) != math.prod(real):
            return None

    def split(path: str, shape: tuple[int, ...]) -> list[tuple[Any, ...]] | None:
        if path in regrouped:  # dim d as (a, b, c), published as (a, c, b): a permuted part, reshaped back
            part, d, b, c = regrouped[path]
            c = c or shape[d] // b
            view = (*shape[:d], shape[d] // (b * c), b, c, *shape[d + 1:])
            dims = (*range(d + 1), d + 2, d + 1, *range(d + 3, len(shape) + 2))
            return [(part, 0, view, dims, tuple(shape))]
        if path in flipped:
            return [(flipped[path], 0, shape, (1, 0), (shape[1], shape[0]))]
        if path in stacked:  # each expert's part a block (1, rows, cols) of the stacked tensor
            return [(part, start, (1, *dims)) for part, start, dims in split_fused_experts(path, shape) or []]
        return split_fused_experts(path, shape) if path in divided else cut.get(path)

    published: list[tuple[str, tuple[int, ...]]] = []  # at the real shapes
    for name, shape in own:  # each part as (name, start, shape) or (name, start, shape, dims, published shape)
        published += [(part[0], tuple(part[-1] if len(part) == 5 else part[2])) for part in split(name, shape) or []] \
            or [(name, shape)]
    result: dict[str, tuple[int, ...]] = {}
    joins: dict[str, list[tuple[int, tuple[int, ...]]]] = {}  # a joined tensor's (position, block shape)
    for p, sh in published:
        target = rename.get(p)
        if isinstance(target, tuple):
            joins.setdefault(target[0], []).append((target[1], sh))
        else:
            result[target] = sh
    for target, blocks in joins.items():
        blocks.sort()
        result[target] = (sum(sh[0] for _i, sh in blocks), *blocks[0][1][1:])
    if len(rename) != len(published) or result != saved_shapes:
        return None  # the real shapes must give the checkpoint's names and shapes exactly
    changed = {k: v if isinstance(v, str) else v[0] for k, v in rename.items() if k != v}
    joined = len({v[0] for v in rename.values() if isinstance(v, tuple)})
    split_tensors = len(divided | stacked) + len(cut) + len(regrouped) + len(flipped)
    return NamesPlan(split if divided or cut or regrouped or stacked or flipped else None,
                     lambda name: rename.get(name, name), split_tensors, changed, joined=joined)


def _first(t: Any) -> Any:
    return t[0] if isinstance(t, list) else t


def _row_probe(shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The probe shape of a tensor the revert changes: its rows, each of distinct small odd dims (3, 5, 7, ...: a
    reordering within rows that halves a dim, such as an interleave of pairs, fails on them rather than being a
    no-op, as it would be on a dim of 2); None for a 0-d tensor, one of more than 7 dims, or one whose probe would
    exceed ``MAX_PROBE_ELEMENTS``."""
    if not shape or len(shape) > 1 + len(_ROW_DIMS):
        return None
    row = (shape[0], *_ROW_DIMS[:len(shape) - 1])
    return row if math.prod(row) <= MAX_PROBE_ELEMENTS else None


_ROW_DIMS = (3, 5, 7, 11, 13, 17)


def _row_runs(rows: list[tuple[int, tuple[int, ...], str, tuple[int, ...]]],
              t: Any) -> list[tuple[str, int, int, tuple[int, ...]]] | None:
    """A saved probe ``t`` as runs of whole rows of the row-probed tensors, in its order: ``(name, first row,
    rows, real shape)`` per run; None where it is anything else (values within rows reordered or transposed, rows of
    other dims, values of no row-probed tensor)."""
    import torch

    flat = t.reshape(-1)
    if t.dim() == 0 or not flat.numel():
        return None
    breaks = (torch.nonzero(flat[1:] != flat[:-1] + 1).reshape(-1) + 1).tolist()  # where values stop following
    out: list[tuple[str, int, int, tuple[int, ...]]] = []
    for start, end in zip([0, *breaks], [*breaks, flat.numel()]):
        value = int(flat[start])
        while start < end:  # one run of values may span two tensors probed one after the other
            i = bisect.bisect_right(rows, value, key=lambda r: r[0]) - 1
            if i < 0:
                return None
            at, row, name, real = rows[i]
            per_row, n = math.prod(row[1:]), min(end - start, at + math.prod(row) - value)
            if tuple(t.shape[1:]) != row[1:] or n <= 0 or (value - at) % per_row or n % per_row:
                return None
            out.append((name, (value - at) // per_row, n // per_row, real))
            start, value = start + n, value + n
    return out


def _transposed_rows(rows: list[tuple[int, tuple[int, ...], str, tuple[int, ...]]], t: Any) -> str | None:
    """The row-probed matrix whose probe a saved probe ``t`` is, transposed whole; None where it is not one."""
    if t.dim() != 2 or not t.numel():
        return None
    flat = t.t().reshape(-1)
    first = int(flat[0])
    # rows are in order of their first values: a search, not a scan per saved tensor (thousands on large models)
    i = bisect.bisect_left(rows, first, key=lambda r: r[0])
    if i == len(rows):
        return None
    at, row, name, real = rows[i]
    ok = at == first and len(real) == 2 and tuple(t.shape) == (row[1], row[0]) and _consecutive(flat, first)
    return name if ok else None


def _consecutive(flat: Any, first: int) -> bool:
    """Whether a probe's values are ``first, first + 1, ...``: elements in the order the model holds them."""
    import torch

    return torch.equal(flat, torch.arange(first, first + flat.numel()))


def _halves_interleaved(flat: Any, first: int, shape: tuple[int, ...]) -> bool:
    """Whether a fused expert tensor's probe (``(E, R, C)`` from value ``first``) is saved as ``flat`` with the rows
    of its two halves interleaved in each expert: viewed as ``(E, 2, R / 2, C)``, dims 1 and 2 swapped."""
    import torch

    if len(shape) != 3 or shape[1] % 2:
        return False
    want = torch.arange(first, first + flat.numel()).view(shape[0], 2, shape[1] // 2, shape[2]).transpose(1, 2)
    return torch.equal(flat, want.reshape(-1))


def _stacked(parts: dict[tuple[int, tuple[int, ...]], tuple[str, str]], t: Any) -> list[tuple[str, str]] | None:
    """The fused experts' parts (``(part, fused tensor)``, see ``split_fused_experts``) that a saved probe ``t`` is,
    one per index of its first dim, in order (Step-3.7's checkpoints stack each projection of the experts, ``(E, I,
    H)``, where the model fuses gate and up along their rows), or None."""
    out = []
    for block in t if t.dim() >= 2 else []:
        flat = block.reshape(-1)
        first = int(flat[0]) if flat.numel() else -1
        hit = parts.get((first, tuple(block.shape)))
        if hit is None or hit[0] == hit[1] or not _consecutive(flat, first):
            return None
        out.append(hit)
    return out or None


def _segments(runs: list[tuple[str, int, int, tuple[int, ...]]] | None
              ) -> list[tuple[str, int, int, tuple[int, ...], tuple[int, int, int] | None]] | None:
    """``runs`` (:func:`_row_runs`) with each stretch of runs that is one tensor's rows, all of them once,
    regrouped, as one: ``(name, 0, rows, real shape, (a, b, c))`` where the saved rows are the model's viewed as
    ``(a, b, c)`` with the last two swapped (RoPE's permutation within each head: (heads, 2, half); an interleave of
    two halves: (1, 2, half)); other runs as they are, with None."""
    if runs is None:
        return None
    import torch

    out: list[tuple[str, int, int, tuple[int, ...], tuple[int, int, int] | None]] = []
    for _name, stretch in itertools.groupby(runs, key=lambda r: r[0]):  # consecutive runs of one tensor
        stretch = list(stretch)
        name, real = stretch[0][0], stretch[0][3]
        groups = None
        if len(stretch) > 1 and sum(n for _n, _row, n, _real in stretch) == real[0]:
            groups = _regrouping(torch.cat([torch.arange(row, row + n) for _n, row, n, _real in stretch]))
        out += [(name, 0, real[0], real, groups)] if groups else [(*r, None) for r in stretch]
    return out


def _regrouping(order: Any) -> tuple[int, int, int] | None:
    """The ``(a, b, c)`` for which the model's rows ``0..n-1`` viewed as ``(a, b, c)`` with the last two dims swapped
    are ``order`` (the model's row for each saved row), or None. Saved row 1 is the model's row ``c`` and the model's
    row 1 is saved row ``b``: one candidate, checked whole."""
    import torch

    n = order.numel()
    if n < 4 or int(order[0]) != 0:
        return None
    c, at = int(order[1]), (order == 1).nonzero().reshape(-1)
    b = int(at[0]) if at.numel() else 0
    if b < 2 or c < 2 or n % (b * c):
        return None
    a = n // (b * c)
    return (a, b, c) if torch.equal(order, torch.arange(n).view(a, b, c).transpose(1, 2).reshape(-1)) else None


def _transposes(model: Any, own: list[tuple[str, tuple[int, ...]]], base: Base | None) -> list[str]:
    """The model's 3-D tensors that transformers' conversion mapping transposes (dims 1 and 2) on loading and that
    the base checkpoint holds under the same name with those dims swapped: its layout, which the fleet loads (for
    Qwen3-VL-MoE's experts, ``naming.transpose_fused_experts``). Both must say so: a shape alone could also be a
    reshape. Empty when either cannot tell; the base's headers are read only when the mapping names a tensor."""
    candidates = [(n, s) for n, s in own if len(s) == 3 and s[1] != s[2]]
    if base is None or not candidates:
        return []
    import re

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Transpose, WeightConverter

        patterns = [p for c in get_model_conversion_mapping(model, add_legacy=False)
                    if isinstance(c, WeightConverter) and any(
                        isinstance(op, Transpose) and {int(op.dim0), int(op.dim1)} == {1, 2} for op in c.operations)
                    for p in c.target_patterns]
        candidates = [(n, s) for n, s in candidates if any(re.search(p, n) for p in patterns)]
    except Exception as exc:  # noqa: BLE001 - another transformers: the start-up shapes check warns instead
        log.debug("hotload: transformers' transposes could not be read: %s", exc)
        return []
    shapes = base() if candidates else None
    return [n for n, s in candidates if shapes and shapes.get(n) == (s[0], s[2], s[1])]


def _probe_shape(name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """A small shape for a tensor that ``split_fused_experts`` divides (its expert count kept, so the names are the
    real ones; rows and columns few, but enough that an interleaved layout cannot pass for a concatenated one).
    No dim is 2: an interleave of pairs along it would leave the probe as it is (a no-op on 2), and at the real size
    publish the model's order under the checkpoint's name; on the odd dims here it fails, so there is no plan.
    ``I = 3`` and ``H = 5``, the shapes of one model: gate_up ``(E, 2I, H)``, down ``(E, H, I)``, up ``(E, I, H)``."""
    if split_fused_experts(name, shape) is None:
        return None
    if name.endswith("gate_up_proj"):
        return (shape[0], 6, 5)
    return (shape[0], 5, 3) if name.endswith("down_proj") else (shape[0], 3, 5)
