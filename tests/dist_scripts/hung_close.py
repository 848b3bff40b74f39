"""A write that hangs on one rank: close() gives up on every rank after close_timeout_s, and the job ends.

Rank 1's storage hangs on its weight files from the second publish on (a stuck NFS mount, never released), so
rank 0's publisher waits in a side-group collective for rank 1's part. Each rank records how close() ended and
how long it took, then the job tears down its process groups as a training script does. Results go to --out as
JSON (one file per rank).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from fsdp_hotload.engine import PublishError  # noqa: E402
from fsdp_hotload.storage import Storage  # noqa: E402
from tests.dist_scripts.check_chunks import IDS, fsdp2  # noqa: E402
from tests.dist_util import finish  # noqa: E402


class HangingWrites:
    def __init__(self, inner: Any) -> None:
        self.inner, self.armed, self.stuck = inner, False, threading.Event()

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if self.armed and "w" in mode and "safetensors" in str(path) and "index" not in str(path):
            self.stuck.set()
            threading.Event().wait()  # for ever
        return self.inner.open(path, mode, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=2.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fs = HangingWrites(fsspec.filesystem("file"))
    cfg = HotloadConfig(bucket_url=args.bucket, close_timeout_s=args.timeout, busy_policy="wait")
    cb = HotloadCallback(model, cfg, storage=Storage(args.bucket, fs=fs))
    owned = sorted(f for f, r in cb.engine.owners.items() if r == rank)
    error, took = "", 0.0
    for step in range(2):
        model(IDS).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        fs.armed = rank == 1 and step == 1
        assert cb.step(step)
        if step == 0:
            cb.wait(timeout=60)
    if rank == 1:
        assert fs.stuck.wait(30), f"rank 1 never wrote a weight file (it owns {owned})"
    t0 = time.monotonic()
    try:
        cb.close()
    except PublishError as exc:
        error = str(exc)
    took = time.monotonic() - t0
    Path(f"{args.out}.{rank}").write_text(json.dumps({"owned": owned, "error": error, "took": took,
                                                      "abandoned": cb.engine.abandoned,
                                                      "metrics": [(m.kind, m.ok) for m in cb.metrics]}))
    dist.barrier()  # the training group is untouched: only the publisher's side groups are left alone
    dist.destroy_process_group()
    Path(f"{args.out}.{rank}.done").write_text("")
    finish()


if __name__ == "__main__":
    main()
