"""What HotloadCallback says at start about a model the fleet may not load as its base checkpoint (a narrower
dtype, unmerged LoRA adapters, names or shapes that differ from the checkpoint's) and the split= that publishes a
transformers 5 MoE model's fused experts under the checkpoint's names and layout, bit exact; a split must tile its
tensor and a malformed one is refused naming the tensor."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_hotload import HotloadCallback, HotloadConfig
from fsdp_hotload.arc.dtypes import RawTensor
from tests.moe import fused_moe_layer
from tests.snapshots import rebuild_accepted
from tests.test_callback import Net


def test_an_fp16_model_published_as_bf16_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The callback names tensors whose trainer dtype is cast to another narrow format, and globs that match
    nothing; with the matching snapshot_dtype there is nothing to say."""
    model = Net().half()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "a"),
                                             dtype_overrides={"nope.*": "keep"})).close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "6 float16 tensor(s) ('embed_tokens.weight' and 5 more) are published as bfloat16" in text, text
    assert "dtype_overrides glob 'nope.*' matches no floating tensor" in text, text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "b"), snapshot_dtype="float16")).close()
    assert not [r for r in caplog.records if "dtype" in r.getMessage()], caplog.records


def test_unmerged_lora_adapters_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """peft-style adapters: dropping them with rename would publish the base weights without the update."""
    model = Net()
    model.layers[0].lora_A = nn.ModuleDict({"default": nn.Linear(16, 2, bias=False)})
    model.layers[0].lora_B = nn.ModuleDict({"default": nn.Linear(2, 16, bias=False)})
    drop = lambda n: None if ".lora_" in n else n  # noqa: E731
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "a")), rename=drop).close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "2 unmerged LoRA adapter tensor(s) (e.g. 'layers.0.lora_A.default.weight')" in text, text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / "b"))).close()
    assert not [r for r in caplog.records if "LoRA" in r.getMessage()], caplog.records


class FusedMoe(nn.Module):
    """A sparse MoE decoder as transformers 5 builds it: each projection of all experts is one 3-D parameter,
    while the model's checkpoints name each expert's 2-D weight."""

    def __init__(self, experts: int = 4, hidden: int = 8, inter: int = 4) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(20, hidden)
        self.model.layers = nn.ModuleList([fused_moe_layer(experts, hidden, inter)])
        self.lm_head = nn.Linear(hidden, 20, bias=False)


def _base_checkpoint(folder: Path, names: list[str]) -> None:
    """A base model folder whose weight index names ``names`` (only the index is read)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "tie_word_embeddings": False}))
    weight_map = {n: "model-00001-of-00001.safetensors" for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_names_the_base_checkpoint_lacks_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A transformers 5 MoE model publishes fused expert tensors, which transformers 5 itself loads but the fleet,
    checking against its base checkpoint's per-expert names, refuses on every publish: said at construction."""
    per_expert = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4)
                  for p in ("gate_proj", "up_proj", "down_proj")]
    _base_checkpoint(tmp_path / "hf", ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                                        "lm_head.weight", *per_expert])
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(FusedMoe(), HotloadConfig(bucket_url=str(tmp_path / "a"),
                                                  hf_config_dir=str(tmp_path / "hf"))).close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "tensor names differ from the base checkpoint's" in text, text
    assert "12 base tensor(s) are not published (e.g. 'model.layers.0.mlp.experts.0.down_proj.weight')" in text
    assert "2 published tensor(s) are not in the base checkpoint" in text
    assert "fused MoE experts" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):  # no weights in the folder: the names alone say it
        HotloadCallback(FusedMoe(), HotloadConfig(bucket_url=str(tmp_path / "b"))).close()
    assert "fused MoE expert parameters (e.g. 'model.layers.0.mlp.experts.down_proj', 2 in all)" in caplog.text


def test_names_that_are_the_base_checkpoints_pass_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Index or bare safetensors headers: the same names (a tied lm_head left out on both sides) say nothing."""
    from safetensors.torch import save_file

    _base_checkpoint(tmp_path / "hf", ["embed_tokens.weight", "layers.0.weight", "layers.0.bias", "layers.1.weight",
                                        "layers.1.bias", "lm_head.weight", "steps"])
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    save_file({n: t.detach().clone() for n, t in Net().state_dict().items()}, str(bare / "model.safetensors"))
    for folder in (tmp_path / "hf", bare):
        with caplog.at_level("WARNING", logger="fsdp_hotload"):
            HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / folder.name / "b"),
                                                 hf_config_dir=str(folder))).close()
        assert "base checkpoint" not in caplog.text and "MoE" not in caplog.text, caplog.text
    (bare / "model.safetensors").write_bytes(b"\x00" * 4)  # unreadable: nothing to compare with, no error
    HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / "c"), hf_config_dir=str(bare))).close()


def test_a_tensor_in_another_layout_than_the_base_checkpoints_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The names match but a shape does not (a checkpoint that stores a tensor transposed, as Qwen3-VL-MoE's does
    its experts against transformers 5's model): the fleet would refuse every snapshot, so it is said at start,
    read from the safetensors headers, bare or through the index; an index whose files are absent gives names
    only, and says nothing of shapes."""
    from safetensors.torch import save_file

    state = {n: t.detach().clone() for n, t in Net().state_dict().items()}
    state["embed_tokens.weight"] = state["embed_tokens.weight"].t().contiguous()  # (16, 40) for (40, 16)
    state["layers.1.bias"] = torch.zeros(17)
    bare, indexed, names_only = (tmp_path / d for d in ("bare", "indexed", "names"))
    for folder in (bare, indexed, names_only):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    save_file(state, str(bare / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in state}}
    for folder in (indexed, names_only):
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(state, str(indexed / "model-00001-of-00001.safetensors"))
    for folder in (bare, indexed, names_only):
        caplog.clear()
        with caplog.at_level("WARNING", logger="fsdp_hotload"):
            HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / folder.name / "b"),
                                                 hf_config_dir=str(folder))).close()
        text = "\n".join(r.getMessage() for r in caplog.records)
        if folder is names_only:
            assert "shape" not in text and "base checkpoint" not in text, text
            continue
        assert ("2 published tensor(s) have another shape than in the base checkpoint in hf_config_dir (e.g. "
                "'embed_tokens.weight': [40, 16] published, [16, 40] there (the same dims in another order: a "
                "transposed layout)), so the fleet will not load these snapshots as that checkpoint's tensors: "
                "publish them in its layout") in text, text
        assert "names differ" not in text, text


def test_fused_experts_are_published_per_expert_bit_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    """split=split_fused_experts publishes a transformers 5 MoE model under its checkpoint's per-expert names:
    each expert's gate, up and down weights are its ranges of the fused tensors, through a full snapshot and a
    delta, and the names check against the base checkpoint has nothing to say."""
    from fsdp_hotload import split_fused_experts

    experts, hidden, inter = 3, 8, 4
    per_expert = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(experts)
                  for p in ("gate_proj", "up_proj", "down_proj")]
    _base_checkpoint(tmp_path / "hf", ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                                        "lm_head.weight", *per_expert])
    torch.manual_seed(0)
    model = FusedMoe(experts, hidden, inter)
    bucket = tmp_path / "bucket"
    cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(tmp_path / "hf"), full_every=2,
                        busy_policy="wait")
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        hot = HotloadCallback(model, cfg, split=split_fused_experts)
    assert "base checkpoint" not in caplog.text and "MoE" not in caplog.text, caplog.text
    mlp = model.model.layers[0].mlp

    def published() -> dict[str, torch.Tensor]:
        want = {"model.embed_tokens.weight": model.model.embed_tokens.weight,
                "model.layers.0.mlp.gate.weight": mlp.gate.weight, "lm_head.weight": model.lm_head.weight}
        for e in range(experts):
            want[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = mlp.experts.gate_up_proj[e, :inter]
            want[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = mlp.experts.gate_up_proj[e, inter:]
            want[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = mlp.experts.down_proj[e]
        return want

    _two_publishes_bit_exact(model, hot, published, bucket)


def _two_publishes_bit_exact(model: nn.Module, hot: HotloadCallback, published: Any, bucket: Path) -> None:
    """Two sparse updates of ``model``, each published by ``hot`` (a full snapshot, then a delta); each rebuilt
    snapshot must hold exactly what ``published()`` (name -> tensor, in the published layout) gave at its step,
    cast to bf16. Closes ``hot``."""
    expected = []
    with hot:
        for step in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1 * (torch.rand_like(p) < 0.3))
            hot.step(step)
            hot.wait()
            expected.append({k: RawTensor.from_any(v.detach().bfloat16().contiguous())
                             for k, v in published().items()})
    assert [(m.kind, m.ok) for m in hot.metrics] == [("full", True), ("delta", True)]
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    for m, want_raw in zip(hot.metrics, expected):
        got = rebuilt[m.identity]
        assert sorted(got) == sorted(want_raw)
        for name, raw in want_raw.items():
            assert (got[name].shape, got[name].data.tobytes()) == (raw.shape, raw.data.tobytes()), name


def test_fused_experts_in_a_transposed_checkpoint_layout_are_published_bit_exact(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """split=transpose_fused_experts publishes the fused experts as Qwen3-VL-MoE's checkpoints store them, their
    last two dims swapped, through a full snapshot and a delta, bit exact; a base checkpoint in that layout then
    gives no shape warning, and one in the model's layout does. A part split per expert and transposed (a
    per-expert checkpoint that stores each weight transposed) is published likewise."""
    from safetensors.torch import save_file

    from fsdp_hotload import transpose_fused_experts

    experts, hidden, inter = 3, 8, 4
    torch.manual_seed(0)
    model = FusedMoe(experts, hidden, inter)
    mlp = model.model.layers[0].mlp

    def per_expert_transposed(path: str, shape: tuple[int, ...]) -> list[tuple[Any, ...]] | None:
        if not path.endswith("down_proj"):
            return None
        return [(f"{path}.{e}", e * hidden * inter, (hidden, inter), (1, 0)) for e in range(experts)]

    def layouts() -> list[dict[str, torch.Tensor]]:  # what each split publishes, from the live weights
        common = {"model.embed_tokens.weight": model.model.embed_tokens.weight,
                  "model.layers.0.mlp.gate.weight": mlp.gate.weight, "lm_head.weight": model.lm_head.weight}
        down = "model.layers.0.mlp.experts.down_proj"
        return [{**common, "model.layers.0.mlp.experts.gate_up_proj": mlp.experts.gate_up_proj.transpose(1, 2),
                 down: mlp.experts.down_proj.transpose(1, 2)},
                {**common, "model.layers.0.mlp.experts.gate_up_proj": mlp.experts.gate_up_proj,
                 **{f"{down}.{e}": mlp.experts.down_proj[e].t() for e in range(experts)}}]

    for i, split in enumerate([transpose_fused_experts, per_expert_transposed]):
        hf, bucket = tmp_path / f"hf{i}", tmp_path / f"bucket{i}"
        hf.mkdir()
        (hf / "config.json").write_text("{}")
        save_file({k: v.detach().contiguous() for k, v in layouts()[i].items()}, str(hf / "model.safetensors"))
        cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), full_every=2, busy_policy="wait")
        caplog.clear()
        with caplog.at_level("WARNING", logger="fsdp_hotload"):
            hot = HotloadCallback(model, cfg, split=split)
        assert "shape" not in caplog.text and "base checkpoint" not in caplog.text, caplog.text
        _two_publishes_bit_exact(model, hot, lambda i=i: layouts()[i], bucket)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):  # the model's layout against a transposed checkpoint
        HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "c"), hf_config_dir=str(tmp_path / "hf0")
                                             )).close()
    assert ("'model.layers.0.mlp.experts.down_proj': [3, 8, 4] published, [3, 4, 8] there (the same dims in another "
            "order: a transposed layout)), so the fleet will not load these snapshots as that checkpoint's tensors: "
            "pass split=transpose_fused_experts") in caplog.text, caplog.text


def test_a_start_up_check_that_fails_is_told_and_publishing_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The start-up checks run on rank 0 only, after the publisher started: an error in one would stop rank 0 alone
    while the other ranks go on to their first collective. It is logged instead, and the callback publishes."""
    import fsdp_hotload.callback as callback_module

    def broken(*_a: Any, **_k: Any) -> str | None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(callback_module, "shapes_note", broken)
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        with HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / "b"), busy_policy="wait")) as hot:
            hot.step(0)
    assert "start-up checks of the model's names, dtypes and shapes failed: RecursionError" in caplog.text
    assert [(m.kind, m.ok) for m in hot.metrics] == [("full", True)]


def test_a_split_must_tile_its_tensor(tmp_path: Path) -> None:
    """A split that leaves elements out would publish a model without them; one that overlaps, some twice."""
    from fsdp_hotload.fsdp import full_tensor_specs

    def gap(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
        if path.endswith("down_proj"):  # (4, 8, 4): 128 elements; parts of 32 at 0 and 64
            return [(path + ".a", 0, (8, 4)), (path + ".b", 64, (8, 4))]
        return None

    def short(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
        return [(path + ".a", 0, (1,))] if path.endswith("down_proj") else None

    with pytest.raises(ValueError, match=r"tile the tensor's elements in order; the part at element 32"):
        full_tensor_specs(FusedMoe(), split=gap)
    with pytest.raises(ValueError, match=r"covers 1 of its 128 elements"):
        full_tensor_specs(FusedMoe(), split=short)


def _raises(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
    if path.endswith("down_proj"):
        raise KeyError("no such expert")
    return None


@pytest.mark.parametrize("split", [
    lambda p, s: [(p + ".a", 0)] if p.endswith("down_proj") else None,  # no shape
    lambda p, s: [(p + ".a", 0, 128)] if p.endswith("down_proj") else None,  # a shape that is not a sequence
    lambda p, s: [(p + ".a", None, (4, 8, 4))] if p.endswith("down_proj") else None,  # no first element
    lambda p, s: "parts" if p.endswith("down_proj") else None,  # not a list of parts
    lambda p, s: [(p + ".a", 0, (-4, -32))] if p.endswith("down_proj") else None,  # negative dims, 128 elements
    lambda p, s: [(p + ".a", 0, (4, 8, 4), (0, 0, 1))] if p.endswith("down_proj") else None,  # not an order
    lambda p, s: [(p + ".a", 0, (4, 8, 4), (0, 2))] if p.endswith("down_proj") else None,  # too few dims
    lambda p, s: [(p + ".a", 0, (4, 8, 4), (0, 2, 1), "x")] if p.endswith("down_proj") else None,  # a str shape
    lambda p, s: [(p + ".a", 0, (4, 8, 4), None, (4, 30))] if p.endswith("down_proj") else None,  # 120 elements
    lambda p, s: [(p + ".a", 0, (4, 8, 4), None, (-4, -32))] if p.endswith("down_proj") else None,  # negative
    lambda p, s: [(p + ".a", 0, (4, 8, 4), None, (128,), 0)] if p.endswith("down_proj") else None,  # six items
    _raises,
], ids=["pair", "int-shape", "none-start", "str", "negative-dims", "repeated-dim", "short-order", "str-as-shape",
        "as-shape-count", "as-shape-negative", "six", "raises"])
def test_a_malformed_split_is_refused_naming_the_tensor(split: Any) -> None:
    """A split is user code run over every tensor of the model: whatever goes wrong in it or in what it returns
    is a ValueError that names the tensor it was dividing, never an unpacking or comparison error from inside
    the walk, nor a part of negative dims (whose element count can still come out right) reaching the snapshot."""
    from fsdp_hotload.fsdp import full_tensor_specs

    with pytest.raises(ValueError, match=r"split\('model\.layers\.0\.mlp\.experts\.down_proj', \(4, 8, 4\)\)"):
        full_tensor_specs(FusedMoe(), split=split)
