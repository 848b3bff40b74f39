"""Tied input and output embeddings are published once, under the embedding's name, as ``save_pretrained`` writes
them: the fleet's base model holds no ``lm_head.weight`` then, and refuses a full snapshot that names one.

Models are built by transformers from their configs and saved by ``save_pretrained``; the emulator stands for the
fleet, checking each full snapshot's names against that checkpoint. Skipped where transformers is not installed.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from safetensors import safe_open  # noqa: E402

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from fsdp_hotload.emulator import HotLoadEmulator  # noqa: E402
from fsdp_hotload.publish import TensorPublisher  # noqa: E402
from tests.publisher_helpers import config, expected_sha, served  # noqa: E402
from tests.snapshots import rebuild_accepted  # noqa: E402


def saved_names(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def llava_config(top: bool, nested: bool) -> dict[str, Any]:
    """A tiny LLaVA config.json whose top level and text_config say different things about tying."""
    return {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 10,
            "tie_word_embeddings": top,
            "text_config": {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
                            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "vocab_size": 64, "tie_word_embeddings": nested},
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 8, "patch_size": 4,
                              "projection_dim": 16}}


@pytest.mark.parametrize("top, nested", [(False, True), (True, False)])
def test_a_config_whose_levels_disagree_about_tying_follows_the_model(tmp_path: Path, top: bool,
                                                                     nested: bool) -> None:
    """A multimodal config.json with tie_word_embeddings false at the top level and true under text_config:
    transformers builds a tied model from it (LLaVA copies the nested true up), and save_pretrained writes no
    lm_head. The snapshot must name exactly the checkpoint's tensors, or the fleet refuses every full one."""
    hf, bucket = tmp_path / "hf", tmp_path / "bucket"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(llava_config(top, nested)))
    (hf / "tokenizer.json").write_text("{}")
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(transformers.AutoConfig.from_pretrained(str(hf)))
    assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(str(tmp_path / "saved"))
    want = saved_names(tmp_path / "saved")
    with HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf),
                                              busy_policy="wait")) as hot:
        hot.step(0)
        hot.wait()
    (m,) = hot.metrics
    assert m.ok
    assert set(rebuild_accepted(bucket, hot.metrics)[m.identity]) == want


def tiny_llama(tied: bool) -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def test_tensor_publisher_leaves_out_a_tied_lm_head_and_the_fleet_loads_the_snapshots(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``TensorPublisher(model.state_dict(), cfg)`` for a tied model: state_dict() lists the shared tensor under
    both names, the base checkpoint once. Each snapshot is loaded by the fleet (it refused every full one naming
    lm_head.weight), whether a later publish gives the tied name or not; the log says what was left out."""
    model = tiny_llama(tied=True)
    base, bucket = tmp_path / "base", tmp_path / "bucket"
    model.save_pretrained(str(base))
    (base / "tokenizer.json").write_text("{}")
    assert "lm_head.weight" not in saved_names(base)
    with HotLoadEmulator(str(bucket), replicas=1, api_key="test-key", base_model=str(base)) as emu:
        cfg = config(str(bucket), emu, tmp_path, hf_config_dir=str(base), busy_policy="wait")
        state = model.state_dict()
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"):
            pub = TensorPublisher(state, cfg)
        assert "'lm_head.weight' is the memory of 'model.embed_tokens.weight'" in caplog.text
        with pub:
            for step, given in enumerate([state, {k: v for k, v in state.items() if k != "lm_head.weight"}]):
                with torch.no_grad():
                    model.model.embed_tokens.weight.add_(0.01 * (step + 1))
                pub.publish(step, given)
                pub.wait()
                assert [m.ok for m in pub.metrics] == [True] * (step + 1), pub.metrics[-1].error
                want = {k: v for k, v in state.items() if k != "lm_head.weight"}
                assert served(emu)[0] == (pub.metrics[-1].identity, expected_sha(want))


@pytest.mark.parametrize("config_says, tied, published", [
    (False, True, True),     # the config says untied: the caller's names as given
    (None, False, True),     # an lm_head of its own is a weight of its own
    (None, True, False),     # silent config (GPT-2's default): the model's tying decides
])
def test_tensor_publisher_follows_config_json_for_a_tied_lm_head(tmp_path: Path, config_says: bool | None,
                                                                 tied: bool, published: bool) -> None:
    model = tiny_llama(tied)
    hf = tmp_path / "hf"
    hf.mkdir()
    body: dict[str, Any] = {"model_type": "llama"}
    if config_says is not None:
        body["tie_word_embeddings"] = config_says
    (hf / "config.json").write_text(json.dumps(body))
    (hf / "tokenizer.json").write_text("{}")
    state = model.state_dict()
    bucket = tmp_path / "bucket"
    with TensorPublisher(state, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf),
                                              busy_policy="wait")) as pub:
        pub.publish(0, state)
        pub.wait()
        if not published:  # the construction names, without the tied one, are enough
            pub.publish(1, {k: v for k, v in state.items() if k != "lm_head.weight"})
            pub.wait()
        with pytest.raises(KeyError, match="unexpected.*'extra'"):
            pub.publish(2, {**state, "extra": state["model.norm.weight"]})
    assert all(m.ok for m in pub.metrics)
    for names in rebuild_accepted(bucket, pub.metrics).values():
        assert ("lm_head.weight" in names) is published
        assert set(names) - {"lm_head.weight"} == set(state) - {"lm_head.weight"}


def test_fsdp1_units_that_untie_the_embedding_are_named_in_the_refusal(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/fsdp1_tied_units.py): FSDP1 flattens a weight tied across two FSDP units
    into each unit's own tensor. The refusal said that lm_head was not tied in the model and advised
    tie_word_embeddings=False, which would publish both copies under a config.json that says tied; it now names
    the FSDP units and how to keep the weights in one. In one unit the tied lm_head is left out."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "fsdp1_tied_units.py"), 2, ["--out", str(tmp_path)])
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["one_unit"] == ["embed_tokens.weight", "proj.weight", "proj.bias"], got
        assert "under FSDP1" in got["two_units"] and "in one FSDP unit" in got["two_units"], got
        assert "Pass tie_word_embeddings=False" not in got["two_units"], got
        assert "is a tensor of its own, not shared" in got["own_head"] and "FSDP" not in got["own_head"], got


def test_fsdp1_units_that_may_untie_the_embedding_are_warned_about_when_tying_is_unknown(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/fsdp1_tied_unknown.py): with no config.json and no tie_word_embeddings=, an
    lm_head that FSDP1 split from its embedding (the embedding in a unit of its own) is published as a tensor of
    its own, as the model decides. Rank 0 warns once, naming the tensor, what FSDP1 did and what to set; said as
    false, by the model's own config, or with both in one unit (tied, left out), nothing is said."""
    from tests.dist_util import SCRIPTS, run_torchrun

    out = tmp_path / "out"
    out.mkdir()
    job = run_torchrun(str(SCRIPTS / "fsdp1_tied_unknown.py"), 2, ["--bucket", str(tmp_path / "b"), "--out", str(out)])
    for rank in range(2):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["two_units"] == ["embed_tokens.weight", "proj.weight", "proj.bias", "lm_head.weight"], got
        assert got["two_units_false"] == got["two_units"] == got["two_units_config_untied"], got
        assert got["one_unit"] == ["embed_tokens.weight", "proj.weight", "proj.bias"], got
    said: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in job.stdout.splitlines():
        if line.startswith("rank0 WARNING CASE "):
            said[line.split()[3]], lines = lines, []
        elif line.startswith("rank0 WARNING hotload: "):
            lines.append(line)
    assert set(said) == {"two_units", "two_units_false", "two_units_config_untied", "one_unit"}, job.stdout
    untied = [line for line in said["two_units"] if "lm_head.weight" in line]
    assert len(untied) == 1, job.stdout
    for words in ("'lm_head.weight'", "'embed_tokens.weight'", "FSDP1", "two copies that train apart",
                  "one FSDP unit", "config.json in hf_config_dir", "HotloadCallback(tie_word_embeddings=True)",
                  "set it false"):
        assert words in untied[0], untied[0]
    quiet = said["two_units_false"] + said["two_units_config_untied"] + said["one_unit"]
    assert not [line for line in quiet if "lm_head" in line], job.stdout
    assert "tensor of its own beside" not in "".join(line for line in job.stdout.splitlines()
                                                     if line.startswith("rank1 ")), job.stdout
