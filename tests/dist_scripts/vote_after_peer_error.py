"""One rank leaves ``with cb:`` on an exception while the other closes cleanly, then both meet at a barrier.

The clean rank's close() votes on publishing the newest step (step 3, skipped by ``publish_every=2``); the rank
that raised does not vote. The clean rank waited in the vote until the side group's timeout (over an hour by
default, ``collective_timeout_s=30`` here), while the other waited for it at the barrier (with the skip policy
a pending busy agreement holds the other's group, so its end stays open until the process exits). Each rank writes how its
close ended, how long it took, the warnings logged, and (rank 0) the steps published to ``--out``/rank<r>.json.
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
    error, started = None, time.monotonic()
    try:
        with cb:
            train_and_publish(model, cb, 4)
            started = time.monotonic()
            if rank == 1:
                raise OSError("injected: this rank's checkpoint write failed")
    except Exception as exc:  # noqa: BLE001 - what is tested
        error = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    dist.barrier()  # a training script's own end (`finally: dist.barrier()`): the rank that raised waits here
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "error": error, "s": took, "warnings": warnings.lines,
        "published": [(m.step, m.ok) for m in cb.metrics]}))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
