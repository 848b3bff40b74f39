"""Rank 1's script ends without closing its callback (it leaves the training loop early) and its process exits
normally; rank 0 closes with step 3 left to publish (``publish_every=2``). With the vote in the job's store, rank 0
waited for rank 1's vote until the side group's timeout (30 s here, over an hour by default): rank 1 now leaves
the note at its exit. Rank 0 writes how its close ended, how long it took and its warnings to
``--out``/rank0.json.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.check_chunks import fsdp2, train_and_publish  # noqa: E402
from tests.dist_util import WarningLines, finish, start_rank  # noqa: E402


def main() -> None:
    bucket, out, rank = start_rank()
    warnings = WarningLines.attach()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    cb = HotloadCallback(model, HotloadConfig(bucket_url=bucket, publish_every=2, collective_timeout_s=30))
    train_and_publish(model, cb, 4)
    dist.barrier()
    if rank == 1:
        sys.exit(0)  # a normal exit, atexit hooks included, without close()
    time.sleep(1)
    t0, error = time.monotonic(), None
    try:
        cb.close()
    except Exception as exc:  # noqa: BLE001 - what is tested
        error = f"{type(exc).__name__}: {exc}"
    Path(out, "rank0.json").write_text(json.dumps({"error": error, "s": time.monotonic() - t0,
                                                   "warnings": warnings.lines}))
    finish()


if __name__ == "__main__":
    main()
