"""Rank 0's close() gives up on its vote at close_timeout_s (rank 1 is still writing a checkpoint of its own after
the last step); rank 1 then closes on an exception, so it never votes, and keeps its process alive for a while.

With the vote as a gloo reduction, rank 0's gave-up reduction stayed pending: its destroy_process_group() (the
teardown the README recommends) and its exit waited until rank 1's process exited. Rank 0 writes a marker once
its teardown returned; rank 1 waits for it (20 s at most) before it exits. Each rank writes what it saw to
``--out``/rank<r>.json.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.check_chunks import fsdp2, train_and_publish  # noqa: E402
from tests.dist_util import WarningLines, start_rank  # noqa: E402


def main() -> None:
    bucket, out, rank = start_rank()
    warnings = WarningLines.attach()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    cb = HotloadCallback(model, HotloadConfig(bucket_url=bucket, publish_every=2, collective_timeout_s=60,
                                              close_timeout_s=1))
    train_and_publish(model, cb, 4)
    marker = Path(out, "rank0-torn-down")
    found: dict[str, object] = {}
    if rank == 1:
        time.sleep(3)  # its own checkpoint write after the last step, past rank 0's close() deadline
        cb.close(raise_errors=False)  # as on an exception: it does not vote
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        found["rank 0 torn down while rank 1 lives"] = marker.exists()
    else:
        try:
            cb.close()
            found["error"] = None
        except Exception as exc:  # noqa: BLE001 - what is tested
            found["error"] = f"{type(exc).__name__}: {exc}"
        dist.destroy_process_group()
        marker.write_text("")
        found["published"] = [(m.step, m.ok) for m in cb.metrics]
    found["warnings"] = warnings.lines
    Path(out, f"rank{rank}.json").write_text(json.dumps(found))
    sys.stdout.flush()
    os._exit(0)  # rank 1's group is still up (rank 0 destroyed its own): no teardown to wait for


if __name__ == "__main__":
    main()
