"""Shared parts of the publisher tests: a small model, an RL-like update, the bytes a replica must serve, and a
config that points at a local bucket and, when given one, the emulator."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.emulator import HotLoadEmulator

API_KEY = "test-key"


def make_model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(256, 64, generator=g) * 0.02,
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g) * 0.02,
        "model.layers.0.mlp.up_proj.weight": torch.randn(160, 64, generator=g) * 0.02,
        "model.layers.1.self_attn.q_proj.weight": torch.randn(64, 64, generator=g) * 0.02,
        "model.layers.1.input_layernorm.weight": torch.ones(64),
        "model.norm.weight": torch.ones(64),
        "model.rotary.step": torch.tensor([3], dtype=torch.int64),
    }


def train_step(model: dict[str, torch.Tensor], step: int) -> None:
    """An RL-like update: a few percent of the bf16 values move each step."""
    g = torch.Generator().manual_seed(1000 + step)
    for name, t in model.items():
        if t.is_floating_point():
            mask = torch.rand(t.shape, generator=g) < 0.03
            t.add_(mask * torch.randn(t.shape, generator=g) * 1e-2)
        else:
            t.add_(1)


def expected_sha(model: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: RawTensor.from_any(v.bfloat16() if v.is_floating_point() else v).digest() for k, v in model.items()}


def served(emu: HotLoadEmulator) -> list[tuple[str | None, dict[str, str]]]:
    deps = emu.state()["deployments"]
    (dep,) = deps.values()
    return [(r["identity"], {k: t["digest"] for k, t in r["tensors"].items()}) for r in dep["replicas"]]


def hf_dir(tmp_path: Path) -> Path:
    cfg_dir = tmp_path / "hf"
    cfg_dir.mkdir(exist_ok=True)
    (cfg_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": 16}')
    (cfg_dir / "tokenizer_config.json").write_text("{}")
    return cfg_dir


def config(bucket: str, emu: HotLoadEmulator | None, tmp_path: Path, **kw: Any) -> HotloadConfig:
    base: dict[str, Any] = dict(bucket_url=bucket, hf_config_dir=str(hf_dir(tmp_path)), poll_interval_s=0.02,
                                ready_timeout_s=30, metrics_path=str(tmp_path / "metrics.jsonl"))
    if emu is not None:
        base.update(hotload_api_url=emu.url, account_id="acct", model_id="m", deployment_id="dep",
                    api_key=API_KEY)
    base.update(kw)
    return HotloadConfig(**base)
