"""FSDP2 over tensor parallelism (torchtitan's layout) on 4 ranks publishes every step; rank 0 checks that every
replica serves, bit for bit, the framework's gathered state after each publish.

Each layer's up projection is column-wise (its rows split over the TP ranks, then again over the data-parallel
ranks: ``_StridedShard``), its down projection row-wise, and its norm is left to FSDP alone, so both TP ranks of
a data-parallel rank hold the same part of it: the part must be published once. Results go to --out as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from fsdp_hotload.arc.dtypes import RawTensor  # noqa: E402
from fsdp_hotload.fsdp_verify import gather_full_state  # noqa: E402
from tests.dist_scripts.train_publish import served  # noqa: E402
from tests.dist_util import finish  # noqa: E402


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(8, 10)  # 10 rows: 5 per TP rank, then 3 + 2 over the data-parallel ranks
        self.down_proj = nn.Linear(10, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down_proj(torch.relu(self.up_proj(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--bucket", "--url", "--out", "--hf-dir"):
        p.add_argument(flag, required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = [type(pl).__name__ for pl in model.layers[0].up_proj.weight.placements]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = HotloadConfig(bucket_url=args.bucket, hotload_api_url=args.url, account_id="acct", model_id="tiny",
                        deployment_id="dep", api_key="test-key", hf_config_dir=args.hf_dir, full_every=4,
                        poll_interval_s=0.02, ready_timeout_s=60, busy_policy="wait")
    records = []
    with HotloadCallback(model, cfg) as cb:
        chunks = len(cb.engine.chunks)
        for step in range(8):
            torch.manual_seed(step)
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cb.step(step)
            cb.wait()
            full = gather_full_state(model)
            if dist.get_rank() == 0:
                m = cb.metrics[-1]
                want = {k: RawTensor.from_any(v).digest() for k, v in full.items()}
                reps = served(args.url)
                records.append({"kind": m.kind, "ok": m.ok, "tensors": sorted(want),
                                "bit_exact": all(i == m.identity and shas == want for i, shas in reps)})
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, chunks)
    if dist.get_rank() == 0:
        records.append({"placements": placements, "chunks": counts})
        Path(args.out).write_text(json.dumps(records, indent=1))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
