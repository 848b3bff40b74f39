"""Ranks that stage different steps never commit a snapshot mixing them.

Snapshots pair across ranks by the order they were staged. Rank 1 here skips step 1, as a rank would after
catching a publish error the others did not raise at that step, so from the second publish on the ranks pair
different steps: each such snapshot must fail (nothing committed), never mix one rank's step with another's.
Results go to --out as JSON (one file per rank).
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
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = HotloadConfig(bucket_url=args.bucket, hf_config_dir=args.hf_dir, busy_policy="wait",
                        keep_training_on_error=True)
    steps = [0, 1, 2, 3] if rank == 0 else [0, 2, 3, 4]
    with HotloadCallback(model, cfg) as cb:
        for step in steps:
            model(IDS).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            cb.step(step)
            cb.wait(timeout=60)
    Path(f"{args.out}.{rank}").write_text(json.dumps({"metrics": [(m.step, m.ok, m.error) for m in cb.metrics]}))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
