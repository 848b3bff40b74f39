"""Ranks holding one box of a tensor with different values are partitions, not copies: ``HotloadCallback`` refuses
them on every rank. Run under torchrun (gloo, CPU, 2 ranks). Cases:

* ``tp``: a Megatron-shaped model (its DistributedDataParallel holding a Float16Module holding the model) with a
  tensor-parallel parameter, marked ``tensor_model_parallel`` / ``partition_dim`` as Megatron's layers mark them;
* ``expert``: a parameter Megatron marks expert-parallel (``allreduce=False``). Both were taken for replicated
  plain tensors, and rank 0's partitions published as the whole tensors; Megatron's marks name the cause.
* ``ep``: expert parallelism without DTensors or marks. Each rank holds its own experts under one name, and FSDP2
  shards them over a size-1 expert-data-parallel mesh dim, so both ranks hold the whole tensor: rank 1's experts
  were dropped as a copy of rank 0's.
* ``late``: the same, where the ranks' first experts are alike and only the second ones differ (the sample read
  only a tensor's first elements).
* ``plain``: a plain parameter (no DTensor, no marks) that differs per rank, as a hand-written tensor-parallel layer
  holds it: only rank 0 made chunks of plain tensors, so no rank compared them.
* ``rows``: a plain embedding whose ranks differ only in a row the samples do not read (they read rows 0, 9, 18,
  ...): the sum of all its bits tells them apart.
* ``split``: a plain tensor split in two parts, of which ``rename`` leaves out the one that differs per rank: only
  what is published is compared, so it is not refused.
* ``buffers``: a module buffer that differs per rank (forward passes update buffers on each rank alone, as
  BatchNorm statistics under FSDP) is not refused; rank 0's is published.

Each rank writes what each construction raised (or None) to --out/rank<r>.json.
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


def megatron_tp(rank: int) -> nn.Module:
    gpt = nn.Module()
    gpt.qkv = nn.Linear(8, 12, bias=False)
    gpt.qkv.weight = nn.Parameter(torch.randn(12, 8) + rank)  # ColumnParallelLinear's partition
    gpt.qkv.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    gpt.qkv.weight.partition_dim, gpt.qkv.weight.partition_stride = 0, 1  # type: ignore[attr-defined]
    gpt.norm = nn.LayerNorm(8)  # replicated: fine on its own
    f16 = nn.Module()
    f16.add_module("module", gpt)
    ddp = nn.Module()
    ddp.add_module("module", f16)
    return ddp


def megatron_expert() -> nn.Module:
    expert = nn.Module()
    expert.add_module("module", nn.Linear(8, 8, bias=False))
    expert.module.weight.allreduce = False  # type: ignore[attr-defined]  # an expert-parallel parameter
    return expert


class MoE(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(4, 4)
        torch.manual_seed(100 + rank)
        self.experts = nn.Parameter(torch.randn(2, 4, 4))  # this rank's 2 experts


def late_moe(rank: int) -> MoE:
    moe = MoE(rank)
    torch.manual_seed(7)
    alike = torch.randn(32, 4)  # more than the 64 elements that were read, alike on every rank
    moe.experts = nn.Parameter(torch.stack([alike, alike + rank]))  # only the second expert tells them apart
    return moe


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    bucket, out, rank = start_rank()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "edp"))
    ep = MoE(rank)
    fully_shard(ep, mesh=mesh["edp"])
    late = late_moe(rank)
    fully_shard(late, mesh=mesh["edp"])
    torch.manual_seed(0)
    partition = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        partition[1].weight.add_(rank)  # this rank's rows of a tensor-parallel layer, in a plain parameter
    fused = nn.Module()
    fused.w = nn.Parameter(torch.cat([torch.ones(4), torch.full((4,), float(rank))]).reshape(2, 4))
    parts = {"split": lambda path, _shape: [("keep", 0, (1, 4)), ("local", 4, (1, 4))] if path == "w" else None,
             "rename": lambda name: None if name == "local" else name}
    torch.manual_seed(0)
    rows = nn.Embedding(64, 4)
    with torch.no_grad():
        rows.weight[1].add_(rank)
    torch.manual_seed(0)
    plain = nn.Linear(4, 4)
    plain.register_buffer("seen", torch.full((3,), float(rank)))
    found = {}
    for case, model in (("tp", megatron_tp(rank)), ("expert", megatron_expert()), ("ep", ep), ("late", late),
                        ("plain", partition), ("rows", rows), ("split", fused), ("buffers", plain)):
        try:
            extra: dict = parts if case == "split" else {}
            hot = HotloadCallback(model, HotloadConfig(bucket_url=f"{bucket}/{case}"), **extra)
            hot.close(raise_errors=False)
            found[case] = None
        except Exception as exc:  # noqa: BLE001 - written for the test to read
            found[case] = f"{type(exc).__name__}: {exc}"
    (out / f"rank{rank}.json").write_text(json.dumps(found))
    torch.distributed.barrier()
    finish()


if __name__ == "__main__":
    main()
