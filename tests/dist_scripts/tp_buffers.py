"""Tensor parallelism over a module with buffers: ``parallelize_module`` makes every buffer of the modules it
parallelises a replicated DTensor. A callback publishing from the optimizer hooks (the CPU copy overlapping the
next forward, which updates a buffer in place) must publish each step's state, buffers as they were at that step.

Every rank records the gathered state after each step; rank 0 rebuilds every accepted snapshot from the bucket
and compares. Results go to --out as JSON (rank 0).
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
from tests.dist_util import finish  # noqa: E402
from tests.snapshots import rebuild_accepted  # noqa: E402


class Scaled(nn.Linear):
    """A linear layer with buffers (a scale, as quantised layers keep, and a call counter its forward bumps)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__(n_in, n_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, n_out))
        self.register_buffer("calls", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls.add_(1)  # in place, during the forward that the async copy overlaps
        return super().forward(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = Scaled(6, 8)
        self.down = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Net()
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    buffer_types = sorted({type(b).__name__ for b in model.buffers()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = HotloadConfig(bucket_url=args.bucket, hf_config_dir=args.hf_dir, busy_policy="wait", full_every=3)
    states = []
    with HotloadCallback(model, cfg) as hot:
        buffered = len(hot._buffer_idx)
        hot.attach(opt)
        for step in range(5):
            torch.manual_seed(step)
            model(torch.randn(4, 6)).pow(2).mean().backward()
            opt.step()  # the post-step hook stages this step's weights; the copy runs into the next forward
            opt.zero_grad()
            states.append({k: RawTensor.from_any(v).digest() for k, v in gather_full_state(model).items()})
    if dist.get_rank() == 0:
        rebuilt = rebuild_accepted(args.bucket, hot.metrics)
        Path(args.out).write_text(json.dumps({
            "buffer_types": buffer_types, "buffered": buffered,
            "ok": [m.ok for m in hot.metrics], "steps": [m.step for m in hot.metrics],
            "exact": [{k: t.digest() for k, t in rebuilt[m.identity].items()} == states[m.step]
                      for m in hot.metrics]}))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
