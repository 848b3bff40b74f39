"""One rank's training raises before step 3's publish (it leaves ``with cb:`` on that exception), while the other
publishes step 3 with ``busy_policy="wait"`` and closes cleanly.

The clean rank's step 3 waits in a collective on the side group that the other rank has closed: its close() raised
gloo's own text ("Connection reset by peer ... typically caused by a remote worker hanging"), which points at a hang
or a bug while the cause, the other rank's note, is in the job's store. Each rank writes what its close raised, how
long it took, and the steps published to ``--out``/rank<r>.json.
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
from tests.dist_util import finish, start_rank  # noqa: E402


def main() -> None:
    bucket, out, rank = start_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    cb = HotloadCallback(model, HotloadConfig(bucket_url=bucket, busy_policy="wait", collective_timeout_s=60,
                                              full_every=100))
    error, started = None, None
    try:
        with cb:
            for step in range(4):
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(0.01)
                if rank == 1 and step == 3:
                    raise RuntimeError("injected: this rank's data loader broke")
                cb.step(step)
            started = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - what is tested
        error = f"{type(exc).__name__}: {exc}"
    took = None if started is None else time.monotonic() - started
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "error": error, "s": took, "published": [(m.step, m.ok) for m in cb.metrics]}))
    finish()


if __name__ == "__main__":
    main()
