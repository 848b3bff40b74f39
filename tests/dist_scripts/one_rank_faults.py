"""Faults on one rank of two that must not leave the ranks out of step (tests/test_rank_faults.py), in one job:

* ``staging``: rank 1 alone swaps a parameter's storage at step 4, so it alone walks its model again at that
  publish, and its rename hook raises there once. publish() raised on rank 1 alone, which then staged one step
  fewer than rank 0: every later snapshot paired different steps and failed.
* ``agreement`` (last: it breaks the trainer's side group): rank 0 pauses longer than collective_timeout_s
  between optimizer.step() and step() (rank-0-only work: an eval, a log upload) while rank 1's skip-policy
  agreement waits for it. The failed reduction was read again, and raised gloo's error, at every later step,
  keep_training_on_error or not, and again from close().

Each rank writes --out.<rank> (JSON): per case, what each step and close() did, ``stopped``, and the metrics.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.check_chunks import IDS, fsdp2  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def run(case: str, bucket: str, rank: int) -> dict[str, Any]:
    model = fsdp2(dist.get_world_size(), hsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    armed = [False]

    def rename(name: str) -> str:
        if armed[0]:
            armed[0] = False
            raise KeyError(f"rank {rank}: no published name for {name}")
        return name

    if case == "staging":
        cfg = HotloadConfig(bucket_url=bucket, busy_policy="wait", full_every=100, collective_timeout_s=30)
        cb = HotloadCallback(model, cfg, rename=rename, hf_names=False)
    else:
        cfg = HotloadConfig(bucket_url=bucket, busy_policy="skip", collective_timeout_s=2, keep_training_on_error=True)
        cb = HotloadCallback(model, cfg)
    steps: list[str] = []
    for step in range(8 if case == "staging" else 7):
        model(IDS).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        # step 4: once the ranks' comparisons of the ignored parameter have ended (its walk would meet the fault)
        if case == "staging" and rank == 1 and step == 4 and not cb._recheck.left:
            with torch.no_grad():
                model.model.temp.data = model.model.temp.data.clone()  # a new storage: walked again
            armed[0] = True
        if case == "agreement" and rank == 0 and step == 4:  # once the comparisons of copies ended (step 3)
            time.sleep(4)  # past collective_timeout_s
        try:
            steps.append("started" if cb.step(step) else "skipped")
        except Exception as exc:  # noqa: BLE001 - recorded (a loop that keeps training)
            steps.append(f"raised {type(exc).__name__}: {exc}")
        if case == "staging":
            cb.wait(timeout=60)
    try:
        cb.close()
        closed = "ok"
    except Exception as exc:  # noqa: BLE001 - recorded
        closed = f"raised {type(exc).__name__}: {exc}"
    return {"steps": steps, "close": closed, "stopped": cb.engine.stopped,
            "metrics": [(m.step, m.kind, m.ok, m.error) for m in cb.metrics]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {case: run(case, f"{args.bucket}/{case}", rank) for case in ("staging", "agreement")}
    Path(f"{args.out}.{rank}").write_text(json.dumps(result))
    finish()


if __name__ == "__main__":
    main()
