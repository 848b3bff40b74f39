"""``close()`` after ``torch.distributed.destroy_process_group()``: the side groups went with the default one.

The snapshots left to publish cannot be, and the error said only "Group ... is not registered". Each rank
publishes step 0, skips step 1 (``publish_every=2``), destroys the process group, then closes; it writes how
close() ended, and how long it took, to ``--out``/rank<r>.json.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.check_chunks import fsdp2  # noqa: E402
from tests.dist_util import start_rank  # noqa: E402


def main() -> None:
    bucket, out, rank = start_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    cb = HotloadCallback(model, HotloadConfig(bucket_url=bucket, busy_policy="wait", publish_every=2))
    for step in range(2):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
        cb.step(step)
        cb.wait()
    dist.destroy_process_group()
    started = time.monotonic()
    try:
        cb.close()
        error = None
    except Exception as exc:  # noqa: BLE001 - what is tested
        error = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.json").write_text(json.dumps({"error": error, "s": time.monotonic() - started}))


if __name__ == "__main__":
    main()
