"""A Megatron-shaped model under ``HotloadCallback`` on 2 ranks: Megatron's DistributedDataParallel (not torch's)
holding a Float16Module holding the model, with tensor-parallel parameters (each rank holds a partition, marked
``tensor_model_parallel`` / ``partition_dim`` as Megatron's layers mark them) and an expert parameter (marked
``allreduce=False``). The callback took them for replicated plain tensors and published rank 0's partitions as
the whole tensors. Each rank writes what the construction raised to --out/rank<r>.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_util import finish, start_rank  # noqa: E402


def tp_param(shape: tuple[int, ...], dim: int, rank: int) -> nn.Parameter:
    p = nn.Parameter(torch.randn(*shape) + rank)
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1  # type: ignore[attr-defined]
    return p


def main() -> None:
    bucket, out, rank = start_rank()
    gpt = nn.Module()
    gpt.qkv = nn.Linear(8, 12, bias=False)
    gpt.qkv.weight = tp_param((12, 8), 0, rank)  # ColumnParallelLinear's partition
    gpt.norm = nn.LayerNorm(8)  # replicated: fine on its own
    f16 = nn.Module()
    f16.add_module("module", gpt)
    ddp = nn.Module()
    ddp.add_module("module", f16)
    expert = nn.Module()
    expert.add_module("module", nn.Linear(8, 8, bias=False))
    expert.module.weight.allreduce = False  # type: ignore[attr-defined]  # an expert-parallel parameter
    found = {}
    for case, model in (("tp", ddp), ("expert", expert)):
        try:
            hot = HotloadCallback(model, HotloadConfig(bucket_url=f"{bucket}/{case}"))
            hot.close(raise_errors=False)
            found[case] = None
        except Exception as exc:  # noqa: BLE001 - written for the test to read
            found[case] = f"{type(exc).__name__}: {exc}"
    (out / f"rank{rank}.json").write_text(json.dumps(found))
    torch.distributed.barrier()
    finish()


if __name__ == "__main__":
    main()
