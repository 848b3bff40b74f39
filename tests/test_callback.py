"""HotloadCallback on a plain (unsharded) module in one process, driven by the optimizer hook."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fsdp_hotload import HotloadCallback, HotloadConfig
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.emulator import HotLoadEmulator


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(40, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.lm_head = nn.Linear(16, 40, bias=False)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.lm_head(h)


def test_attach_publishes_every_optimizer_step(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    hf = tmp_path / "hf"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "net", "tie_word_embeddings": false}')
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HotLoadEmulator(str(bucket), replicas=2, api_key="k") as emu:
        cfg = HotloadConfig(bucket_url=str(bucket), hotload_api_url=emu.url, account_id="a", model_id="m",
                            deployment_id="d", api_key="k", hf_config_dir=str(hf), full_every=3,
                            poll_interval_s=0.02, busy_policy="wait")
        with HotloadCallback(model, cfg) as hot:
            hot.attach(opt)
            for _ in range(5):
                model(torch.randint(0, 40, (2, 8))).sum().backward()
                model.steps += 1
                opt.step()  # the post-step hook stages the weights here
                opt.zero_grad()
                hot.wait()
                want = {k: RawTensor.from_any(v.detach().bfloat16() if v.is_floating_point() else v).sha256()
                        for k, v in model.state_dict().items()}
                (dep,) = emu.state()["deployments"].values()
                for rep in dep["replicas"]:
                    assert rep["identity"] == hot.metrics[-1].identity
                    assert {k: t["sha256"] for k, t in rep["tensors"].items()} == want
    assert [m.kind for m in hot.metrics] == ["full", "delta", "delta", "full", "delta"]
    assert [m.step for m in hot.metrics] == [0, 1, 2, 3, 4]
    assert all(m.ok and m.blocking_ms >= 0 for m in hot.metrics)
