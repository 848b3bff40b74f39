"""A step whose staging fails on one rank only: rank 1 alone swaps a parameter's storage at step 2, so it alone
walks its model again at that publish, and its rename hook raises there once. Before, publish() raised on rank 1
alone, which then staged one step fewer than rank 0: every later snapshot paired different steps and failed. Each
rank writes --out.<rank> (JSON): what each step did and the metrics (rank 0)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.check_chunks import IDS, fsdp2  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--policy", default="wait")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    armed = [False]

    def rename(name: str) -> str:
        if armed[0]:
            armed[0] = False
            raise KeyError(f"rank {rank}: no published name for {name}")
        return name

    cfg = HotloadConfig(bucket_url=args.bucket, busy_policy=args.policy, full_every=100, collective_timeout_s=30)
    cb = HotloadCallback(model, cfg, rename=rename, hf_names=False)
    steps: list[str] = []
    for step in range(6):
        model(IDS).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 1 and step == 2:
            with torch.no_grad():
                model.model.temp.data = model.model.temp.data.clone()  # a new storage: walked again
            armed[0] = True
        try:
            steps.append("started" if cb.step(step) else "skipped")
        except Exception as exc:  # noqa: BLE001 - recorded (a loop that keeps training)
            steps.append(f"raised {type(exc).__name__}: {exc}")
        cb.wait(timeout=60)
    cb.close()
    Path(f"{args.out}.{rank}").write_text(json.dumps({"steps": steps, "metrics": [
        (m.step, m.kind, m.ok, m.error) for m in cb.metrics]}))
    finish()


if __name__ == "__main__":
    main()
