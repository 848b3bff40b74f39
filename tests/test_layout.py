"""Snapshot layout: shard planning, manifests, layout checks and the base model's aux files. Snapshot identities
are in test_layout_identity.py."""
from __future__ import annotations

import json
import logging
import random
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fsdp_hotload.layout import (
    INDEX_FILENAME,
    SPEC_FILENAME,
    LayoutError,
    ShardPlan,
    TensorSpec,
    check_one_layer_per_file,
    check_same_layout,
    layer_of,
    plan_shards,
)
from fsdp_hotload.hf_config import hf_aux_files

NP_DTYPE = {"F32": np.float32, "F16": np.float16, "U8": np.uint8, "BF16": np.uint16}
LAYER_SUFFIXES = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def fake_model(n_layers: int = 4, hidden: int = 32, inter: int = 64, vocab: int = 128) -> list[TensorSpec]:
    """A small Llama-shaped model: embed, n layers of attention + MLP, final norm (F32) and lm_head."""
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "BF16")]
    shapes = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    for i in range(n_layers):
        for suffix in LAYER_SUFFIXES:
            specs.append(TensorSpec(f"model.layers.{i}.{suffix}", shapes.get(suffix, (hidden, hidden)), "BF16"))
    specs.append(TensorSpec("model.norm.weight", (hidden,), "F32"))
    specs.append(TensorSpec("lm_head.weight", (vocab, hidden), "BF16"))
    return specs


def group_of(name: str) -> str:
    layer = layer_of(name)
    return f"layer{layer}" if layer is not None else ("head" if "embed" in name else "tail")


def assert_layers_not_mixed(plan: ShardPlan) -> None:
    for filename, names in plan.files.items():
        groups = {group_of(n) for n in names}
        assert len(groups) == 1, f"{filename} mixes {groups}"


def write_plan(plan: ShardPlan, folder: Path) -> None:
    """Write each planned file with the safetensors library (zero-filled tensors)."""
    for filename, names in plan.files.items():
        tensors = {}
        for n in names:
            s = plan.specs[n]
            tensors[n] = np.zeros(s.shape, NP_DTYPE[s.dtype])
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------------ planning


def test_default_plan_puts_each_layer_and_the_head_and_tail_in_own_files() -> None:
    specs = fake_model()
    plan = plan_shards(specs)
    names = list(plan.files)
    assert names == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    assert plan.files[names[0]] == ["model.embed_tokens.weight"]
    for i in range(4):
        expected = {s.name for s in specs if s.name.startswith(f"model.layers.{i}.")}
        assert len(expected) == len(LAYER_SUFFIXES)
        assert set(plan.files[names[i + 1]]) == expected
    assert set(plan.files[names[5]]) == {"model.norm.weight", "lm_head.weight"}
    assert plan.weight_map == {n: f for f, ns in plan.files.items() for n in ns}
    assert plan.specs == {s.name: s for s in specs}
    assert plan.file_of("model.layers.2.mlp.up_proj.weight") == names[3]
    assert plan.total_size == sum(int(np.prod(s.shape)) * (4 if s.dtype == "F32" else 2) for s in specs)
    check_one_layer_per_file(plan)


def test_layers_are_ordered_numerically_not_as_text() -> None:
    plan = plan_shards(fake_model(n_layers=12))
    order = [group_of(ns[0]) for ns in plan.files.values()]
    assert order == ["head"] + [f"layer{i}" for i in range(12)] + ["tail"]


def test_other_hf_naming_schemes_get_head_layers_tail_order() -> None:
    names = [
        "gpt_neox.embed_in.weight",
        "gpt_neox.layers.1.attention.dense.weight",
        "gpt_neox.layers.0.attention.dense.weight",
        "gpt_neox.layers.0.mlp.dense_h_to_4h.weight",
        "gpt_neox.final_layer_norm.weight",
        "embed_out.weight",  # GPT-NeoX's output head: a tail tensor despite the name
    ]
    plan = plan_shards(TensorSpec(n, (4, 4), "F16") for n in names)
    files = list(plan.files.values())
    assert files == [
        ["gpt_neox.embed_in.weight"],
        ["gpt_neox.layers.0.attention.dense.weight", "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"],
        ["gpt_neox.layers.1.attention.dense.weight"],
        ["embed_out.weight", "gpt_neox.final_layer_norm.weight"],
    ]


def test_two_layer_stacks_with_the_same_index_never_share_a_file() -> None:
    names = ["model.layers.0.mlp.up_proj.weight", "visual.blocks.0.attn.qkv.weight", "visual.patch_embed.proj.weight"]
    plan = plan_shards(TensorSpec(n, (2, 2), "BF16") for n in names)
    assert len({plan.file_of(n) for n in names}) == 3
    check_one_layer_per_file(plan)


@pytest.mark.parametrize("cap", [20_000, 40_000, 70_000, 200_000])
def test_cap_splits_layers_at_tensor_boundaries_and_files_stay_under_it(cap: int, tmp_path: Path) -> None:
    specs = fake_model(hidden=64, inter=128)  # a layer holds 4*8 KiB + 3*16 KiB + 256 B
    plan = plan_shards(specs, max_file_bytes=cap)
    assert_layers_not_mixed(plan)
    assert sorted(plan.weight_map) == sorted(s.name for s in specs)
    layer_bytes = sum(s.nbytes for s in specs if layer_of(s.name) == 0)
    files_of_layer0 = {plan.file_of(s.name) for s in specs if layer_of(s.name) == 0}
    if layer_bytes > cap:
        assert len(files_of_layer0) >= 2
    else:
        assert len(files_of_layer0) == 1
    write_plan(plan, tmp_path)
    for filename in plan.files:
        real = (tmp_path / filename).stat().st_size
        assert real <= plan.file_size_bound(filename) <= cap, filename
    # Greedy packing: a file is closed only when the next tensor would not fit (headers take < 4 KiB here).
    groups = [(group_of(ns[0]), f) for f, ns in plan.files.items()]
    for (g1, f1), (g2, f2) in zip(groups, groups[1:]):
        if g1 == g2:
            assert plan.file_nbytes(f1) + plan.specs[plan.files[f2][0]].nbytes > cap - 4096


def test_header_size_counts_towards_the_cap_for_many_small_tensors(tmp_path: Path) -> None:
    # 300 tiny expert tensors: their safetensors header entries outweigh their data many times over.
    names = [f"model.layers.0.mlp.experts.{e}.{w}_proj.weight_scale_inv" for e in range(100) for w in "abc"]
    plan = plan_shards((TensorSpec(n, (1,), "F32") for n in names), max_file_bytes=8_000)
    assert len(plan.files) > 1
    write_plan(plan, tmp_path)
    for filename in plan.files:
        with open(tmp_path / filename, "rb") as fh:
            header_len = struct.unpack("<Q", fh.read(8))[0]
        assert header_len > plan.file_nbytes(filename)
        assert (tmp_path / filename).stat().st_size <= plan.file_size_bound(filename) <= 8_000


def test_a_tensor_larger_than_the_cap_gets_its_own_file_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    specs = fake_model(hidden=64, inter=128)
    big = TensorSpec("model.layers.1.mlp.experts.0.w1.weight", (256, 256), "BF16")  # 128 KiB
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload.layout"):
        plan = plan_shards([*specs, big], max_file_bytes=60_000)
    assert plan.files[plan.file_of(big.name)] == [big.name]
    assert any(big.name in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert_layers_not_mixed(plan)
    # Several too large: one line naming the largest, not a line per tensor; none where warn is off (ranks > 0).
    bigger = TensorSpec("model.layers.1.mlp.experts.1.w1.weight", (256, 512), "BF16")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload.layout"):
        plan_shards([*specs, big, bigger], max_file_bytes=60_000)
        plan_shards([*specs, big, bigger], max_file_bytes=60_000, warn=False)
    (record,) = caplog.records
    assert record.getMessage().startswith("2 tensor(s) do not fit") and bigger.name in record.getMessage()
    for filename in plan.files:
        if filename != plan.file_of(big.name):
            assert plan.file_size_bound(filename) <= 60_000


def test_plan_does_not_depend_on_input_order() -> None:
    specs = fake_model(n_layers=11)
    reference = plan_shards(specs, max_file_bytes=12_000)
    rng = random.Random(1234)
    for _ in range(20):
        shuffled = specs[:]
        rng.shuffle(shuffled)
        plan = plan_shards(iter(shuffled), max_file_bytes=12_000)
        assert plan == reference
        assert list(plan.files) == list(reference.files)
        assert plan.to_index_json() == reference.to_index_json()
        assert plan.to_spec_json() == reference.to_spec_json()


def test_experts_inside_a_layer_are_sorted_numerically() -> None:
    names = [f"model.layers.0.mlp.experts.{e}.w1.weight" for e in (10, 2, 1, 0)]
    plan = plan_shards(TensorSpec(n, (1,), "BF16") for n in names)
    assert list(plan.files.values()) == [[f"model.layers.0.mlp.experts.{e}.w1.weight" for e in (0, 1, 2, 10)]]


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(LayoutError, match="no tensors"):
        plan_shards([])
    with pytest.raises(LayoutError, match="'model.norm.weight' is listed twice"):
        plan_shards([TensorSpec("model.norm.weight", (2,), "F32")] * 2)
    with pytest.raises(LayoutError, match="max_file_bytes"):
        plan_shards(fake_model(), max_file_bytes=0)
    with pytest.raises(TypeError, match="TensorSpec"):
        plan_shards({s.name: s for s in fake_model()})  # type: ignore[arg-type]


def test_tensor_spec_normalises_and_validates() -> None:
    s = TensorSpec("w", [3, np.int64(5)], "bfloat16")  # type: ignore[arg-type]
    assert (s.shape, s.dtype, s.nbytes) == ((3, 5), "BF16", 30)
    assert TensorSpec.of("x", np.zeros((2, 3), np.float32)) == TensorSpec("x", (2, 3), "F32")
    with pytest.raises(LayoutError, match="tensor 'w'.*float128"):
        TensorSpec("w", (1,), "float128")
    with pytest.raises(LayoutError, match="tensor 'w'.*non-negative integers, got -1"):
        TensorSpec("w", (2, -1), "F32")
    with pytest.raises(LayoutError, match="tensor 'w'.*non-negative integers, got 2.5"):
        TensorSpec("w", (2.5,), "F32")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="reserved"):
        TensorSpec("__metadata__", (1,), "F32")
    with pytest.raises(LayoutError, match="non-empty"):
        TensorSpec("", (1,), "F32")


def test_tensor_spec_of_a_torch_tensor() -> None:
    torch = pytest.importorskip("torch")
    assert TensorSpec.of("w", torch.zeros(4, 2, dtype=torch.bfloat16)) == TensorSpec("w", (4, 2), "BF16")


@pytest.mark.parametrize(
    "name, layer",
    [
        ("model.layers.7.mlp.down_proj.weight", 7),
        ("model.language_model.layers.12.self_attn.q_proj.weight", 12),
        ("transformer.h.3.attn.c_attn.weight", 3),
        ("h.0.attn.c_attn.weight", 0),
        ("gpt_neox.layers.30.attention.query_key_value.weight", 30),
        ("model.decoder.layers.5.fc1.weight", 5),
        ("transformer.encoder.layers.2.mlp.dense_4h_to_h.weight", 2),
        ("model.transformer.blocks.9.att_proj.weight", 9),
        ("bert.encoder.layer.11.output.dense.weight", 11),
        ("model.layers.3.mlp.experts.17.down_proj.weight", 3),
        ("model.embed_tokens.weight", None),
        ("model.norm.weight", None),
        ("lm_head.weight", None),
        ("model.layers.x.weight", None),
        ("model.mylayers.3.weight", None),
        ("model.layersX.3.weight", None),
    ],
)
def test_layer_of(name: str, layer: int | None) -> None:
    assert layer_of(name) == layer


# ---------------------------------------------------------------------------------------------- manifests


def test_index_and_spec_round_trip_through_json() -> None:
    specs = fake_model(n_layers=3)
    plan = plan_shards(specs, max_file_bytes=9_000)
    index = json.loads(plan.to_index_json())
    spec = json.loads(plan.to_spec_json())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"] == {"total_size": sum(s.nbytes for s in specs)}
    assert index["weight_map"] == plan.weight_map
    assert spec["tensor_map"]["model.norm.weight"] == {"shape": [32], "dtype": "float32"}
    assert spec["tensor_map"]["lm_head.weight"] == {"shape": [128, 32], "dtype": "bfloat16"}
    assert set(spec["tensor_map"]) == set(plan.weight_map)

    back = ShardPlan.from_index_and_spec(plan.to_index_json(), plan.to_spec_json())
    assert back == plan and list(back.files) == list(plan.files)
    check_same_layout(plan, back)

    # JSON key order in the files must not matter: an HF-style index sorted by tensor name parses the same.
    index["weight_map"] = dict(sorted(index["weight_map"].items(), reverse=True))
    spec["tensor_map"] = dict(sorted(spec["tensor_map"].items()))
    again = ShardPlan.from_index_and_spec(json.dumps(index).encode(), json.dumps(spec).encode())
    assert again == plan
    assert again.to_index_json() == plan.to_index_json()


def _manifests() -> tuple[dict, dict]:
    plan = plan_shards(fake_model(n_layers=2))
    return json.loads(plan.to_index_json()), json.loads(plan.to_spec_json())


def _edit(path: str, value: object) -> tuple[dict, dict]:
    """Manifests with one edit; path is 'index.<k>...' or 'spec.<k>...', value None deletes the key."""
    index, spec = _manifests()
    doc = {"index": index, "spec": spec}
    *parents, last = path.split("|")
    target: dict = doc
    for p in parents:
        target = target[p]
    if value is None:
        del target[last]
    else:
        target[last] = value
    return index, spec


Q = "model.layers.0.self_attn.q_proj.weight"
NONNEG = f"'{Q}': shape entries must be non-negative integers, got"


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("index|weight_map", None, "needs a 'weight_map'"),
        ("index|weight_map", [], "needs a 'weight_map'"),
        ("index|weight_map", {}, "'weight_map' is empty"),
        ("index|extra", 1, "unknown top-level key"),
        ("index|metadata", [], "'metadata' must be an object"),
        ("index|metadata", {"total_size": -1}, "total_size must be"),
        ("index|metadata", {"total_size": True}, "total_size must be"),
        ("index|metadata", {"total_size": 5}, "total_size is 5"),
        ("index|weight_map|" + Q, "../model-00001-of-00004.safetensors", "path separator"),
        ("index|weight_map|" + Q, "..model.safetensors", r"'\.\.'"),
        ("index|weight_map|" + Q, "model-00001..safetensors", r"'\.\.'"),
        ("index|weight_map|" + Q, "sub\\model.safetensors", "path separator"),
        ("index|weight_map|" + Q, "model.bin", "must end with '.safetensors'"),
        ("index|weight_map|" + Q, 3, "file names must be non-empty strings"),
        ("index|weight_map|__metadata__", "model-00001-of-00004.safetensors", "reserved"),
        ("spec|tensor_map", None, "needs a 'tensor_map'"),
        ("spec|tensor_map|" + Q, None, f"tensor '{Q}' is in the weight_map but not in tensor_map"),
        ("spec|tensor_map|model.ghost.weight", {"shape": [1], "dtype": "float32"}, "'model.ghost.weight'.*no weight"),
        ("spec|tensor_map|" + Q, [32, 32], f"'{Q}': entry must be an object"),
        ("spec|tensor_map|" + Q + "|shape", None, f"'{Q}': entry has no 'shape'"),
        ("spec|tensor_map|" + Q + "|dtype", None, f"'{Q}': entry has no 'dtype'"),
        ("spec|tensor_map|" + Q + "|shape", [32, -32], f"{NONNEG} -32"),
        ("spec|tensor_map|" + Q + "|shape", "32", f"'{Q}': shape must be a list"),
        ("spec|tensor_map|" + Q + "|shape", [32, 1.5], f"{NONNEG} 1.5"),
        ("spec|tensor_map|" + Q + "|shape", [32, True], f"{NONNEG} True"),
        ("spec|tensor_map|" + Q + "|dtype", "float128", f"'{Q}'.*unsupported dtype"),
        ("spec|tensor_map|" + Q + "|dtype", 16, f"'{Q}': dtype must be a string"),
        ("spec|tensor_map|" + Q + "|scale", 1.0, f"'{Q}': unsupported key"),
    ],
)
def test_from_index_and_spec_rejects_bad_manifests(path: str, value: object, message: str) -> None:
    index, spec = _edit(path, value)
    with pytest.raises(LayoutError, match=message):
        ShardPlan.from_index_and_spec(json.dumps(index).encode(), json.dumps(spec).encode())


@pytest.mark.parametrize(
    "index, message",
    [
        (b"[]", "top level must be a JSON object, got list"),
        (b'"weights"', "top level must be a JSON object, got str"),
        (b"null", "top level must be a JSON object"),
        (b"{not json", "not valid JSON"),
        (b'{"weight_map": {"a": "x.safetensors"}, "weight_map": {}}', "key 'weight_map' appears twice"),
        (b'{"metadata": {"total_size": NaN}, "weight_map": {}}', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
    ],
)
def test_from_index_and_spec_rejects_non_objects(index: bytes, message: str) -> None:
    _, spec = _manifests()
    with pytest.raises(LayoutError, match=f"{re.escape(INDEX_FILENAME)}: {message}"):
        ShardPlan.from_index_and_spec(index, json.dumps(spec).encode())
    good_index = json.dumps(_manifests()[0]).encode()
    with pytest.raises(LayoutError, match=re.escape(SPEC_FILENAME)):
        ShardPlan.from_index_and_spec(good_index, index)


def test_from_index_and_spec_accepts_dtype_codes_and_omitted_metadata() -> None:
    index = {"weight_map": {"a": "model-00001-of-00001.safetensors"}}
    spec = {"tensor_map": {"a": {"shape": [2, 3], "dtype": "F8_E4M3"}}}
    plan = ShardPlan.from_index_and_spec(json.dumps(index), json.dumps(spec))
    assert plan.specs["a"] == TensorSpec("a", (2, 3), "F8_E4M3")
    assert json.loads(plan.to_spec_json())["tensor_map"]["a"]["dtype"] == "float8_e4m3fn"


def test_shard_plan_constructor_checks_consistency() -> None:
    a, b = TensorSpec("a", (1,), "F32"), TensorSpec("b", (1,), "F32")
    f1, f2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    with pytest.raises(LayoutError, match="'a' is in both"):
        ShardPlan({f1: ["a"], f2: ["a"]}, {"a": f1}, {"a": a})
    with pytest.raises(LayoutError, match="weight_map disagrees.*'b'"):
        ShardPlan({f1: ["a"], f2: ["b"]}, {"a": f1, "b": f1}, {"a": a, "b": b})
    with pytest.raises(LayoutError, match="'b' has no TensorSpec"):
        ShardPlan({f1: ["a"], f2: ["b"]}, {"a": f1, "b": f2}, {"a": a})
    with pytest.raises(LayoutError, match="holds no tensors"):
        ShardPlan({f1: ["a"], f2: []}, {"a": f1}, {"a": a})
    with pytest.raises(KeyError, match="'zz'"):
        plan_shards([a]).file_of("zz")


def test_check_one_layer_per_file_flags_mixed_files() -> None:
    f = "model-00001-of-00001.safetensors"
    names = ["model.layers.0.w", "model.layers.1.w"]
    plan = ShardPlan({f: names}, {n: f for n in names}, {n: TensorSpec(n, (1,), "F32") for n in names})
    with pytest.raises(LayoutError, match="mixes layers.*'model.layers.0.w'.*'model.layers.1.w'"):
        check_one_layer_per_file(plan)


# --------------------------------------------------------------------------------------- check_same_layout


def _replace(specs: list[TensorSpec], name: str, new: TensorSpec | None) -> list[TensorSpec]:
    out = [s for s in specs if s.name != name]
    return out + ([new] if new is not None else [])


def test_check_same_layout_accepts_identical_layouts() -> None:
    specs = fake_model()
    parent = ShardPlan.from_index_and_spec(plan_shards(specs).to_index_json(), plan_shards(specs).to_spec_json())
    check_same_layout(parent, plan_shards(reversed(specs)))


def test_check_same_layout_names_dtype_and_shape_changes() -> None:
    specs = fake_model()
    parent = plan_shards(specs)
    name = "model.layers.1.mlp.up_proj.weight"
    child = plan_shards(_replace(specs, name, TensorSpec(name, (64, 32), "F32")))
    with pytest.raises(LayoutError, match=f"'{name}' changed dtype bfloat16 -> float32"):
        check_same_layout(parent, child)
    child = plan_shards(_replace(specs, name, TensorSpec(name, (64, 33), "BF16")))
    with pytest.raises(LayoutError, match=re.escape(f"'{name}' changed shape [64, 32] -> [64, 33]")):
        check_same_layout(parent, child)


def test_check_same_layout_names_added_and_removed_tensors() -> None:
    specs = fake_model()
    parent = plan_shards(specs)
    extra = TensorSpec("model.layers.2.mlp.bias", (8,), "BF16")
    with pytest.raises(LayoutError, match="'model.layers.2.mlp.bias' was added"):
        check_same_layout(parent, plan_shards([*specs, extra]))
    gone = "model.layers.3.self_attn.k_proj.weight"
    with pytest.raises(LayoutError, match=f"'{gone}' was removed"):
        check_same_layout(parent, plan_shards(_replace(specs, gone, None)))


def test_check_same_layout_names_a_moved_tensor() -> None:
    parent = plan_shards(fake_model())
    files = {f: list(ns) for f, ns in parent.files.items()}
    first, second = list(files)[1], list(files)[2]
    moved = files[first].pop()
    files[second].append(moved)
    child = ShardPlan(files, {n: f for f, ns in files.items() for n in ns}, parent.specs)
    with pytest.raises(LayoutError, match=f"'{moved}' moved from '{first}' to '{second}'"):
        check_same_layout(parent, child)
    # Re-planning with another cap moves many tensors: the message is bounded and says how many more.
    with pytest.raises(LayoutError, match=r"and \d+ more"):
        check_same_layout(parent, plan_shards(fake_model(), max_file_bytes=3_000))


# -------------------------------------------------------------------------------------------- hf_aux_files


def test_hf_aux_files_copies_config_and_tokenizer_files_only(tmp_path: Path) -> None:
    wanted = {
        "config.json": b'{"model_type": "llama", "num_hidden_layers": 4, "auto_map": {"AutoConfig": "c.C"}}',
        "generation_config.json": b'{"do_sample": true}',
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b"{}",
        "special_tokens_map.json": b"{}",
        "merges.txt": b"a b\n",
        "vocab.json": b"{}",
        "chat_template.jinja": b"{{ messages }}",
        "configuration_custom.py": b"# remote code named by auto_map\n",
    }
    for name, data in wanted.items():
        (tmp_path / name).write_bytes(data)
    blob = tmp_path / "blobs" / "abc123"  # HF cache style: the file is a symlink into a blob store
    blob.parent.mkdir()
    blob.write_bytes(b"\x00sentencepiece")
    (tmp_path / "tokenizer.model").symlink_to(blob)
    wanted["tokenizer.model"] = b"\x00sentencepiece"
    for name in ("model-00001-of-00002.safetensors", INDEX_FILENAME, SPEC_FILENAME, "adapter_config.json",
                 "pytorch_model.bin", "README.md", ".gitattributes", ".hidden.jinja"):
        (tmp_path / name).write_bytes(b"not to be copied")
    (tmp_path / "sub.jinja").mkdir()  # a folder whose name matches a pattern is not a file
    assert hf_aux_files(tmp_path) == wanted
    assert hf_aux_files(str(tmp_path)) == wanted


def test_hf_aux_files_errors(tmp_path: Path) -> None:
    assert hf_aux_files(None) == {}
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_aux_files(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_bytes(b"{}")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_aux_files(tmp_path)
    (tmp_path / "config.json").write_bytes(b"{broken")
    with pytest.raises(LayoutError, match="config.json: not valid JSON"):
        hf_aux_files(tmp_path)
    (tmp_path / "config.json").write_bytes(b"[1, 2]")
    with pytest.raises(LayoutError, match="must be a JSON object"):
        hf_aux_files(tmp_path)
