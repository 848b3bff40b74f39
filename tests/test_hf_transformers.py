"""Snapshots as the fleet's Hugging Face loader reads them: transformers' ``from_pretrained`` on every step.

One torchrun job (2 ranks, gloo, FSDP2 per decoder layer and root) trains tiny random models built from their
configs, a Llama with tied embeddings, a Qwen2 (q/k/v biases) without, the MoE models Qwen3-MoE and Mixtral
(transformers 5 fuses their experts: Qwen3-MoE published under the names derived from transformers, ``hf_names``;
Mixtral with the README's ``split_fused_experts`` and ``rename``; Qwen3-MoE once more with its experts sharded along
their columns and rows) and HRM-Text (whose checkpoints join the projections its model keeps apart, ``hf_names``),
and publishes every step with a full snapshot every third
(dist_scripts/hf_train_publish.py). Each full snapshot folder is loaded as it is; each delta is first rebuilt on
its parent with ``hotload apply``. Every load must report no missing, unexpected or mismatched key and give exactly
the trainer's gathered state cast to bf16; the base folder's config, generation config and tokenizer travel
unchanged. Skipped where transformers is not installed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: a loader must never reach for the Hub here
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from transformers.core_model_loading import revert_weight_conversion  # noqa: E402

from fsdp_hotload.arc.stio import CHECKSUM_KEY  # noqa: E402

from tests.dist_util import REPO, SCRIPTS, run_torchrun  # noqa: E402

pytestmark = pytest.mark.slow

# (model type, tie_word_embeddings); the MoE model's 3 experts are split 2 + 1 by FSDP2 over 2 ranks
CASES = {"llama_tied": ("llama", True), "qwen2_untied": ("qwen2", False), "qwen3_moe": ("qwen3_moe", False),
         "mixtral": ("mixtral", False), "qwen3_moe_cols": ("qwen3_moe", False), "hrm_text": ("hrm_text", False)}
# FSDP shards these cases' fused experts along another dim than 0 (each rank holds columns of every expert's
# gate and up parts, and half the rows of its down part), as torchtitan does with more ranks than experts
EXPERT_DIMS = {"qwen3_moe_cols": {"gate_up_proj": 2, "down_proj": 1}}
AUX = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def write_base_folder(folder: Path, kind: str, tie: bool) -> None:
    """config.json (bf16, as the fleet loads), generation_config.json and a word-level tokenizer: what a base model
    folder holds besides its weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    common: dict[str, Any] = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    if kind == "qwen3_moe":  # transformers 5 fuses its experts; its checkpoints name each one
        common.update(moe_intermediate_size=32, num_experts=3, num_experts_per_tok=2, decoder_sparse_step=1)
    if kind == "mixtral":  # the same, under other names (block_sparse_moe, w1/w3/w2)
        common.update(num_local_experts=3, num_experts_per_tok=2)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
              "hrm_text": lambda **kw: transformers.AutoConfig.for_model("hrm_text", **kw)}[kind](**common)
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, do_sample=True, temperature=0.7).save_pretrained(
        folder)
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 100)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t1",
                                         eos_token="t2").save_pretrained(folder)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Path]:
    """The job's folders, one per case. The job runs once per test session: pytest-xdist workers that got cases
    of this module share the session's temporary root, and the first one to take the lock runs it (each worker
    ran the whole 2-rank job before, ~20 s of both cores)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if hasattr(request.config, "workerinput") else base  # an xdist worker's, or the run's
    root = shared / "hf-published"
    cases = {name: root / name for name in CASES}
    with FileLock(str(shared / "hf-published.lock")):
        if (root / "done").exists():
            return cases
        shutil.rmtree(root, ignore_errors=True)  # a job that failed on another worker: run it again here
        for name, (kind, tie) in CASES.items():
            for sub in ("hf", "bucket", "out"):
                (cases[name] / sub).mkdir(parents=True)
            write_base_folder(cases[name] / "hf", kind, tie)
            if name in EXPERT_DIMS:
                (cases[name] / "fsdp.json").write_text(json.dumps(EXPERT_DIMS[name]))
        args = [a for case in cases.values() for a in ("--case", str(case))]
        run_torchrun(str(SCRIPTS / "hf_train_publish.py"), 2, [*args, "--steps", "5", "--full-every", "3"],
                     timeout=300)
        (root / "done").touch()
    return cases


def hotload_apply(parent: Path, delta: Path, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fsdp_hotload.cli", "apply", str(parent), str(delta), str(out)],
                          cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def check_index(folder: Path) -> dict[str, Any]:
    """The index as transformers' sharded loading reads it: every named file exists and holds exactly the tensors
    the index assigns to it, and total_size is their bytes. Returns the snapshot's tensors."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    total, tensors = 0, {}
    for filename in sorted(set(weight_map.values())):
        with safe_open(str(folder / filename), "pt") as f:
            assert f.metadata() == {"format": "pt", CHECKSUM_KEY: f.metadata()[CHECKSUM_KEY]}, filename
            assert sorted(f.keys()) == sorted(n for n, fn in weight_map.items() if fn == filename), filename
            for key in f.keys():
                t = tensors[key] = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total and sorted(tensors) == sorted(weight_map)
    return tensors


def check_loads_exactly(folder: Path, expected: Path, base: Path, tie: bool) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    want = load_file(str(expected))  # as save_pretrained writes the trainer's state: the checkpoint's names
    got = revert_weight_conversion(model, model.state_dict())  # the loaded model, likewise
    published = check_index(folder)  # the snapshot itself: the same names (a tied lm_head once) and bytes
    assert sorted(got) == sorted(want) and sorted(published) == sorted(n for n in want if n != "lm_head.weight" or
                                                                       not tie)
    for name, tensor in want.items():
        for source in (got, published):
            if name in source:
                assert source[name].dtype == torch.bfloat16, name
                assert torch.equal(source[name].view(torch.int16), tensor.view(torch.int16)), name
    assert ("lm_head.weight" in published) is not tie  # tied: published once, under the embedding's name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tie
    for aux in AUX:
        assert (folder / aux).read_bytes() == (base / aux).read_bytes(), aux
    tok, base_tok = (transformers.AutoTokenizer.from_pretrained(str(f)) for f in (folder, base))
    assert tok("t5 t7 t99").input_ids == base_tok("t5 t7 t99").input_ids
    assert transformers.GenerationConfig.from_pretrained(str(folder)).temperature == 0.7


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_step_loads_in_transformers_bit_exact(published: dict[str, Path], case: str, tmp_path: Path) -> None:
    root = published[case]
    tie = CASES[case][1]
    records = json.loads((root / "out" / "metrics.json").read_text())
    assert [(r["kind"], r["ok"]) for r in records] == [("full", True), ("delta", True), ("delta", True),
                                                       ("full", True), ("delta", True)]
    parent: Path | None = None
    for r in records:
        folder = root / "bucket" / r["identity"]
        if r["kind"] == "delta":
            assert parent is not None
            rebuilt = tmp_path / r["identity"]
            hotload_apply(parent, folder, rebuilt)
            folder = rebuilt
        check_loads_exactly(folder, root / "out" / f"expected-{r['identity']}.safetensors", root / "hf", tie)
        parent = folder


def test_names_transformers_would_not_save_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    """Without the base weights in hf_config_dir, the names are checked against what transformers' save_pretrained
    writes for the model: fused experts without split (hf_names off), and Mixtral's parts without its rename, are
    told at start; the README's settings, and hf_names (the default) on its own, say nothing."""
    import logging

    from fsdp_hotload import HotloadCallback, HotloadConfig, split_fused_experts
    from tests.dist_scripts.hf_train_publish import mixtral_names  # the README's recipe

    common: dict[str, Any] = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    qwen = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        moe_intermediate_size=8, num_experts=3, num_experts_per_tok=2, **common))
    mixtral = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        num_local_experts=3, num_experts_per_tok=2, **common))
    said = "not among those transformers' save_pretrained writes for this model"
    for model, kwargs, warned in [(qwen, {"hf_names": False}, "pass split=split_fused_experts"),
                                  (qwen, {"split": split_fused_experts}, None),
                                  (qwen, {}, None),  # hf_names: split as transformers saves it
                                  (mixtral, {"split": split_fused_experts}, "rename= maps names"),
                                  (mixtral, {"split": split_fused_experts, "rename": mixtral_names}, None),
                                  (mixtral, {}, None)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "b")), **kwargs).close()
        if warned is None:
            assert said not in caplog.text, caplog.text
        else:
            assert said in caplog.text and warned in caplog.text, caplog.text



def test_aliases_tied_under_other_names_than_lm_head_are_warned_about(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """save_pretrained writes T5's shared embedding once (``shared.weight``), leaving out the aliases its
    _tied_weights_keys name; the tie handling here knows lm_head only, so the snapshot carried them too, and the
    check against save_pretrained's names said nothing. It says so now, and a rename leaving them out publishes
    exactly save_pretrained's names."""
    import logging

    from fsdp_hotload import HotloadCallback, HotloadConfig

    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=50, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0))
    model.save_pretrained(tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    aliases = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    for rename, warned in [(None, True), (lambda n: None if n in aliases else n, False)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            hot = HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "b")), rename=rename)
            published = {n for n, _s, _d in hot._specs}
            hot.close()
        said = "2 published tensor name(s) are not among those transformers' save_pretrained writes"
        assert (said in caplog.text and "'decoder.embed_tokens.weight'" in caplog.text) is warned, caplog.text
        assert published == (written | aliases if warned else written)

# model type -> (tensors split, names changed): the qwen2_moe family only splits experts, Mixtral also renames,
# Nemotron-H's experts have no gate (a fused up_proj), GraniteMoE's checkpoints keep the experts fused under other
# names (renamed whole), OLMo-Hybrid's keep q/k/v convolutions apart that its model concatenates (ranges of rows),
# HRM-Text's fuse the gate and up projections, and the attention's gate, q, k and v, that its model keeps apart
# (joined), a Llama needs nothing
PLANS = {"qwen3_moe": (True, False), "mixtral": (True, True), "deepseek_v3": (True, False),
         "nemotron_h": (True, True), "granitemoe": (False, True), "olmo_hybrid": (True, True),
         "hrm_text": (False, True), "llama": None}


def _published(model: Any, plan: Any) -> dict[str, torch.Tensor]:
    """What the callback would publish under ``plan`` (F32), each tensor put together from its chunks."""
    from fsdp_hotload.fsdp import full_tensor_specs, local_chunks

    kw: dict[str, Any] = dict(split=plan.split, rename=plan.rename, tie_word_embeddings=False, snapshot_dtype="F32")
    out = {name: torch.full(shape, float("nan")) for name, shape, _dtype in full_tensor_specs(model, **kw)}
    for c in local_chunks(model, **kw):
        if c.space == "flat":
            out[c.name].view(-1)[c.box.start[0]:c.box.start[0] + c.box.length[0]] = c.source.reshape(-1)
        else:
            out[c.name][tuple(slice(a, a + n) for a, n in zip(c.box.start, c.box.length))] = c.source.reshape(
                c.box.length)
    return out


@pytest.mark.parametrize("kind", sorted(PLANS))
def test_checkpoint_names_from_transformers_publish_what_save_pretrained_writes(kind: str) -> None:
    """hf_names: the split and rename derived from transformers' conversion mapping give exactly the tensors its
    revert (what save_pretrained writes) gives, names and elements; a model whose names are its checkpoint's gets
    no plan."""
    from fsdp_hotload.fsdp import full_tensor_specs
    from fsdp_hotload.hf_names import checkpoint_names

    common: dict[str, Any] = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1)
    config = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(moe_intermediate_size=8, num_experts=3,
                                                         num_experts_per_tok=2, **common),
        "mixtral": lambda: transformers.MixtralConfig(num_local_experts=3, num_experts_per_tok=2, **common),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(
            moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
            n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=4, n_group=1, topk_group=1, **common),
        "nemotron_h": lambda: transformers.NemotronHConfig(
            hybrid_override_pattern="E*", layers_block_type=["moe", "attention"], n_routed_experts=3,
            num_experts_per_tok=2, moe_intermediate_size=8, moe_shared_expert_intermediate_size=8, mamba_num_heads=2,
            mamba_head_dim=8, ssm_state_size=8, n_groups=1, head_dim=8, **common),
        "granitemoe": lambda: transformers.GraniteMoeConfig(num_local_experts=3, num_experts_per_tok=2, **common),
        "olmo_hybrid": lambda: transformers.AutoConfig.for_model("olmo_hybrid", pad_token_id=0, eos_token_id=2,
                                                                 head_dim=8, **common),
        "hrm_text": lambda: transformers.AutoConfig.for_model("hrm_text", **common),
        "llama": lambda: transformers.LlamaConfig(**common),
    }[kind]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # every element its own value, so that a part taken from the wrong place shows
        for p in model.parameters():
            p.normal_()
    plan = checkpoint_names(model, lambda: full_tensor_specs(model, tie_word_embeddings=False))
    if PLANS[kind] is None:
        assert plan is None
        return
    assert plan is not None
    assert ((plan.split is not None), bool(plan.changed)) == PLANS[kind], (plan.split_tensors, plan.changed)
    assert (plan.joined > 0) == (kind == "hrm_text"), plan.joined
    want = revert_weight_conversion(model, dict(model.state_dict()))
    got = _published(model, plan)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_ernie_vl_moe_routers_publish_transposed_as_its_checkpoints_hold_them() -> None:
    """Ernie-4.5-VL-MoE's checkpoints hold each router matrix transposed, and its text and vision experts as one
    list: the plan was dropped whole for the transposed routers, so every tensor went out under the model's names
    (``model.language_model.*``), which the fleet refuses. Now: exactly what its save_pretrained writes."""
    from fsdp_hotload.fsdp import full_tensor_specs
    from fsdp_hotload.hf_names import checkpoint_names

    config = transformers.Ernie4_5_VLMoeConfig(
        text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=[16, 8],
                         moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e4}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2))
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    plan = checkpoint_names(model, lambda: full_tensor_specs(model, tie_word_embeddings=False))
    assert plan is not None and plan.split is not None
    want = revert_weight_conversion(model, dict(model.state_dict()))
    got = _published(model, plan)
    assert sorted(got) == sorted(want)
    routers = [n for n, t in want.items() if n.endswith("mlp.gate.weight")]
    assert routers and all(want[n].shape[0] == 32 for n in routers), [(n, want[n].shape) for n in routers]
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_qwen3_vl_moe_experts_publish_in_their_checkpoint_layout(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                                  ) -> None:
    """Qwen3-VL-MoE: transformers 5's model holds its experts as (E, 2I, H) and (E, H, I), its checkpoints as
    (E, H, 2I) and (E, I, H) under the same names. With the base checkpoint in hf_config_dir, hf_names (the default)
    publishes them transposed, as does split=transpose_fused_experts: no warning, the snapshot holds the
    checkpoint's shapes, and transformers loads it into exactly the trainer's weights. With hf_names off the model's
    own layout is published and warned about, with the fix."""
    import logging

    from safetensors.torch import save_file

    from fsdp_hotload import HotloadCallback, HotloadConfig, transpose_fused_experts

    config = transformers.Qwen3VLMoeConfig(
        text_config=dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, head_dim=8,
                         num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=12, num_experts=3,
                         num_experts_per_tok=2),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16))
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    experts = [k for k in state if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    assert len(experts) == 2 and all(state[k].shape[1] != state[k].shape[2] for k in experts)
    base = tmp_path / "base"
    config.save_pretrained(base)  # the checkpoint: experts transposed, every other tensor as the model holds it
    on_disk = {k: (v.transpose(1, 2) if k in experts else v).contiguous() for k, v in state.items()}
    save_file({k: v.clone() for k, v in on_disk.items()}, str(base / "model.safetensors"))
    fix = "pass split=transpose_fused_experts"
    cases: list[tuple[dict[str, Any], bool]] = [({"hf_names": False}, True), ({}, False),
                                                ({"split": transpose_fused_experts}, False)]
    for i, (kwargs, warned) in enumerate(cases):
        caplog.clear()
        bucket = tmp_path / f"bucket{i}"
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"):
            hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(base)), **kwargs)
        assert (fix in caplog.text) is warned, caplog.text
        derived = "publishing 2 tensor(s) with their last two dims swapped, as the base checkpoint stores them"
        assert (derived in caplog.text) is (not kwargs), caplog.text
        assert "names differ" not in caplog.text, caplog.text
        with hot:
            hot.step(0)
        if warned:
            continue
        folder = bucket / hot.metrics[-1].identity
        published = check_index(folder)
        assert sorted(published) == sorted(on_disk)
        for name, tensor in on_disk.items():
            assert torch.equal(published[name].view(torch.int16), tensor.view(torch.int16)), name
        loaded = transformers.AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.bfloat16)
        got = loaded.state_dict()
        for name, tensor in state.items():  # transformers transposes them back on loading: the trainer's weights
            assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name


def _fake_model(model_type: str, params: dict[str, tuple[int, ...]], mapping: list[Any], **config: Any) -> Any:
    """A transformers model of ``params`` whose checkpoints ``mapping`` converts on loading (registered for a
    model type of its own; ``config``: its config's attributes), every element its own random value."""
    from torch import nn
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping

    class Config(transformers.PretrainedConfig):
        pass

    Config.model_type = model_type

    class Model(transformers.PreTrainedModel):
        config_class = Config

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            for path, shape in params.items():
                mod: nn.Module = self
                *parents, leaf = path.split(".")
                for p in parents:
                    if not hasattr(mod, p):
                        setattr(mod, p, nn.Module())
                    mod = getattr(mod, p)
                setattr(mod, leaf, nn.Parameter(torch.randn(shape)))

        def _init_weights(self, module: Any) -> None:
            pass

    register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)
    return Model(Config(**config))


def test_checkpoint_names_follow_rows_cut_apart_and_nothing_changed_within_rows() -> None:
    """A checkpoint's q, k and v that the model concatenates on loading are published as the model tensor's ranges
    of rows, exactly transformers' revert; where the conversion also changes anything within the rows (a transpose
    of two equal dims, a reordering of the columns) there is no plan, never a plan that publishes other elements
    under the checkpoint's names."""
    from transformers.core_model_loading import ConversionOps, Concatenate, Transpose, WeightConverter

    from fsdp_hotload.fsdp import full_tensor_specs, local_chunks
    from fsdp_hotload.hf_names import checkpoint_names

    class FlipColumns(ConversionOps):
        def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                    **kwargs: Any) -> dict[str, Any]:
            t = next(iter(input_dict.values()))
            return {target_patterns[0]: (t[0] if isinstance(t, list) else t).flip(-1).contiguous()}

        @property
        def reverse_op(self) -> ConversionOps:
            return FlipColumns()

    qkv = ["b.q", "b.k", "b.v"]
    cases = {
        "hotload_fake_concat": ({"b.qkv": (6, 3), "n": (3,)}, [WeightConverter(qkv, "b.qkv", [Concatenate(0)])], True),
        "hotload_fake_concat_t": ({"b.qkv": (6, 3, 3)},
                                  [WeightConverter(qkv, "b.qkv", [Concatenate(0), Transpose(1, 2)])], False),
        "hotload_fake_t": ({"a.w": (2, 4, 4)}, [WeightConverter("a.w_ck", "a.w", [Transpose(1, 2)])], False),
        "hotload_fake_flip": ({"c.w": (5, 7)}, [WeightConverter("c.w_ck", "c.w", [FlipColumns()])], False),
    }
    for model_type, (params, mapping, planned) in cases.items():
        torch.manual_seed(0)
        model = _fake_model(model_type, params, mapping)
        plan = checkpoint_names(model, lambda: full_tensor_specs(model, tie_word_embeddings=False))
        assert (plan is not None) is planned, model_type
        if plan is None:
            continue
        want = revert_weight_conversion(model, dict(model.state_dict()))
        chunks = local_chunks(model, split=plan.split, rename=plan.rename, tie_word_embeddings=False,
                              snapshot_dtype="F32")
        got = {c.name: c.source for c in chunks}
        assert sorted(got) == sorted(want) == ["b.k", "b.q", "b.v", "n"], model_type
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor.reshape(-1)), name


def test_checkpoint_names_join_tensors_the_model_keeps_apart() -> None:
    """A checkpoint's tensor that the model splits on loading (q, k and v of unequal rows; gate and up, saved up first;
    experts stacked per projection, fused by the model along their rows), or whose rows it reorders (interleaved gate
    and up rows; the rows of fused experts' two halves interleaved; q and k permuted for RoPE, alone, at a real size and
    within a fused qkv, as Kimi-K2.5's vision tower), or that it transposes (a matrix), is published as the model's
    tensors, ranges of their rows, their rows regrouped or transposed, joined in the checkpoint's order: exactly
    transformers' revert. Where the conversion reorders values within rows (fused experts' columns too, or their rows
    but for the two halves' interleave above), joins along another dim than 0, or would cut tensors into more runs of
    rows than MAX_ROW_RUNS (rows of two tensors interleaved) there is no plan."""
    from transformers.core_model_loading import (
        Chunk, Concatenate, Interleave, PermuteForRope, Split, Transpose, WeightConverter)

    from fsdp_hotload.fsdp import full_tensor_specs, local_chunks
    from fsdp_hotload.hf_names import checkpoint_names

    qkv, ff = ["b.q", "b.k", "b.v"], ["m.up", "m.gate"]
    rope = PermuteForRope(permute_layer_names=["q", "k"])
    cases = {
        "hotload_fake_split": ({"b.q": (4, 3), "b.k": (2, 3), "b.v": (2, 3), "b.o": (3, 3)},
                               [WeightConverter("b.qkv", qkv, [Split(0)])], ["b.o", "b.qkv"]),
        "hotload_fake_chunk": ({"m.gate": (4, 3), "m.up": (4, 3), "m.gate_b": (4,), "m.up_b": (4,)},
                               [WeightConverter("m.ff", ff, [Chunk(0)]),
                                WeightConverter("m.ff_b", ["m.up_b", "m.gate_b"], [Chunk(0)])], ["m.ff", "m.ff_b"]),
        "hotload_fake_interleaved": ({"m.gate": (4, 3), "m.up": (4, 3)},
                                     [WeightConverter("m.ff", ff, [Interleave(0), Chunk(0)])], ["m.ff"]),
        "hotload_fake_rope": ({"a.q": (8, 3), "a.k": (8, 3), "a.q_b": (8,)},
                              [WeightConverter("a.q_ck", "a.q", [PermuteForRope()]),
                               WeightConverter("a.k_ck", "a.k", [PermuteForRope()]),
                               WeightConverter("a.q_b_ck", "a.q_b", [PermuteForRope()])],
                              ["a.k_ck", "a.q_b_ck", "a.q_ck"]),
        "hotload_fake_rope_qkv": ({"b.q": (8, 3), "b.k": (8, 3), "b.v": (8, 3)},
                                  [WeightConverter("b.wqkv", qkv, [Chunk(0), rope])], ["b.wqkv"]),
        # a checkpoint that stacks each projection of the experts (Step-3.7's (E, I, H) gate and up), which the
        # model fuses along their rows: each expert's part a block of the stacked tensor
        "hotload_fake_stacked": ({"l.mlp.experts.gate_up_proj": (3, 8, 5), "l.mlp.experts.down_proj": (3, 5, 4)},
                                 [WeightConverter(["moe.gate_proj.weight", "moe.up_proj.weight"],
                                                  "mlp.experts.gate_up_proj", [Concatenate(dim=1)])],
                                 ["l.mlp.experts.down_proj", "l.moe.gate_proj.weight", "l.moe.up_proj.weight"]),
        # fused experts whose checkpoint interleaves the rows of the two halves in each expert (Inkling-2): one
        # part, regrouped along dim 1
        "hotload_fake_experts_interleaved": ({"l.mlp.experts.gate_up_proj": (3, 8, 5),
                                              "l.mlp.experts.down_proj": (3, 5, 4)},
                                             [WeightConverter("mlp.experts.w13_weight", "mlp.experts.gate_up_proj",
                                                              [Interleave(1)])],
                                             ["l.mlp.experts.down_proj", "l.mlp.experts.w13_weight"]),
        # matrices the checkpoint stores transposed (Ernie-4.5-VL-MoE's routers), a square one too: a permuted part
        "hotload_fake_transposed": ({"m.gate.weight": (4, 6), "m.sq": (5, 5), "m.o": (3, 3)},
                                    [WeightConverter("m.gate_t", "m.gate.weight", [Transpose(0, 1)]),
                                     WeightConverter("m.sq_t", "m.sq", [Transpose(0, 1)])],
                                    ["m.gate_t", "m.o", "m.sq_t"]),
        # rows regrouped (RoPE's permutation) at any size: one part, a chunk per range of whole groups
        "hotload_fake_rope_big": ({"a.q": (1152, 3)}, [WeightConverter("a.q_ck", "a.q", [PermuteForRope()])],
                                  ["a.q_ck"]),
        # rows of two tensors interleaved: a run per row, each a chunk; more than MAX_ROW_RUNS are refused
        "hotload_fake_interleaved_big": ({"m.gate": (40, 3), "m.up": (40, 3)},
                                         [WeightConverter("m.ff", ff, [Interleave(0), Chunk(0)])], None),
        # fused experts whose checkpoint interleaves gate_up's columns, or down's rows, in pairs: the probe's dims
        # of 2 hid it (an interleave of pairs on 2 is a no-op), and the plan published the model's order
        "hotload_fake_experts_columns": ({"l.mlp.experts.gate_up_proj": (3, 8, 6),
                                          "l.mlp.experts.down_proj": (3, 6, 4)},
                                         [WeightConverter("mlp.experts.w13", "mlp.experts.gate_up_proj",
                                                          [Interleave(2)])], None),
        "hotload_fake_experts_down_rows": ({"l.mlp.experts.gate_up_proj": (3, 8, 6),
                                            "l.mlp.experts.down_proj": (3, 6, 4)},
                                           [WeightConverter("mlp.experts.w2", "mlp.experts.down_proj",
                                                            [Interleave(1)])], None),
        "hotload_fake_within_rows": ({"m.gate": (4, 6)}, [WeightConverter("m.g", "m.gate", [Interleave(1)])], None),
        "hotload_fake_columns": ({"m.gate": (4, 3), "m.up": (4, 3)}, [WeightConverter("m.ff", ff, [Chunk(1)])], None),
    }
    for model_type, (params, mapping, names) in cases.items():
        torch.manual_seed(0)
        model = _fake_model(model_type, params, mapping, num_attention_heads=2)
        plan = checkpoint_names(model, lambda: full_tensor_specs(model, tie_word_embeddings=False))
        assert (plan is not None) is (names is not None), model_type
        if plan is None:
            continue
        want = revert_weight_conversion(model, dict(model.state_dict()))
        got = _published(model, plan)
        assert sorted(got) == sorted(want) == names, model_type
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        joined = {"split": 1, "chunk": 2, "interleaved": 1, "stacked": 2, "experts_interleaved": 0, "rope": 0,
                  "rope_qkv": 1, "rope_big": 0, "transposed": 0}
        assert plan.joined == joined[model_type.removeprefix("hotload_fake_")], (model_type, plan.joined)
        if "rope" in model_type or "experts_interleaved" in model_type:  # regrouped: a chunk per tensor here
            chunks = local_chunks(model, split=plan.split, rename=plan.rename, tie_word_embeddings=False)
            assert len(chunks) == len(params), (model_type, [(c.name, c.box) for c in chunks])
    assert plan is None  # the last case


@pytest.mark.parametrize("wrap", ["compile", "data_parallel", "checkpoint_wrapper"])
def test_checkpoint_names_see_through_wrappers_around_the_model(wrap: str) -> None:
    """A compiled, DDP/DataParallel-held or checkpoint-wrapped transformers model is not itself a PreTrainedModel:
    hf_names gave no plan for it, silently, and the callback published the model's attribute names (hrm_text's
    q, k and v apart; a MoE's fused experts), which the fleet refuses. The wrappers' segments are stripped from the
    names anyway, so the plan is the inner model's. A model that merely holds one as a submodule gets none."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fsdp_hotload.fsdp import full_tensor_specs
    from fsdp_hotload.hf_names import checkpoint_names, transformers_saved_shapes

    common: dict[str, Any] = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("hrm_text", **common))
    wrapped = {"compile": torch.compile, "data_parallel": torch.nn.DataParallel,
               "checkpoint_wrapper": checkpoint_wrapper}[wrap](model)
    plan = checkpoint_names(wrapped, lambda: full_tensor_specs(wrapped, tie_word_embeddings=False))
    assert plan is not None and plan.joined > 0
    want = revert_weight_conversion(model, dict(model.state_dict()))
    got = _published(wrapped, plan)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    shapes = transformers_saved_shapes(wrapped, lambda: full_tensor_specs(wrapped, tie_word_embeddings=False))
    assert shapes == {k: tuple(v.shape) for k, v in want.items()}

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.policy = model

    holder = Holder()
    assert checkpoint_names(holder, lambda: full_tensor_specs(holder, tie_word_embeddings=False)) is None
