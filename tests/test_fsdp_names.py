"""The names a model's tensors are published under: clean_name drops the segments FSDP, torch.compile, activation
checkpointing and DDP-style wrappers add (and only those), and plan_names applies the tie, the user's rename and
the blocks a rename joins, naming each collision."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fsdp_hotload.fsdp import full_tensor_specs, local_chunks, tensor_paths
from fsdp_hotload.fsdp_verify import gather_full_state
from fsdp_hotload.naming import clean_name, plan_names


@pytest.mark.parametrize(
    "raw, clean",
    [
        ("model.layers.0.mlp.weight", "model.layers.0.mlp.weight"),
        ("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module.mlp.weight", "model.layers.0.mlp.weight"),
        ("_orig_mod.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("model.layers.3._checkpoint_wrapped_module.self_attn.q_proj.bias", "model.layers.3.self_attn.q_proj.bias"),
        ("_fsdp_wrapped_module.model.layers.1._fsdp_wrapped_module._flat_param", "model.layers.1"),
        # "module" is a real attribute name unless a DDP-style wrapper holds the model there
        ("model.adapter.module.weight", "model.adapter.module.weight"),
        ("module.lm_head.weight", "module.lm_head.weight"),
    ],
)
def test_clean_name(raw: str, clean: str) -> None:
    assert clean_name(raw) == clean


@pytest.mark.parametrize(
    "raw, wrapped, clean",
    [
        ("module.lm_head.weight", {"module"}, "lm_head.weight"),
        ("module.module.weight", {"module"}, "module.weight"),
        ("_orig_mod.module._fsdp_wrapped_module.model.norm.weight", {"_orig_mod.module"}, "model.norm.weight"),
        ("module._orig_mod.model.norm.weight", {"module"}, "model.norm.weight"),
        ("model.module.weight", {"module"}, "model.module.weight"),
    ],
)
def test_clean_name_drops_the_segments_a_wrapper_holds_the_model_by(raw: str, wrapped: set[str], clean: str) -> None:
    assert clean_name(raw, wrapped) == clean


def test_a_models_own_top_level_module_attribute_keeps_its_name() -> None:
    """Only DDP's and DataParallel's ``module`` is a wrapper; a model's own attribute of that name is published."""
    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(3, 2)
            self.head = nn.Linear(2, 2, bias=False)

    model = Own()
    names = ["module.weight", "module.bias", "head.weight"]
    assert [s[0] for s in full_tensor_specs(model)] == names
    assert [c.name for c in local_chunks(model)] == names
    assert list(gather_full_state(model)) == names
    wrapped = nn.DataParallel(model)  # holds the model as .module: that segment goes, the model's own stays
    assert [n for n, _p in wrapped.named_parameters()] == [f"module.{n}" for n in names]
    assert [s[0] for s in full_tensor_specs(wrapped)] == names
    assert list(gather_full_state(wrapped)) == names
    assert tensor_paths(torch.compile(wrapped)) == names


@pytest.mark.parametrize("raw", ["_fsdp_wrapped_module._flat_param", "_orig_mod", "model..weight"])
def test_clean_name_rejects_paths_without_a_name(raw: str) -> None:
    with pytest.raises(ValueError, match="no name left"):
        clean_name(raw)


def _pairs(slots: list[tuple[str, str]], **kw: Any) -> list[tuple[str, int]]:
    """``plan_names`` without the positions, which are None unless a rename joins tensors."""
    plan = plan_names(slots, **kw)
    assert all(position is None for _n, _i, position in plan)
    return [(n, i) for n, i, _position in plan]


def test_plan_names_tie_rename_and_collisions() -> None:
    slots = [("model.embed_tokens.weight", "E"), ("model.norm.weight", "N"), ("lm_head.weight", "E")]
    assert [n for n, _ in _pairs(slots, tie_word_embeddings=False)] == [
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert _pairs(slots, tie_word_embeddings=True) == [("model.embed_tokens.weight", 0), ("model.norm.weight", 1)]
    # the config does not say (GPT-2's save_pretrained leaves out its default, True): the model's own tying decides
    assert _pairs(slots) == _pairs(slots, tie_word_embeddings=True)
    untied = [("model.embed_tokens.weight", "E"), ("lm_head.weight", "L")]
    assert [n for n, _ in _pairs(untied)] == ["model.embed_tokens.weight", "lm_head.weight"]
    # the input name wins even when the output name comes first
    reversed_plan = _pairs(slots[::-1], tie_word_embeddings=True)
    assert reversed_plan == [("model.norm.weight", 1), ("model.embed_tokens.weight", 2)]
    drop_norm = _pairs(slots, rename=lambda n: None if "norm" in n else "x." + n, tie_word_embeddings=False)
    assert drop_norm == [("x.model.embed_tokens.weight", 0), ("x.lm_head.weight", 2)]
    with pytest.raises(ValueError, match="separate|of its own"):
        _pairs([("model.embed_tokens.weight", "E"), ("lm_head.weight", "L")], tie_word_embeddings=True)
    # an lm_head registered twice under one name is still a tensor of its own
    with pytest.raises(ValueError, match="of its own"):
        _pairs([("model.embed_tokens.weight", "E"), ("lm_head.weight", "L"), ("lm_head.weight", "L")],
                   tie_word_embeddings=True)
    # tying leaves out lm_head only: two other modules sharing one tensor both keep their names, as untied
    shared = [("model.embed_tokens.weight", "E"), ("a.w", "S"), ("b.w", "S"), ("lm_head.weight", "E")]
    assert _pairs(shared, tie_word_embeddings=True) == [("model.embed_tokens.weight", 0), ("a.w", 1), ("b.w", 2)]
    with pytest.raises(ValueError, match="'w'.*'model.embed_tokens.weight'.*'model.norm.weight'"):
        _pairs(slots, rename=lambda n: "w")
    with pytest.raises(ValueError, match="non-empty str"):
        _pairs(slots, rename=lambda n: "")
    # tied, but the rename drops the embedding's name: the message says so, not that lm_head has a tensor of its own
    with pytest.raises(ValueError, match="its name 'model.embed_tokens.weight' is renamed or dropped"):
        _pairs(slots, rename=lambda n: None if "embed" in n else n, tie_word_embeddings=True)
    # the embedding renamed to the tied output's name, or given once whole and once as a block: one tensor
    with pytest.raises(ValueError, match="gives that tensor no name but this one"):
        _pairs(slots, rename=lambda n: "lm_head.weight" if "embed" in n else n, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="one tensor would be published twice as 'e'"):
        _pairs(slots, rename=lambda n: ("e", 0) if "embed" in n else "e" if "lm_head" in n else n,
               tie_word_embeddings=False)
    # a mapping's lookup that misses names the tensor it was asked for (a bare KeyError said nothing of where)
    with pytest.raises(ValueError, match=r"rename\('model.norm.weight'\) raised KeyError"):
        _pairs(slots, rename={"model.embed_tokens.weight": "e", "lm_head.weight": "h"}.__getitem__)


def test_plan_names_joins_blocks_by_position_and_names_clashes() -> None:
    slots = [("a.q", "Q"), ("a.k", "K"), ("a.v", "V"), ("a.o", "O")]
    qkv = {"a.q": ("a.qkv", 0), "a.k": ("a.qkv", 2), "a.v": ("a.qkv", 1)}
    assert plan_names(slots, rename=lambda n: qkv.get(n, n)) == [
        ("a.qkv", 0, 0), ("a.qkv", 1, 2), ("a.qkv", 2, 1), ("a.o", 3, None)]
    with pytest.raises(ValueError, match=r"'a.qkv' at position 0: 'a.q' and 'a.k'"):
        plan_names(slots, rename=lambda n: ("a.qkv", 0) if n in qkv else n)
    with pytest.raises(ValueError, match=r"'a.qkv' \(one whole, one as a block .*\): 'a.q' and 'a.o'"):
        plan_names(slots, rename=lambda n: qkv.get(n, "a.qkv"))
    for bad in [("a.qkv", "0"), ("a.qkv", 1.5), ("a.qkv", True), ("", 0), (None, 1)]:
        with pytest.raises(ValueError, match=r"rename\('a.q'\) returned .*int position"):
            plan_names(slots, rename=lambda n, bad=bad: bad)
