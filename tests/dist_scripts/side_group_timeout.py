"""A side-group collective that times out: the snapshot fails on every rank, publishing stops, training goes on.

Rank 0 waits for the replicas longer than ``collective_timeout_s`` while rank 1 waits for the outcome in a
collective, so rank 1's collective times out and the group breaks on both ranks. Each rank then trains on and
records, per step, whether a publish started. Results go to --out as JSON (one file per rank).
"""
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
    p.add_argument("--url", required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=3.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = HotloadConfig(bucket_url=args.bucket, hotload_api_url=args.url, account_id="acct", model_id="tiny",
                        deployment_id="dep", api_key="test-key", hf_config_dir=args.hf_dir, poll_interval_s=0.02,
                        ready_timeout_s=60, collective_timeout_s=args.timeout, keep_training_on_error=True,
                        busy_policy="wait")
    started = []
    with HotloadCallback(model, cfg) as cb:
        for step in range(4):
            model(IDS).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            started.append(cb.step(step))
            cb.wait(timeout=60)
        stopped = cb.engine.stopped
    Path(f"{args.out}.{rank}").write_text(json.dumps({"started": started, "stopped": stopped,
                                                      "metrics": [(m.kind, m.ok) for m in cb.metrics]}))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
