"""The FSDP adapter's view of a model: chunks and ownership. Multi-rank cases run real torchrun jobs. The names
tensors are published under are in test_fsdp_names.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.fsdp import ChunkMeta, OwnershipError, full_tensor_specs, local_chunks
from fsdp_hotload.fsdp_verify import _sample, check_ownership, gather_full_state
from tests.dist_util import SCRIPTS, run_torchrun


# ------------------------------------------------------------------------------------------ plain module


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d
        self.embed_tokens = nn.Embedding(7, 4)
        self.proj = nn.Linear(4, 3).to(torch.bfloat16)
        self.empty = nn.Parameter(torch.zeros(0, 4))
        self.register_buffer("positions", torch.arange(6, dtype=torch.int32))
        self.register_buffer("mask", torch.ones(3, dtype=torch.bool))
        self.register_buffer("cache", torch.randn(5), persistent=False)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.model = Inner()
        self.lm_head = nn.Linear(4, 7, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 5), nn.Linear(4, 3), nn.Linear(4, 3)


def test_a_rename_joins_tensors_into_one_published_tensor() -> None:
    """q, k and v (weights and biases) published as one ``qkv`` tensor each: their data in place, moved down."""
    model = Attention()

    def rename(name: str) -> tuple[str, int]:
        proj, kind = name.split(".")
        return f"qkv.{kind}", "qkv".index(proj[0])

    specs = full_tensor_specs(model, rename=rename)
    assert specs == [("qkv.weight", (11, 4), "BF16"), ("qkv.bias", (11,), "BF16")]
    chunks = local_chunks(model, rename=rename)
    assert [(c.name, c.space, c.box) for c in chunks] == [
        ("qkv.weight", "flat", Box.flat(0, 20)), ("qkv.weight", "flat", Box.flat(20, 12)),
        ("qkv.weight", "flat", Box.flat(32, 12)), ("qkv.bias", "flat", Box.flat(0, 5)),
        ("qkv.bias", "flat", Box.flat(5, 3)), ("qkv.bias", "flat", Box.flat(8, 3))]
    assert chunks[1].source.data_ptr() == model.k_proj.weight.data_ptr()  # views, not copies
    check_ownership([chunks], specs)
    full = gather_full_state(model, rename=rename)
    want = torch.cat([model.q_proj.weight, model.k_proj.weight, model.v_proj.weight]).detach().to(torch.bfloat16)
    assert torch.equal(full["qkv.weight"], want)
    model.v_proj.weight = nn.Parameter(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"'qkv.weight' joins 'q_proj.weight' \(5, 4\).*'v_proj.weight' \(3, 5\)"):
        local_chunks(model, rename=rename)


def test_the_readmes_fused_qkv_rename_publishes_q_k_v_as_one() -> None:
    """The README's example of a joining rename, run as written there."""
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(import re\n\n\ndef fused_qkv.*?)\n\nhot = ", text, re.S)
    assert code, "the README's fused_qkv example is gone"
    scope: dict[str, Any] = {}  # the snippet imports what it uses
    exec(code[1], scope)  # noqa: S102 - our own README's snippet
    model, layer = nn.Module(), nn.Module()
    layer.self_attn = attn = Attention()
    model.layers = nn.ModuleList([layer])
    assert full_tensor_specs(model, rename=scope["fused_qkv"]) == [
        ("layers.0.self_attn.qkv_proj.weight", (11, 4), "BF16"), ("layers.0.self_attn.qkv_proj.bias", (11,), "BF16")]
    full = gather_full_state(model, rename=scope["fused_qkv"])
    want = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().to(torch.bfloat16)
    assert torch.equal(full["layers.0.self_attn.qkv_proj.bias"], want)


def test_plain_module_one_whole_chunk_per_tensor_as_views() -> None:
    model = Tied()
    state = model.state_dict()
    chunks = local_chunks(model, tie_word_embeddings=False)
    specs = full_tensor_specs(model, tie_word_embeddings=False)
    # every persistent tensor, in state_dict order; the non-persistent buffer is not published
    assert [s[0] for s in specs] == list(state) and "model.cache" not in state
    dtypes = {n: d for n, _, d in specs}
    assert dtypes["model.scale"] == "BF16" and dtypes["model.proj.weight"] == "BF16"
    assert dtypes["model.positions"] == "I32" and dtypes["model.mask"] == "BOOL"
    # one whole flat chunk per non-empty tensor; the empty one is in the specs but has no chunk
    assert [c.name for c in chunks] == [n for n in state if state[n].numel() > 0]
    for c in chunks:
        t = state[c.name]
        assert c.shape == tuple(t.shape) and c.space == "flat" and c.box == Box.flat(0, t.numel())
        assert c.source.dim() == 1 and c.source.dtype == t.dtype
        assert c.source.data_ptr() == t.data_ptr()  # a view of the parameter itself, not a copy
    check_ownership([chunks], specs)
    # tied names share one tensor: both views see an in-place update
    by_name = {c.name: c for c in chunks}
    with torch.no_grad():
        model.model.embed_tokens.weight[2, 1] = 42.0
    assert by_name["lm_head.weight"].source[2 * 4 + 1].item() == 42.0
    assert by_name["model.embed_tokens.weight"].source[2 * 4 + 1].item() == 42.0


def test_plain_module_tie_rename_buffers_and_dtype() -> None:
    model = Tied()
    tied = full_tensor_specs(model, tie_word_embeddings=True)
    assert "lm_head.weight" not in [s[0] for s in tied] and "model.embed_tokens.weight" in [s[0] for s in tied]
    assert full_tensor_specs(model) == tied  # no config says: lm_head is the embedding's tensor, so it is tied
    no_buffers = full_tensor_specs(model, include_buffers=False, tie_word_embeddings=False)
    assert [s[0] for s in no_buffers] == [n for n, _ in model.named_parameters(remove_duplicate=False)]
    f32 = {n: d for n, _, d in full_tensor_specs(model, snapshot_dtype="float32")}
    assert f32["model.proj.weight"] == "F32" and f32["model.positions"] == "I32"
    renamed = local_chunks(model, rename=lambda n: None if n.startswith("model.proj") else n.replace("model.", "m."),
                           tie_word_embeddings=False)
    assert [c.name for c in renamed] == ["m.scale", "m.positions", "m.mask", "m.embed_tokens.weight", "lm_head.weight"]
    with pytest.raises(ValueError, match="not a floating dtype"):
        local_chunks(model, snapshot_dtype="I32")
    with pytest.raises(ValueError, match="snapshot_dtype 'float7' is not a floating dtype; accepted: .*bfloat16"):
        full_tensor_specs(model, snapshot_dtype="float7")
    # As the config refuses it: every floating tensor cast to 8 bits without scales (it was published so)
    with pytest.raises(ValueError, match="snapshot_dtype 'float8_e4m3fn' would cast every floating tensor to 8 bits"):
        full_tensor_specs(model, snapshot_dtype="float8_e4m3fn")


def test_gather_full_state_plain_matches_state_dict_in_snapshot_dtype() -> None:
    model = Tied()
    full = gather_full_state(model, tie_word_embeddings=True)
    state = model.state_dict()
    assert list(full) == [n for n in state if n != "lm_head.weight"]
    for name, t in full.items():
        want = state[name].to(torch.bfloat16) if state[name].is_floating_point() else state[name]
        assert t.dtype == want.dtype and t.device.type == "cpu" and t.shape == want.shape
        assert np.array_equal(RawTensor.from_any(t).data, RawTensor.from_any(want).data), name


def test_a_split_reads_each_tensors_placement_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoE model has thousands of expert parts per fused tensor set (DeepSeek-V3: 44,544): each part is cut
    from its tensor's pieces, which are worked out once per tensor and walk, not once per part (on a DTensor
    that is ~50 us of placement arithmetic, seconds per walk on every rank)."""
    from fsdp_hotload import fsdp
    from fsdp_hotload.naming import split_fused_experts

    calls: list[str] = []
    pieces = fsdp._PlainSource.pieces

    def counted(self: fsdp._PlainSource, name: str) -> list:
        calls.append(name)
        return pieces(self, name)

    monkeypatch.setattr(fsdp._PlainSource, "pieces", counted)
    model = nn.Module()
    model.experts = nn.Module()
    model.experts.gate_up_proj = nn.Parameter(torch.randn(64, 4, 2))
    model.experts.down_proj = nn.Parameter(torch.randn(64, 2, 2))
    chunks = local_chunks(model, split=lambda p, shape: split_fused_experts("model." + p, shape))
    assert len(chunks) == 64 * 3 and len(calls) == 2, len(calls)
    for e in range(64):
        up = next(c for c in chunks if c.name == f"model.experts.{e}.up_proj.weight")
        assert torch.equal(up.source, model.experts.gate_up_proj.detach()[e, 2:].reshape(-1))


def test_gather_full_state_brings_each_part_alone_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference of a split tensor is sliced where the framework's state dict has it (the GPU) and only the
    part comes to the host: moving the whole fused tensor for each of its parts moves E times its bytes per
    projection (hundreds of GB per layer for a 128-expert model)."""
    from fsdp_hotload.naming import split_fused_experts

    moved: list[int] = []
    to = torch.Tensor.to

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if "cpu" in args or kwargs.get("device") == "cpu":
            moved.append(self.numel())
        return to(self, *args, **kwargs)

    model = nn.Module()
    model.experts = nn.Module()
    model.experts.gate_up_proj = nn.Parameter(torch.randn(16, 4, 2))
    model.experts.down_proj = nn.Parameter(torch.randn(16, 2, 2))
    monkeypatch.setattr(torch.Tensor, "to", counted)
    full = gather_full_state(model, split=lambda p, shape: split_fused_experts("model." + p, shape))
    monkeypatch.undo()
    assert sum(moved) == 16 * 8 + 16 * 4, sum(moved)
    assert torch.equal(full["model.experts.3.up_proj.weight"], model.experts.gate_up_proj[3, 2:].bfloat16())


def test_an_embedding_split_into_parts_is_still_tied_to_lm_head() -> None:
    """lm_head is the embedding's tensor; a split that divides the embedding (its checkpoint stores it in parts)
    leaves lm_head.weight whole: a tied config still leaves it out, as the HF convention does, and untied it
    is published whole, rather than being called "a tensor of its own" or published against the config."""
    def rows(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
        if path != "model.embed_tokens.weight":
            return None
        return [("model.embed_tokens.a", 0, (3, 4)), ("model.embed_tokens.b", 12, (4, 4))]

    model = Tied()
    for tie in (True, None):
        names = [n for n, _s, _d in full_tensor_specs(model, split=rows, tie_word_embeddings=tie)]
        assert "lm_head.weight" not in names and names.count("model.embed_tokens.a") == 1, (tie, names)
    untied = {c.name: c for c in local_chunks(model, split=rows, tie_word_embeddings=False)}
    assert torch.equal(untied["lm_head.weight"].source, model.lm_head.weight.detach().reshape(-1))
    assert torch.equal(untied["model.embed_tokens.b"].source, model.lm_head.weight.detach()[3:].reshape(-1))
    full = gather_full_state(model, split=rows, tie_word_embeddings=False)
    assert torch.equal(full["lm_head.weight"], model.lm_head.weight.detach().bfloat16())


def test_dtype_overrides_first_matching_glob_wins() -> None:
    """Globs match published names in order; "keep" is the trainer's dtype; integer and bool tensors never change.
    Chunks, specs and the gathered reference all agree."""
    model = Tied()
    overrides = {"model.proj.*": "keep", "model.*": "float16", "model.positions": "float32", "lm_*": "F32"}
    specs = {n: d for n, _, d in full_tensor_specs(model, dtype_overrides=overrides, tie_word_embeddings=False)}
    assert specs == {"model.scale": "F16", "model.embed_tokens.weight": "F16", "model.proj.weight": "BF16",
                     "model.proj.bias": "BF16", "model.empty": "F16", "model.positions": "I32", "model.mask": "BOOL",
                     "lm_head.weight": "F32"}, specs
    assert {c.name: c.dtype for c in local_chunks(model, dtype_overrides=overrides, tie_word_embeddings=False)} == {
        n: d for n, d in specs.items() if n != "model.empty"}  # chunks are never empty
    full = gather_full_state(model, dtype_overrides=overrides, tie_word_embeddings=False)
    state = model.state_dict()
    for name, t in full.items():
        want = state[name].to(t.dtype)
        assert RawTensor.from_any(t).dtype == specs[name], name
        assert np.array_equal(RawTensor.from_any(t).data, RawTensor.from_any(want).data), name
    with pytest.raises(ValueError, match=r"dtype_overrides\['model.\*'\] 'int8' is not a floating dtype"):
        full_tensor_specs(model, dtype_overrides={"model.*": "int8"})


def test_wrappers_do_not_change_names() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = Tied()
    wrapped = Tied()
    wrapped.model.proj = checkpoint_wrapper(wrapped.model.proj)
    compiled = torch.compile(wrapped)  # an OptimizedModule: names gain "_orig_mod." until cleaned
    assert any("_orig_mod." in n for n, _ in compiled.named_parameters())
    assert any("_checkpoint_wrapped_module." in n for n, _ in compiled.named_parameters())
    assert full_tensor_specs(compiled) == full_tensor_specs(plain)


def test_unsupported_tensors_are_named() -> None:
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(4, 3).t())  # a transposed view: no flat C-order view exists
    with pytest.raises(ValueError, match="'w' is not contiguous"):
        local_chunks(model)
    model = nn.Module()
    model.z = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="'z' is complex .* leave it out .*include_buffers=False"):
        full_tensor_specs(model)
    # split into parts, or joined with another: the error names the parameter, not a name the model has not
    model = nn.Module()
    model.experts = nn.Parameter(torch.randn(4, 6).t())
    parts = lambda path, shape: [(f"experts.{e}.w", e * 4, (4,)) for e in range(6)]  # noqa: E731
    with pytest.raises(ValueError, match="tensor 'experts' is not contiguous"):
        local_chunks(model, split=parts)
    model = nn.Module()
    model.q, model.k = nn.Parameter(torch.randn(2, 3).t()), nn.Parameter(torch.randn(3, 2))
    joined = lambda name: {"q": ("qk", 0), "k": ("qk", 1)}[name]  # noqa: E731
    with pytest.raises(ValueError, match="tensor 'q' is not contiguous"):
        local_chunks(model, rename=joined)


# ---------------------------------------------------------------------------------------------- ownership


SPECS = [("a", (10,), "BF16"), ("b", (4, 6), "F32"), ("c", (), "BF16")]


def _meta(name: str, box: Box, space: str = "flat") -> ChunkMeta:
    shape, dtype = {n: (s, d) for n, s, d in SPECS}[name][0], {n: d for n, _, d in SPECS}[name]
    return ChunkMeta(name, shape, dtype, space, box)


def test_check_ownership_accepts_exact_tilings() -> None:
    rank0 = [_meta("a", Box.flat(0, 6)), _meta("b", Box((0, 0), (4, 3)), "shape"), _meta("c", Box.flat(0, 1))]
    rank1 = [_meta("a", Box.flat(6, 4)), _meta("b", Box((0, 3), (4, 3)), "shape")]
    check_ownership([rank0, rank1], SPECS)
    check_ownership([rank0, rank1, []], SPECS)  # a rank that holds nothing is fine


@pytest.mark.parametrize(
    "ranks, match",
    [
        ([[_meta("a", Box.flat(0, 6)), _meta("b", Box.flat(0, 24)), _meta("c", Box.flat(0, 1))],
          [_meta("a", Box.flat(5, 4))]], "'a'.*overlap"),
        ([[_meta("a", Box.flat(0, 6)), _meta("b", Box.flat(0, 24)), _meta("c", Box.flat(0, 1))],
          [_meta("a", Box.flat(6, 3))]], "'a'.*cover 9 elements"),
        ([[_meta("a", Box.flat(0, 10)), _meta("b", Box.flat(0, 24))]], "'c'.*no rank holds"),
        ([[_meta("a", Box.flat(0, 10)), _meta("b", Box.flat(0, 24)), _meta("c", Box.flat(0, 1))],
          [_meta("c", Box.flat(0, 1))]], "'c'.*rank 0.*rank 1"),
        ([[_meta("a", Box.flat(0, 10)), _meta("b", Box.flat(0, 12)), _meta("c", Box.flat(0, 1)),
           _meta("b", Box((2, 0), (2, 6)), "shape")]], "'b' has chunks in both"),
        ([[ChunkMeta("zz", (1,), "BF16", "flat", Box.flat(0, 1))]], "rank 0 holds a chunk of 'zz'"),
        ([[ChunkMeta("a", (10,), "F16", "flat", Box.flat(0, 10))]], "'a' says F16"),
        ([[ChunkMeta("a", (10,), "BF16", "rows", Box.flat(0, 10))]], "unknown space 'rows'"),
    ],
)
def test_check_ownership_rejects(ranks: list, match: str) -> None:
    with pytest.raises(OwnershipError, match=match):
        check_ownership(ranks, SPECS)


def test_check_ownership_rejects_duplicate_specs() -> None:
    with pytest.raises(OwnershipError, match="'a' appears twice"):
        check_ownership([], [*SPECS, ("a", (10,), "BF16")])


def test_ranks_that_see_other_specs_are_told_which_and_why_shapes_alone_may_differ() -> None:
    """Ranks must publish the same tensors. Where only shapes differ, the likely cause is a base checkpoint that
    one rank reads and another does not (hf_names transposes by its headers): the error says so."""
    from fsdp_hotload.fsdp_verify import _check_same_specs

    ours = [("e.gate_up_proj", (3, 8, 4), "BF16"), ("n", (4,), "BF16")]
    swapped = [("e.gate_up_proj", (3, 4, 8), "BF16"), ("n", (4,), "BF16")]
    _check_same_specs([ours, list(ours)])
    with pytest.raises(OwnershipError, match=r"ranks 0 and 1 see different tensor specs .*only shapes differ: "
                                             r"does every rank read the same base checkpoint in hf_config_dir"):
        _check_same_specs([ours, swapped])
    with pytest.raises(OwnershipError, match=r"ranks 0 and 2 see different tensor specs \(e\.g\. .*'m'.*\)$"):
        _check_same_specs([ours, ours, [*ours, ("m", (1,), "BF16")]])


# ------------------------------------------------------------------------------------------------ torchrun


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp_chunks_rebuild_gathered_state(nproc: int) -> None:
    """FSDP2 (and HSDP on 4 ranks), FSDP1 with both use_orig_params values: see dist_scripts/check_chunks.py."""
    result = run_torchrun(str(SCRIPTS / "check_chunks.py"), nproc, [])
    for rank in range(nproc):
        assert f"RANK {rank} OK " in result.stdout, result.stdout


def test_a_reshaped_part_joined_with_a_boxed_one_rebuilds_gathered_state() -> None:
    """A joined tensor with one boxed block gives every block as boxes; a block published reshaped is held by N-D
    views of the shard, which were sliced by rows instead of elements. See dist_scripts/joined_reshaped.py."""
    result = run_torchrun(str(SCRIPTS / "joined_reshaped.py"), 2, [])
    for rank in range(2):
        assert f"RANK {rank} OK " in result.stdout, result.stdout


def test_a_non_contiguous_tensor_is_refused_on_every_rank(tmp_path: Path) -> None:
    run_torchrun(str(SCRIPTS / "noncontiguous.py"), 2, ["--out", str(tmp_path)])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for label in ("replicated", "fsdp1"):
        assert all("'0.weight'" in r[label] and "contiguous" in r[label] for r in results), results


def test_fsdp1_over_tensor_parallelism_is_refused_on_every_rank() -> None:
    """torchrun, 2 ranks (dist_scripts/fsdp1_tp.py): FSDP1 flattens each DTensor's local TP block, so its metadata
    published TP rank 0's block as the whole tensor (even blocks: no check noticed) or blamed the base checkpoint
    (uneven blocks)."""
    out = run_torchrun(str(SCRIPTS / "fsdp1_tp.py"), 2, []).stdout
    assert "RANK 0 OK" in out and "RANK 1 OK" in out


def test_ranks_holding_one_box_with_different_values_are_refused_as_partitions(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/partitions.py): plain parameters Megatron marks tensor- or expert-parallel,
    and each rank's own experts under one name (which FSDP2 leaves whole on each rank), were taken for copies of
    one replica and only rank 0's published; so were experts alike in their first elements only, and a plain
    parameter (no DTensor, no marks) that differs per rank, also where only rows the samples skip differ. A buffer
    that differs per rank is still published from rank 0."""
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(str(SCRIPTS / "partitions.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out", str(out)])
    for rank in (0, 1):
        found = json.loads((out / f"rank{rank}.json").read_text())
        assert found["ep"] is not None and "OwnershipError" in found["ep"], found
        assert "ranks 0 and 1 hold the same part of tensor 'experts'" in found["ep"], found
        assert found["late"] is not None and "hold the same part of tensor 'experts'" in found["late"], found
        assert found["plain"] is not None and "OwnershipError" in found["plain"], found
        assert "ranks 0 and 1 hold different values of plain tensor '1.weight'" in found["plain"], found
        assert found["rows"] is not None and "hold different values of plain tensor 'weight'" in found["rows"], found
        assert found["tp"] is not None and "tensor-parallel" in found["tp"] and "qkv.weight" in found["tp"]
        assert "TensorPublisher" in found["tp"], found
        assert found["expert"] is not None and "expert-parallel" in found["expert"], found
        assert found["buffers"] is None and found["split"] is None, found


def test_copies_that_drift_apart_once_training_starts_stop_publishing_on_every_rank(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/drift.py): copies were compared only at construction, so experts seeded
    alike on every rank, and a module left out of fully_shard, passed there and then drifted apart, with rank 0's
    published as everyone's. The steps compare them again until they have changed (a first step(0) before
    training, or a first optimizer step at a learning rate of 0, changes nothing; weight decay over a zero gradient
    changes every copy alike) and the sum of all their bits (an embedding whose trained rows are not sampled): where
    they differ, every rank
    stops publishing at that step (raising, or only logging with keep_training_on_error), and nothing of that
    step or any later one goes out, under either busy policy. Copies that DDP keeps equal pass; FSDP2 and HSDP,
    which hold no undeclared copy, compare nothing. Once the first steps' comparisons end, every copy is compared
    again once per full snapshot's span: a module frozen at construction and unfrozen later, and one that gets its
    first gradient after those steps, were never compared again and drifted unseen."""
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(str(SCRIPTS / "drift.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out", str(out)])
    for rank in (0, 1):
        found = json.loads((out / f"rank{rank}.json").read_text())
        seeded, unsynced, before, warmup = found["seeded"], found["unsynced"], found["before"], found["warmup"]
        assert seeded["raised_at"] == 0 and seeded["raised"].startswith("OwnershipError: ranks 0 and 1 held the "
                                                                          "same part of tensor 'experts'"), seeded
        assert "different values at step 0" in seeded["raised"] and "Publishing stops" in seeded["raised"], seeded
        assert unsynced["raised_at"] == 0 and "held plain tensor '1.bias' and 1 more" in unsynced["raised"], unsynced
        assert found["catch"]["raised_at"] == 0, found["catch"]  # raised once; the later steps publish nothing
        assert before["raised_at"] == 1 and "different values at step 1" in before["raised"], before
        assert warmup["raised_at"] == 2 and "different values at step 2" in warmup["raised"], warmup
        assert found["decay"]["raised_at"] == 1 and "plain tensor 'head.weight'" in found["decay"]["raised"], found
        assert found["sparse"]["raised_at"] == 0 and "plain tensor 'head.weight'" in found["sparse"]["raised"], found
        for name in ("keep", "skip_keep", "attach_keep"):
            case = found[name]
            assert case["raised"] is None and "held plain tensor '1.bias'" in case["stopped"], (name, case)
        for name in ("seeded", "unsynced", "keep", "skip_keep", "attach_keep", "catch", "sparse"):
            case = found[name]
            assert case["planned"] == 8 and case["published"] == [] and case["stopped"], (name, case)
        # published before the weights changed, and only then
        assert before["published"] == ([0] if rank == 0 else []), before
        assert warmup["published"] == ([0, 1] if rank == 0 else []), warmup
        for name, planned, steps, made in (("frozen", 8, 4, 1), ("ddp", 8, 8, 6), ("hsdp", 0, 4, 0), ("fsdp", 0, 4, 0)):
            case = found[name]
            assert case["raised"] is None and case["stopped"] is None and case["planned"] == planned, (name, case)
            assert case["made"] == made, (name, case)  # ddp: steps 0-3, then 5 and 7
            # DDP's: every copy changed at each of the three comparisons after the first (the fourth step), and
            # agreed, then agreed again at steps 5 and 7; frozen: the module left out is not compared, so the
            # first phase does not go on for it. Both are still compared once per span; FSDP2 and HSDP never are.
            assert case["left"] == 0 and case["active"] == (planned > 0), (name, case)
            assert case["published"] == (list(range(steps)) if rank == 0 else []), (name, case)
        unfrozen, late = found["unfrozen"], found["late"]
        assert unfrozen["planned"] == 8 and unfrozen["raised_at"] == 2, unfrozen
        assert "held plain tensor '1.bias' and 1 more" in unfrozen["raised"], unfrozen
        assert "different values at step 2" in unfrozen["raised"], unfrozen
        assert late["raised_at"] == 9 and "plain tensor 'head.bias' and 1 more" in late["raised"], late
        assert late["made"] == 9 and unfrozen["made"] == 2, found  # late: steps 0-7 and 9; unfrozen: 0 and 2
        # the drift of step 8 went out before the comparison of step 9 found it: one span at most
        assert unfrozen["published"] == ([0, 1] if rank == 0 else []), unfrozen
        assert late["published"] == (list(range(9)) if rank == 0 else []), late
        assert not unfrozen["active"] and not late["active"] and unfrozen["stopped"] and late["stopped"], found
        assert not any(case["held_after_close"] for case in found.values()), found


@pytest.mark.parametrize("layout", ["0-d", "flat", "rows", "transposed", "strided", "wide rows"])
def test_the_sum_of_a_tensors_bits_is_taken_in_blocks_and_equals_the_whole_sum(layout: str) -> None:
    """The replica comparisons sum all of a tensor's bits as int64; a sum with dtype=int64 cast the whole input
    first (8 bytes per element: a 256 MiB bf16 embedding took 1 GiB more, after optimizer.step()). It is taken in
    blocks, as views whatever the layout, and equals numpy's wrapping sum of the same values."""
    from fsdp_hotload.fsdp_verify import _bit_sum

    g = torch.Generator().manual_seed(0)
    base = torch.randint(-2**15, 2**15, (64, 50), dtype=torch.int16, generator=g)
    t = {"0-d": base[3, 4], "flat": base.reshape(-1), "rows": base, "transposed": base.t(),
         "strided": base.reshape(-1)[::3], "wide rows": base[:, ::2]}[layout]
    want = int(t.numpy().astype(np.int64).sum())
    for block in (1, 7, 100, 1 << 22):
        got = _bit_sum(t, block)
        assert got.shape == (1,) and got.dtype == torch.int64 and int(got) == want, (layout, block)
    big = torch.full((1 << 20,), 2**62, dtype=torch.int64)  # wraps: the same value however it is cut
    assert int(_bit_sum(big, 1000)) == int(big.sum()) == int(_bit_sum(big, 1 << 22))


@pytest.mark.parametrize("shape", [(), (1,), (5,), (9,), (100,), (1, 1), (3, 4), (100, 3), (7, 5, 9), (2, 32, 4)])
def test_replica_samples_read_runs_spread_along_the_first_dim(shape: tuple[int, ...]) -> None:
    """The replica check read a tensor's first 64 elements only, so experts alike at their start passed as copies.
    A sample is now a run at each of up to eight places spread along the first dim, read in one copy whatever
    the view's layout (a permuted part, a slice): the same elements as indexing the tensor place by place."""
    def by_index(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(1) if t.dim() == 0 else t
        rows = t.shape[0]
        reach, run = (max(rows - 8, 0), min(8, rows)) if t.dim() == 1 else (rows - 1, min(8, t.shape[-1]))
        step = max(reach // 7, 1)
        runs = []
        for at in range(0, min(8, reach // step + 1) * step, step):
            row = t[at:at + run] if t.dim() == 1 else t[at]
            while row.dim() > 1:
                row = row[0]
            runs.append(row[:run])
        return torch.cat(runs).contiguous().view(torch.uint8)

    whole = torch.arange(int(np.prod(shape)) * 4, dtype=torch.float32).reshape(*shape, 4)
    for t in (whole[..., 0], whole[..., 1].to(torch.bfloat16), whole.movedim(-1, 0)[2].mT if len(shape) > 1
              else whole[..., 3]):
        got = _sample(t)
        assert torch.equal(got, by_index(t)) and got.numel() <= 64 * t.element_size()
    if int(np.prod(shape)) > 64:  # elements past the first 64 are read (whole[..., 0] holds 4 * its flat index)
        assert _sample(whole[..., 0]).view(torch.float32).max() >= 4 * 64
