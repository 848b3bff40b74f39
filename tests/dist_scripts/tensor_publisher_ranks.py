"""A ``TensorPublisher`` built by every rank of a torchrun job: each publishes its own chain of snapshots.

Each rank builds one, publishes a step and closes; it writes the hotload warnings it logged to
``--out``/rank<r>.json. Only the ranks other than 0 are told (rank 0 alone is the documented use).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadConfig, TensorPublisher  # noqa: E402
from tests.dist_util import WarningLines, start_rank  # noqa: E402


def main() -> None:
    bucket, out, rank = start_rank()
    kept = WarningLines.attach()
    state = {"model.norm.weight": torch.ones(8)}
    with TensorPublisher(state, HotloadConfig(bucket_url=f"{bucket}/rank{rank}")) as pub:
        pub.publish(0, state)
    Path(out, f"rank{rank}.json").write_text(json.dumps(kept.lines))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
