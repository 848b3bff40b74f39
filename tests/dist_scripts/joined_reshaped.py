"""Run under torchrun (gloo, CPU, 2 ranks): a tensor joined from a part published reshaped and a boxed part.

``q`` is published with its rows regrouped (viewed as (4, 2, 3), dims 0 and 1 swapped, reshaped to (6, 4), as
RoPE's permutation is published), and joined along dim 0 with ``k`` published transposed, whose parts are boxes:
so every block of the joined tensor is given as boxes. Each FSDP2 rank holds two rows of ``q``: its runs of the
regrouped part cut rows of (6, 4), held by (2, 3) views of its shard. Every rank's chunks must be views with their
box's elements and rebuild the gathered state bit for bit (``check_chunks.verify``), before and after a step.
Prints "RANK r OK n" at the end; any failure raises (non-zero exit).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload.fsdp import local_chunks  # noqa: E402
from tests.dist_scripts import check_chunks  # noqa: E402
from tests.dist_util import finish  # noqa: E402


class QK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(4, 6))
        self.k = nn.Parameter(torch.randn(4, 2))


def split(path: str, shape: tuple[int, ...]) -> list[tuple[Any, ...]] | None:
    if path == "q":
        return [("q.regrouped", 0, (4, 2, 3), (1, 0, 2), (6, 4))]
    if path == "k":
        return [("k.t", 0, (4, 2), (1, 0))]
    return None


def rename(name: str) -> str | tuple[str, int]:
    return {"q.regrouped": ("qk", 0), "k.t": ("qk", 1)}.get(name, name)


def main() -> None:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = QK()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    kw: dict[str, Any] = dict(split=split, rename=rename, snapshot_dtype="F32")
    chunks = local_chunks(model, **kw)
    check_chunks.expect({c.space for c in chunks} == {"shape"}, f"spaces {[c.space for c in chunks]}")
    check_chunks.verify("joined-reshaped", model, ["qk"], **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(-2.0)
    check_chunks.verify("joined-reshaped/live-views", model, ["qk"], chunks=chunks, **kw)
    dist.barrier()
    print(f"RANK {dist.get_rank()} OK {check_chunks.CHECKS}", flush=True)
    finish()


if __name__ == "__main__":
    main()
