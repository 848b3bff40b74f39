"""Snapshots as the fleet's Hugging Face loader reads them: transformers' ``from_pretrained`` on every step.

One torchrun job (2 ranks, gloo, FSDP2 per decoder layer and root) trains two tiny random models built from their
configs, a Llama with tied embeddings and a Qwen2 (q/k/v biases) without, and publishes every step with a full
snapshot every third (dist_scripts/hf_train_publish.py). Each full snapshot folder is loaded as it is; each delta is
first rebuilt on its parent with ``hotload apply``. Every load must report no missing, unexpected or mismatched
key and give exactly the trainer's gathered state cast to bf16; the base folder's config, generation config and
tokenizer travel unchanged. Skipped where transformers is not installed.
"""
from __future__ import annotations

import json
import os
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

from tests.dist_util import REPO, SCRIPTS, run_torchrun  # noqa: E402

pytestmark = pytest.mark.slow

CASES = {"llama_tied": ("llama", True), "qwen2_untied": ("qwen2", False)}
AUX = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def write_base_folder(folder: Path, kind: str, tie: bool) -> None:
    """config.json (bf16, as the fleet loads), generation_config.json and a word-level tokenizer: what a base model
    folder holds besides its weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    common: dict[str, Any] = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    config = (transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config)(**common)
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
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    cases = {}
    for name, (kind, tie) in CASES.items():
        case = root / name
        for sub in ("hf", "bucket", "out"):
            (case / sub).mkdir(parents=True)
        write_base_folder(case / "hf", kind, tie)
        cases[name] = case
    args = [a for case in cases.values() for a in ("--case", str(case))]
    run_torchrun(str(SCRIPTS / "hf_train_publish.py"), 2, [*args, "--steps", "5", "--full-every", "3"], timeout=300)
    return cases


def hotload_apply(parent: Path, delta: Path, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fsdp_hotload.cli", "apply", str(parent), str(delta), str(out)],
                          cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def check_index(folder: Path) -> dict[str, str]:
    """The index as transformers' sharded loading reads it: every named file exists and holds exactly the tensors
    the index assigns to it, and total_size is their bytes."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    total = 0
    for filename in sorted(set(weight_map.values())):
        with safe_open(str(folder / filename), "pt") as f:
            assert f.metadata() == {"format": "pt"}, filename
            assert sorted(f.keys()) == sorted(n for n, fn in weight_map.items() if fn == filename), filename
            for key in f.keys():
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    return weight_map


def check_loads_exactly(folder: Path, expected: Path, base: Path, tie: bool) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    want = load_file(str(expected))
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name
    weight_map = check_index(folder)
    assert ("lm_head.weight" in weight_map) is not tie  # tied: published once, under the embedding's name
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
