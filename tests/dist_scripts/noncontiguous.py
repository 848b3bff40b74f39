"""Every rank refuses a model with a non-contiguous tensor, not only the rank that owns it.

A replicated module with a channels_last conv weight (as DDP trains it), and the same module under FSDP1: the
callback's construction must raise the same named error on every rank. Before, only the owning rank raised and
the others went on into collectives its death then broke ("Connection closed by peer").
Results go to --out as JSON (one file per rank).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload.fsdp import local_chunks  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Conv2d(8, 8, 1))
    return m.to(memory_format=torch.channels_last)  # the first conv's weight is no longer C-contiguous


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    results = {}
    for label, make in (("replicated", model), ("fsdp1", lambda: FSDP(model(), device_id=torch.device("cpu"), use_orig_params=True))):
        try:
            local_chunks(make())
            results[label] = "ok"
        except (ValueError, NotImplementedError) as exc:
            results[label] = str(exc)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
