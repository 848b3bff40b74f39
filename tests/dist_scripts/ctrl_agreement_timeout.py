"""The skip policy's agreement on the trainer's side group (ctrl) times out: rank 0 pauses longer than
collective_timeout_s between optimizer.step() and step() (rank-0-only work: an eval, a log upload), while rank 1's
agreement, started at the end of its previous publish step, waits for it. Publishing must stop once with one error
(raised, or logged with --keep), training going on; close() must not raise gloo's error again. Writes
--out.<rank> (JSON): what each step and close() did, and ``stopped``."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
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
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = HotloadConfig(bucket_url=args.bucket, busy_policy="skip", collective_timeout_s=2,
                        keep_training_on_error=args.keep)
    cb = HotloadCallback(model, cfg)
    steps: list[str] = []
    for step in range(7):
        model(IDS).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step == 2:
            time.sleep(4)  # past collective_timeout_s
        try:
            steps.append("started" if cb.step(step) else "skipped")
        except Exception as exc:  # noqa: BLE001 - recorded
            steps.append(f"raised {type(exc).__name__}: {exc}")
    try:
        cb.close()
        closed = "ok"
    except Exception as exc:  # noqa: BLE001 - recorded
        closed = f"raised {type(exc).__name__}: {exc}"
    Path(f"{args.out}.{rank}").write_text(json.dumps({"steps": steps, "close": closed,
                                                      "stopped": cb.engine.stopped}))
    finish()


if __name__ == "__main__":
    main()
