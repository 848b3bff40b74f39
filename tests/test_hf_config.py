"""config.json as snapshots carry it: a base model's quantization_config only when quantized tensors back it."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_hotload import HotloadConfig
from fsdp_hotload.hf_config import (carried_files, hf_aux_files, hf_tie_word_embeddings, weight_dtypes,
                                    without_unbacked_quantization)
from fsdp_hotload.layout import LayoutError
from fsdp_hotload.publish import TensorPublisher
from tests.snapshots import rebuild_accepted

FP8_BASE = {"model_type": "deepseek_v3", "hidden_size": 64, "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}


def test_a_quantization_config_without_quantized_tensors_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    files = {"config.json": json.dumps(FP8_BASE).encode(), "tokenizer.json": b"{}"}
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        out = without_unbacked_quantization(files, ["BF16", "F32"])
    assert json.loads(out["config.json"]) == {k: v for k, v in FP8_BASE.items() if k != "quantization_config"}
    assert out["tokenizer.json"] == b"{}" and "quant_method fp8" in caplog.text
    for quantized in (["BF16", "F8_E4M3"], ["U8", "BF16"]):  # fp8 weights, packed mxfp4 blocks: kept as is
        assert without_unbacked_quantization(files, quantized) is files
    plain = {"config.json": b'{"model_type": "llama"}\n'}
    assert without_unbacked_quantization(plain, ["BF16"]) is plain


def test_a_nested_quantization_config_is_carried_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A multimodal config can keep its quantization under ``text_config``. The server's config check can be told
    to ignore top-level keys only, so the nested key stays, but a bf16 snapshot carrying it is said at start."""
    base = {"model_type": "llava", "text_config": {"model_type": "llama", **{k: FP8_BASE[k] for k in
                                                                            ("hidden_size", "quantization_config")}},
            "vision_config": {"hidden_size": 8}}
    files = {"config.json": json.dumps(base).encode()}
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        assert without_unbacked_quantization(files, ["BF16"]) is files
    assert "has text_config.quantization_config, but every published tensor is 16 bits or wider" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        assert without_unbacked_quantization(files, ["BF16", "F8_E4M3"]) is files  # quantized weights: as it was
        top = {"config.json": json.dumps({**base, "quantization_config": {"quant_method": "fp8"}}).encode()}
        out = without_unbacked_quantization(top, ["BF16"])
    assert json.loads(out["config.json"]) == base  # the top-level one left out, the nested one carried
    assert "has text_config.quantization_config" in caplog.text and "quant_method fp8" in caplog.text


def test_published_snapshot_config_drops_an_unbacked_fp8_quantization_config(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(FP8_BASE))
    model = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    pub = TensorPublisher(model, HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(hf)))
    pub.publish(0, model)
    pub.close()
    (written,) = (tmp_path / "bucket").glob("*/config.json")
    config = json.loads(written.read_text())
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v3"


@pytest.mark.parametrize("name, kept", [("model.layers.0.self_attn.mask", False),
                                         ("model.layers.0.mlp.down_proj.weight", True)])
def test_a_byte_buffer_does_not_keep_an_fp8_quantization_config(tmp_path: Path, name: str, kept: bool) -> None:
    """A bf16 model with a uint8 buffer (a mask): every I8/U8 tensor counted as quantized, so the snapshots kept the
    FP8 base's quantization_config and a server would read the bf16 weights as FP8. A uint8 tensor named as a
    weight (packed 4-bit values) still keeps it, as do MXFP4 blocks and an FP8 weight."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(FP8_BASE))
    model = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4),
             name: torch.arange(16, dtype=torch.uint8).reshape(4, 4)}
    pub = TensorPublisher(model, HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(hf)))
    pub.publish(0, model)
    pub.close()
    (written,) = (tmp_path / "bucket").glob("*/config.json")
    assert ("quantization_config" in json.loads(written.read_text())) is kept
    assert weight_dtypes([("a.causal_mask", "U8"), ("h.0.attn.bias", "U8"), ("a.weight", "I8"),
                          ("experts.gate_up_proj_blocks", "U8"), ("experts.down_proj_scales", "U8"),
                          ("b.weight", "BF16"), ("c.bias", "F8_E4M3")]) == ["I8", "U8", "U8", "BF16", "F8_E4M3"]


def test_fp8_weights_are_published_as_fp8_with_their_quantization_config(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """8-bit floats are quantised weights: cast to bf16 by default they lost their meaning (the scales still
    applied) and the config's quantization_config was dropped, so the fleet served a different model. A glob that
    casts them anyway is warned about while the model holds scales."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(FP8_BASE))
    fp8 = (torch.randn(8, 4) * 4).to(torch.float8_e4m3fn)
    model = {"model.layers.0.mlp.up_proj.weight": fp8, "model.layers.0.mlp.up_proj.weight_scale_inv":
             torch.tensor([[0.013671875]]), "model.norm.weight": torch.ones(4)}
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        pub = TensorPublisher(model, HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(hf),
                                                   busy_policy="wait"))
    assert "'*scale*': 'keep'" in caplog.text  # the fp32 scale would be cast to bf16 without an override
    pub.publish(0, model)
    pub.wait()
    folder = tmp_path / "bucket" / pub.metrics[0].identity
    assert json.loads((folder / "config.json").read_text())["quantization_config"] == FP8_BASE["quantization_config"]
    spec = json.loads((folder / "model.weight.spec.json").read_text())["tensor_map"]
    assert spec["model.layers.0.mlp.up_proj.weight"]["dtype"] == "float8_e4m3fn"
    fp8[0, :2] = torch.tensor([0.5, -3.0]).to(torch.float8_e4m3fn)  # a training step moves two fp8 values
    pub.publish(1, model)
    pub.close()
    assert [m.kind for m in pub.metrics] == ["full", "delta"] and all(m.ok for m in pub.metrics)
    served = rebuild_accepted(tmp_path / "bucket", pub.metrics)[pub.metrics[1].identity]
    got = served["model.layers.0.mlp.up_proj.weight"]
    assert got.dtype == "F8_E4M3" and got.data.tobytes() == fp8.view(torch.uint8).numpy().tobytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        kept = TensorPublisher(model, HotloadConfig(
            bucket_url=str(tmp_path / "b2"), hf_config_dir=str(hf),
            dtype_overrides={"*scale*": "keep", "*.up_proj.weight": "bfloat16"}))
    # widened by a glob, an fp8 weight is its raw values without its scale: said, naming the glob
    assert ("1 8-bit tensor(s) ('model.layers.0.mlp.up_proj.weight') are cast to bfloat16 by dtype_overrides glob "
            "'*.up_proj.weight', but the model holds scale tensors") in caplog.text
    kept.publish(0, model)
    kept.close()
    (folder,) = (tmp_path / "b2").glob("step-*")
    spec = json.loads((folder / "model.weight.spec.json").read_text())["tensor_map"]
    assert spec["model.layers.0.mlp.up_proj.weight_scale_inv"]["dtype"] == "float32"
    assert spec["model.layers.0.mlp.up_proj.weight"]["dtype"] == "bfloat16"  # a glob that names them wins


def test_widened_fp8_weights_are_warned_about_per_glob_and_scales_are_not_taken_for_weights() -> None:
    """The warning about 8-bit weights widened without their scales named the first glob and dtype for every
    widened tensor, and took an 8-bit scale (widened losslessly) for a weight that lost its scale."""
    from fsdp_hotload.dtype_policy import DtypePolicy

    fp8 = torch.float8_e4m3fn
    policy = DtypePolicy.of("bfloat16", {"*scale*": "float32", "a.*": "bfloat16", "b.*": "float16"})
    notes = policy.notes({"a.weight": fp8, "b.weight": fp8, "b.weight_scale": fp8, "a.weight_scale_inv": torch.float32})
    widened = [n for n in notes if "are cast to" in n and "without its scale" in n]
    assert len(widened) == 2, notes
    assert "('a.weight') are cast to bfloat16 by dtype_overrides glob 'a.*'" in widened[0]
    assert "('b.weight') are cast to float16 by dtype_overrides glob 'b.*'" in widened[1]
    assert not any("('b.weight_scale') are cast" in n for n in notes)  # an 8-bit scale widens losslessly
    assert DtypePolicy.of("bfloat16", {"a.*": "bfloat16"}).notes({"a.weight": fp8}) == []  # no scales: lossless


def test_a_lossy_cast_is_told_the_fix_that_does_not_cast_the_models_other_tensors() -> None:
    """An fp16 head on a bf16 model was told to set snapshot_dtype='float16', which casts the bf16 rest instead."""
    from fsdp_hotload.dtype_policy import DtypePolicy

    f16, b16, f32 = torch.float16, torch.bfloat16, torch.float32
    masters = {f"m{i}": f32 for i in range(4)}  # mostly fp32: mixed precision, whose masters may narrow
    (mixed,) = DtypePolicy.of("bfloat16").notes({"head": f16, "body": b16, **masters})
    assert "1 float16 tensor(s) ('head') are published as bfloat16" in mixed and "snapshot_dtype" not in mixed
    assert "add dtype_overrides {'<their glob>': 'keep'} (the model also holds bfloat16 tensors)" in mixed, mixed
    (alone,) = DtypePolicy.of("bfloat16").notes({"head": f16, "body": f16, **masters})
    assert "2 float16 tensor(s) ('head' and 1 more)" in alone and "set snapshot_dtype='float16'" in alone, alone


def test_fp32_tensors_kept_wide_in_a_16_bit_model_are_not_taken_for_masters() -> None:
    """A bf16 model's fp32 tensors were kept wide on purpose (transformers keeps DeepSeek-V3's router gate and
    bias in fp32): they were rounded to bf16 without a word, as if they were mixed-precision masters."""
    from fsdp_hotload.dtype_policy import DtypePolicy

    layers = {f"model.layers.{i}.mlp.experts.{j}.up_proj.weight": torch.bfloat16 for i in range(2) for j in range(4)}
    router = {"model.layers.1.mlp.gate.weight": torch.float32,
              "model.layers.1.mlp.gate.e_score_correction_bias": torch.float32}
    (note,) = DtypePolicy.of("bfloat16").notes({**layers, **router})
    assert note.startswith("2 float32 tensor(s) ('model.layers.1.mlp.gate.weight' and 1 more) are published as "
                           "bfloat16"), note
    assert "most of the model is bfloat16" in note and "{'<their glob>': 'keep'}" in note, note
    assert DtypePolicy.of("bfloat16", {"*.mlp.gate.*": "keep"}).notes({**layers, **router}) == []
    mostly_masters = {n: torch.float32 for n in layers} | {"model.norm.weight": torch.bfloat16}
    assert DtypePolicy.of("bfloat16").notes({**mostly_masters, **router}) == []  # fp32 masters: the expected path
    # an FP8 model's fp32 scales are neither masters nor kept-wide tensors: the scales note alone speaks of them
    fp8 = {f"l.{i}.{p}.weight": torch.float8_e4m3fn for i in range(2) for p in "qkvo"}
    scales = {n.replace(".weight", f".{k}"): torch.float32 for n in fp8 for k in ("weight_scale", "input_scale")}
    kept, scaled = DtypePolicy.of("bfloat16").notes({**fp8, **scales, **router, **layers})
    assert kept.startswith("2 float32 tensor(s) ('model.layers.1.mlp.gate.weight' and 1 more)"), kept
    assert "16 scale tensor(s)" in scaled and "scale" not in kept, scaled
    (note,) = DtypePolicy.of("bfloat16", {"*scale*": "keep"}).notes({**fp8, **scales, **router, **layers})
    assert note == kept  # the scales, kept, do not make fp32 the model's majority


def test_a_cast_made_by_a_glob_names_the_glob() -> None:
    """A glob's lossy cast was told to set snapshot_dtype to the value it already had, and a glob casting fp32
    masters to 8 bits (which snapshot_dtype refuses: no scales) was not told at all."""
    from fsdp_hotload.dtype_policy import DtypePolicy

    (note,) = DtypePolicy.of("float16", {"*.norm.weight": "bfloat16"}).notes({"a.weight": torch.float16,
                                                                              "m.norm.weight": torch.float16})
    assert "1 float16 tensor(s) ('m.norm.weight') are published as bfloat16" in note, note
    assert "they match dtype_overrides glob '*.norm.weight'" in note and "snapshot_dtype" not in note, note
    masters = {"a.weight": torch.float32, "model.norm.weight": torch.float32}
    (note,) = DtypePolicy.of("bfloat16", {"*": "float8_e4m3fn"}).notes(masters)
    assert "2 float32 tensor(s) ('a.weight' and 1 more) are published as float8_e4m3fn" in note, note
    assert "glob '*'" in note and "{'<their glob>': 'keep'} before it" in note, note


def test_dtype_names_in_any_case_and_a_sub_byte_tensor_is_told_what_to_do() -> None:
    from fsdp_hotload.dtype_policy import DtypePolicy, float_code

    assert {float_code(n, "snapshot_dtype") for n in ("BFLOAT16", "bfloat16", "BF16", "bf16", "Float16")} == {
        "BF16", "F16"}
    with pytest.raises(ValueError, match="'w' has dtype torch.float4_e2m1fn_x2.*publish the packed bytes as U8"):
        DtypePolicy.of("bfloat16").code("w", torch.float4_e2m1fn_x2)


@pytest.mark.parametrize("folder, named", [("base", None), ("bf16 copy", None), ("bf16 copy", ["quantization_config"]),
                                           ("bf16 copy", []), ("base", [])])
def test_an_fp8_base_trained_in_bf16_is_served_with_the_dropped_key_ignored(tmp_path: Path, folder: str,
                                                                            named: list[str] | None) -> None:
    """The server compares the snapshot's config.json with the base's and rejects a key present in only one:
    each signal names the quantization_config the snapshots leave out in validation.extra_fields_ignore. Only a
    key dropped from hf_config_dir's config.json was named, so a bf16 copy of the base there (or an earlier
    snapshot) left the list empty, and the server refused every publish. extra_fields_ignore ([] here) turns
    the automatic names off; the dropped key is named whatever it says."""
    from fsdp_hotload.emulator import HotLoadEmulator

    hf = tmp_path / "hf"
    hf.mkdir()
    held = FP8_BASE if folder == "base" else {k: v for k, v in FP8_BASE.items() if k != "quantization_config"}
    (hf / "config.json").write_text(json.dumps(held))
    bucket = str(tmp_path / "bucket")
    model = {"model.layers.0.mlp.up_proj.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    with HotLoadEmulator(bucket, base_config=FP8_BASE, api_key="k", replicas=1) as emu:
        cfg = HotloadConfig(bucket_url=bucket, hf_config_dir=str(hf), hotload_api_url=emu.url, account_id="a",
                            model_id="m", deployment_id="d", api_key="k", ready_timeout_s=20, poll_interval_s=0.02,
                            busy_policy="wait", extra_fields_ignore=named, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(2):
                model["model.norm.weight"][step] += 1.0
                pub.publish(step, model)
                pub.wait()
    if folder == "bf16 copy" and named == []:  # nothing named: every snapshot is refused
        assert [(m.kind, m.ok) for m in pub.metrics] == [("full", False)] * 2
        assert all("Extra base model config options: quantization_config" in str(m.error) for m in pub.metrics)
        return
    # without the ignore list the full snapshot fails: "Extra base model config options: quantization_config"
    assert [(m.kind, m.ok, m.error) for m in pub.metrics] == [("full", True, None), ("delta", True, None)]
    served = rebuild_accepted(tmp_path / "bucket", pub.metrics)[pub.metrics[1].identity]
    assert served["model.norm.weight"].data.tobytes() == model["model.norm.weight"].bfloat16().view(
        torch.int16).numpy().tobytes()


def test_remote_code_modules_are_carried_with_the_modules_they_import(tmp_path: Path) -> None:
    """auto_map may name processors as well as tokenizers, and remote code imports sibling modules (Kimi-K2's
    tokenization_kimi.py does ``from .tool_declaration_ts import ...``): without them the snapshot's tokenizer
    and processor cannot be loaded with trust_remote_code."""
    names = ["config.json", "tokenizer_config.json", "tokenization_kimi.py", "tool_declaration_ts.py",
             "processing_phi4mm.py", "image_processing_minicpmv.py", "conversation.py"]
    for name in names:
        (tmp_path / name).write_bytes(b"{}" if name.endswith(".json") else b"# module\n")
    assert sorted(hf_aux_files(tmp_path)) == ["config.json", "tokenizer_config.json"]  # no auto_map: no code
    auto_map = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map}))
    assert sorted(hf_aux_files(tmp_path)) == sorted(names)


def test_a_working_folders_scripts_are_not_carried(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A base folder that is also a working directory (config.json beside train.py) must not upload its scripts,
    and what they may hold, to the fleet's bucket: without an auto_map no module is anybody's remote code."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "train.py").write_text("KEY = 'do-not-upload'\n")
    with caplog.at_level(logging.INFO, logger="fsdp_hotload"):
        assert sorted(hf_aux_files(tmp_path)) == ["config.json"]
    assert "its .py files are not carried: train.py" in caplog.text


def test_mistral_tokenizer_files_are_carried(tmp_path: Path) -> None:
    """Mistral bases ship their tokenizer as tekken.json or tokenizer.model.v3 (mistral-common's names, which
    vLLM's mistral tokenizer mode reads); some ship no tokenizer.json at all."""
    names = ["config.json", "tekken.json", "tokenizer.model.v3", "tokenizer.mm.model.v7"]
    for name in names:
        (tmp_path / name).write_bytes(b"{}")
    assert sorted(hf_aux_files(tmp_path)) == sorted(names)


@pytest.mark.parametrize(("config", "dtypes", "warned"), [
    ({"torch_dtype": "float16"}, ["BF16", "I64"], True),     # a float16 base published as bf16: converted at load
    ({"dtype": "float32"}, ["BF16"], True),                  # recent transformers' key
    ({"torch_dtype": "bfloat16"}, ["BF16", "F32"], False),
    ({"torch_dtype": "float32"}, ["BF16", "F32"], False),    # some tensors kept in the config's dtype
    ({}, ["BF16"], False),
    ({"torch_dtype": "float16"}, ["I64"], False),            # nothing floating to convert
])
def test_a_config_dtype_the_snapshots_do_not_have_is_warned_about(
        caplog: pytest.LogCaptureFixture, config: dict, dtypes: list[str], warned: bool) -> None:
    """config.json is carried unchanged, so a server loading in its torch_dtype converts bf16 weights (float16
    overflows past 65504): the fleet would not serve the trainer's bytes, and nothing else would say so."""
    files = {"config.json": json.dumps(config).encode()}
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        assert carried_files(files, dtypes) is files
    named = config.get("torch_dtype", config.get("dtype"))
    assert (f"config.json says the weights are {named}" in caplog.text) is warned, caplog.text


@pytest.mark.parametrize(("config", "dtypes", "named"), [
    ({"model_type": "llava", "text_config": {"torch_dtype": "float16"}}, ["BF16"], "float16"),  # vLLM's fallback
    ({"text_config": {"dtype": "float16"}, "vision_config": {"torch_dtype": "bfloat16"}}, ["BF16"], "float16"),
    ({"vision_config": {"torch_dtype": "float16"}}, ["BF16"], "float16"),
    ({"torch_dtype": "bfloat16", "text_config": {"torch_dtype": "float16"}}, ["BF16"], None),  # the top level's
    ({"torch_dtype": "float16"}, ["BF16"] * 99 + ["F16"], "float16"),  # one tensor in the config's dtype
    ({"torch_dtype": "float16"}, {"BF16": 10_000, "F16": 16}, "float16"),  # element counts
    ({"torch_dtype": "float16"}, {"BF16": 16, "F16": 10_000, "I64": 50_000}, None),
])
def test_the_config_dtype_is_read_where_vllm_reads_it_and_weighed_by_elements(
        caplog: pytest.LogCaptureFixture, config: dict, dtypes: Any, named: str | None) -> None:
    """A multimodal config names its dtype under text_config (or vision_config), where vLLM finds it when the top
    level names none; and a server loading in that dtype converts every weight but the few already in it."""
    files = {"config.json": json.dumps(config).encode()}
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        assert carried_files(files, dtypes) is files
    assert ("config.json says the weights are" in caplog.text) is (named is not None), caplog.text
    if named is not None:
        assert f"says the weights are {named}, but the snapshots' floating tensors are" in caplog.text


def test_a_publisher_warns_when_most_weights_are_not_in_the_config_dtype(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A small float16 tensor kept as it is beside a large one published as bf16, under a float16 config: the
    large one is what a server loading in float16 converts."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama", "torch_dtype": "float16"}')
    (hf / "tokenizer.json").write_text("{}")
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(hf), dtype_overrides={"b": "keep"})
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        TensorPublisher({"w": torch.randn(64, 64), "b": torch.randn(4).half()}, cfg).close()
    assert "floating tensors are mostly BF16 (99.9% of their elements; the rest F16)" in caplog.text, caplog.text


def test_tokenizer_files_of_fixed_names_are_carried(tmp_path: Path) -> None:
    """Tokenizers that read one more file: GPT-NeoX-Japanese's emoji.json, DeBERTa-v2's spm.model, RemBERT's
    sentencepiece.model, Whisper's normalizer.json. A folder with spm.model alone holds a tokenizer."""
    names = ["config.json", "emoji.json", "spm.model", "sentencepiece.model", "normalizer.json", "notes.json"]
    for name in names:
        (tmp_path / name).write_text("{}")
    assert sorted(hf_aux_files(tmp_path)) == sorted(set(names) - {"notes.json"})


def test_a_tokenizer_loads_from_the_files_a_snapshot_carries(tmp_path: Path) -> None:
    """GPT-NeoX-Japanese (a causal LM) saves emoji.json beside vocab.txt; without it the tokenizer does not load."""
    transformers = pytest.importorskip("transformers")
    base, snap = tmp_path / "base", tmp_path / "snap"
    base.mkdir(), snap.mkdir()
    (tmp_path / "v.txt").write_text("\n".join(["<|endoftext|>", "<|startoftext|>", "<|padding|>", "<|separator|>",
                                               "a", "b", "\u3042"]) + "\n", encoding="utf-8")
    (tmp_path / "e.json").write_text(json.dumps({"emoji": {}, "emoji_inv": {}}))
    transformers.GPTNeoXJapaneseTokenizer(str(tmp_path / "v.txt"), str(tmp_path / "e.json")).save_pretrained(base)
    (base / "config.json").write_text(json.dumps({"model_type": "gpt_neox_japanese"}))
    carried = hf_aux_files(base)
    assert set(carried) == {p.name for p in base.iterdir()}
    for name, data in carried.items():
        (snap / name).write_bytes(data)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(snap))
    assert tokenizer.convert_ids_to_tokens(tokenizer("ab")["input_ids"]) == ["a", "b"]


def test_a_config_json_nested_too_deeply_is_an_error_naming_it(tmp_path: Path) -> None:
    """The JSON decoder recurses per nesting level: a bare RecursionError named neither the file nor the folder."""
    (tmp_path / "config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (tmp_path / "tokenizer.json").write_text("{}")
    error = f"^{re.escape(str(tmp_path / 'config.json'))}: not JSON we read, nested too deeply"
    with pytest.raises(LayoutError, match=error):
        hf_aux_files(tmp_path)
    with pytest.raises(LayoutError, match=error):
        hf_tie_word_embeddings(tmp_path)


def test_additional_chat_templates_are_carried_and_survive_a_rebuild(tmp_path: Path) -> None:
    """transformers (2025 on) saves a tokenizer's named templates (tool use, RAG) in additional_chat_templates/;
    a snapshot without them loads a tokenizer that has lost those templates. Other sub-folders stay home."""
    from fsdp_hotload.arc.folder import apply_paths

    hf = tmp_path / "hf"
    (hf / "additional_chat_templates").mkdir(parents=True)
    (hf / "runs").mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "chat_template.jinja").write_text("{{ messages }}")
    (hf / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (hf / "additional_chat_templates" / "notes.txt").write_text("not a template")
    (hf / "runs" / "template.jinja").write_text("a working folder's file")
    assert sorted(hf_aux_files(hf)) == ["additional_chat_templates/tool_use.jinja", "chat_template.jinja",
                                        "config.json"]

    model = {"model.norm.weight": torch.ones(4)}
    bucket = tmp_path / "bucket"
    with TensorPublisher(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), full_every=2,
                                              busy_policy="wait")) as pub:
        for step in range(2):
            model["model.norm.weight"] += 1
            pub.publish(step, model)
            pub.wait()
    full, delta = (bucket / m.identity for m in pub.metrics)
    for snapshot in (full, delta):
        assert (snapshot / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools }}"
    out = tmp_path / "rebuilt"
    apply_paths(str(full), str(delta), str(out))  # the reference rebuild keeps the folder too
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools }}"
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"


def _raw_safetensors(path: Path, header: bytes) -> None:
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def test_base_tensor_shapes_reads_headers_and_never_raises(tmp_path: Path) -> None:
    """The base checkpoint's shapes feed only start-up checks: whatever the folder holds, they come back or None,
    never an exception (one would stop rank 0 alone, after its publisher started). With an index, a file that is
    not a safetensors file (a Git LFS pointer) or holds a malformed header leaves its tensors' shapes unknown and
    keeps the names; a dim that is not a non-negative integer is unknown too."""
    from safetensors.torch import save_file

    from fsdp_hotload.hf_config import base_tensor_shapes

    good = tmp_path / "good"
    good.mkdir()
    save_file({"a.weight": torch.zeros(2, 3), "b.bias": torch.zeros(4)}, str(good / "model.safetensors"))
    assert base_tensor_shapes(good) == {"a.weight": (2, 3), "b.bias": (4,)}
    assert base_tensor_shapes(None) is None and base_tensor_shapes(tmp_path / "absent") is None

    odd = {"inf": b'{"x": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}',
           "nan": b'{"x": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}',
           "str": b'{"x": {"dtype": "F32", "shape": "12", "data_offsets": [0, 4]}}',
           "neg": b'{"x": {"dtype": "F32", "shape": [-1, true], "data_offsets": [0, 4]}}',
           "deep": b"[" * 200_000, "list": b"[1, 2]", "bad": b'{"x": '}
    for label, header in odd.items():
        bare = tmp_path / label
        bare.mkdir()
        _raw_safetensors(bare / "model.safetensors", header)
        got = base_tensor_shapes(bare)
        assert got in (None, {"x": None}), (label, got)  # without an index: unknown, nothing raised
        indexed = tmp_path / f"{label}-indexed"
        indexed.mkdir()
        _raw_safetensors(indexed / "model-00001-of-00002.safetensors", header)
        save_file({"a.weight": torch.zeros(2, 3)}, str(indexed / "model-00002-of-00002.safetensors"))
        weight_map = {"x": "model-00001-of-00002.safetensors", "a.weight": "model-00002-of-00002.safetensors"}
        (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        assert base_tensor_shapes(indexed) == {"x": None, "a.weight": (2, 3)}, label

    lfs = tmp_path / "lfs"
    lfs.mkdir()
    (lfs / "model-00001-of-00001.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 123\n")
    (lfs / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001-of-00001.safetensors"}}))
    assert base_tensor_shapes(lfs) == {"a.weight": None}  # the names, as before any header was read
    (lfs / "model.safetensors.index.json").write_text("[" * 200_000)
    assert base_tensor_shapes(lfs) is None
    (lfs / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"1": 2, "3": None}}))
    assert base_tensor_shapes(lfs) == {"1": None, "3": None}


def test_links_to_missing_files_are_told_not_skipped_in_silence(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A copy of an HF cache snapshot folder without its blobs holds links to nothing: a tokenizer file was left
    out of every snapshot without a word, and a dangling config.json was reported as missing."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "tokenizer_config.json").symlink_to(tmp_path / "blobs" / "gone")
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        files = hf_aux_files(tmp_path)
    assert set(files) == {"config.json"}
    assert any("tokenizer_config.json is a link to" in r.getMessage() and "does not exist" in r.getMessage()
               for r in caplog.records), caplog.text
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").symlink_to(tmp_path / "blobs" / "gone2")
    with pytest.raises(FileNotFoundError, match=r"config.json is a link to .*gone2.*cp -L"):
        hf_aux_files(tmp_path)


def test_a_looping_link_is_told_and_a_git_lfs_pointer_is_refused(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A link to itself raised OSError (too many levels of links) out of the publisher's start; a tokenizer
    cloned without `git lfs pull` was carried into every snapshot as its 130-byte pointer text."""
    from fsdp_hotload.layout import LayoutError

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "vocab.json").symlink_to("vocab.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        assert set(hf_aux_files(tmp_path)) == {"config.json", "tokenizer.json"}
    assert "vocab.json cannot be followed" in caplog.text
    (tmp_path / "tokenizer.json").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n")
    with pytest.raises(LayoutError, match=r"tokenizer.json is a Git LFS pointer.*git lfs pull"):
        hf_aux_files(tmp_path)


def test_an_older_compression_config_without_quantized_tensors_is_left_out_too() -> None:
    """vLLM reads compressed-tensors' ``compression_config`` as it reads ``quantization_config``: carried with BF16
    weights, the fleet would build quantized layers with no scales to load."""
    from fsdp_hotload.hf_config import dropped_config_keys

    base = {"model_type": "llama", "compression_config": {"format": "pack-quantized"}, "hidden_size": 8}
    files = {"config.json": json.dumps(base).encode()}
    out = without_unbacked_quantization(files, ["BF16"])
    assert json.loads(out["config.json"]) == {"model_type": "llama", "hidden_size": 8}
    assert dropped_config_keys(files, out) == ["compression_config"]  # named in each signal's extra_fields_ignore
    assert without_unbacked_quantization(files, ["BF16", "F8_E4M3"]) == files


def test_a_base_folder_without_an_index_is_read_as_transformers_reads_it(tmp_path: Path) -> None:
    """Without an index every *.safetensors was read: a Mistral consolidated.safetensors beside model.safetensors
    added names no transformers model has, and a warning that they were not published."""
    from safetensors.torch import save_file

    from fsdp_hotload.hf_config import base_tensor_shapes, base_tensors

    save_file({"model.norm.weight": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    save_file({"norm.weight": torch.zeros(4)}, str(tmp_path / "consolidated.safetensors"))
    assert base_tensor_shapes(tmp_path) == {"model.norm.weight": (4,)}
    assert base_tensors(tmp_path)[1] == {"model.norm.weight": "F32"}
    (tmp_path / "model.safetensors").unlink()
    assert base_tensor_shapes(tmp_path) is None  # Mistral's format alone: nothing to compare with


@pytest.mark.parametrize("files, warned", [(["config.json"], True), (["config.json", "tokenizer.json"], False),
                                           (["config.json", "tokenizer.model"], False),
                                           (["config.json", "tekken.json"], False),
                                           (["config.json", "vocab.json", "merges.txt"], False),
                                           (["config.json", "tokenizer_config.json"], True)])
def test_a_base_folder_without_a_tokenizer_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                           files: list[str], warned: bool) -> None:
    """A trainer's output folder (config.json only) passed as hf_config_dir: the snapshots carried no tokenizer,
    and a server loading it from the model's folder could not start."""
    for name in files:
        (tmp_path / name).write_text("{}")
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        hf_aux_files(tmp_path)
    assert ("holds no tokenizer file" in caplog.text) is warned


def test_a_delta_snapshot_as_hf_config_dir_gives_names_but_no_shapes(tmp_path: Path) -> None:
    """hf_config_dir at an earlier run's snapshot (for its config and tokenizer) that is a delta: its files' entries
    are U8 payloads, whose shapes were compared with the published tensors' and warned about as a layout the fleet
    would not load."""
    from fsdp_hotload.arc import save_file
    from fsdp_hotload.arc.container import encode_delta_file
    from fsdp_hotload.arc.dtypes import RawTensor
    from fsdp_hotload.hf_config import base_tensors, shapes_note

    parent = {"model.norm.weight": RawTensor.from_any(torch.randn(16).bfloat16())}
    new = {"model.norm.weight": RawTensor.from_any(torch.randn(16).bfloat16())}
    (tmp_path / "model.safetensors").write_bytes(encode_delta_file(parent, new, parent_identity="step-000001-ab12cd34"))
    shapes, dtypes = base_tensors(tmp_path)
    assert shapes == {"model.norm.weight": None} and dtypes == {}
    assert shapes_note([("model.norm.weight", (16,))], shapes, where="hf_config_dir") is None
    (tmp_path / "model.safetensors").write_bytes(save_file(new))  # a full snapshot's file: compared as before
    assert base_tensors(tmp_path)[0] == {"model.norm.weight": (16,)}
