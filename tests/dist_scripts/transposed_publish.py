"""Parts published with their dims permuted (a checkpoint that stores tensors transposed), and tensors joined along
dim 0 (a checkpoint that keeps q, k and v as one), under FSDP2 on 2 ranks.

Why: a permuted part's chunk on each rank is a strided view of the rank's shard (``Segment.pieces``): a dim-0
shard's flat range cut into boxes of the part (``slab.range_boxes``), or a ``Shard(1)`` box cut to the part's
slab, each box then permuted (``slab.permute_box``). The single-process test holds every tensor whole; only
sharding makes the ranges start and end inside the part's rows, and the boxes cover a column range. Every rank
perturbs its shards a little (a sparse random update, so deltas are small) and publishes every step, a full
snapshot every third; after each publish every rank gathers the framework's own full state, split and permuted
(``gather_full_state(..., split=...)``, collective), and rank 0 keeps its bytes. After ``close`` rank 0 rebuilds
every accepted snapshot from the bucket (deltas applied on their parents) and compares names, shapes and bytes.

The model (published names and shapes after the split):

- ``model.layers.0.mlp.experts.gate_up_proj`` (3, 6, 5) -> (3, 5, 6) and ``...down_proj`` (3, 5, 3) -> (3, 3, 5),
  by ``transpose_fused_experts``; 3 experts over 2 ranks: 2 + 1 (dim 0, flat ranges).
- ``model.layers.0.mlp.cols.weight`` (6, 4), ``fully_shard``-ed with ``Shard(1)`` (columns 0-1 and 2-3: boxes),
  published whole as (4, 6) by a custom part with dims (1, 0).
- ``model.layers.0.mlp.rows.weight`` (9, 4), dim 0 (rows 0-4 and 5-8: elements 0..19 and 20..35), published as
  three row blocks ``model.layers.0.mlp.rows.{i}.weight`` of elements [0, 6) as (2, 3), [6, 30) as (4, 6) and
  [30, 36) as (2, 3), each with dims (1, 0): the ranks' boundary, element 20, falls inside the second block's
  row 2, so rank 0 holds its rows 0-1 and the start of row 2, rank 1 the end of row 2 and row 3 (range_boxes'
  whole rows, partial last and partial first row).
- ``model.layers.0.mlp.gate.weight`` (3, 5): published as it is.
- ``model.layers.0.self_attn.{q,k,v}_proj.weight`` (6, 4), (3, 4), (3, 4): published as one
  ``model.layers.0.self_attn.qkv_proj.weight`` (12, 4) by ``rename`` (dim-0 shards 3 + 3, 2 + 1 and 2 + 1 rows),
  q with its rows regrouped as RoPE's permutation does (viewed as (1, 2, 3), published as (1, 3, 2): each rank's
  three rows are every other row of it), and row blocks 0 and 2 above as one ``model.layers.0.mlp.rows.ends``
  (6, 2), block 2 first (boxes of transposed parts, moved down).

Results go to --out as JSON: rank 0's comparison per accepted snapshot, the published shapes, every rank's chunks.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig, transpose_fused_experts  # noqa: E402
from fsdp_hotload.arc.dtypes import RawTensor  # noqa: E402
from fsdp_hotload.fsdp_verify import gather_full_state  # noqa: E402
from tests.dist_util import finish  # noqa: E402
from tests.moe import fused_moe_layer  # noqa: E402
from tests.snapshots import rebuild_accepted  # noqa: E402

EXPERTS, HIDDEN, INTER = 3, 5, 3
COLS = "model.layers.0.mlp.cols.weight"
Q = "model.layers.0.self_attn.q_proj.weight"
ROWS = "model.layers.0.mlp.rows.weight"
ROW_BLOCKS: list[tuple[int, tuple[int, int]]] = [(0, (2, 3)), (6, (4, 6)), (30, (2, 3))]  # (first element, shape)


class TransposedMoe(nn.Module):
    """A fused-experts MoE layer (transformers 5's layout) with two more 2-D weights published transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        layer = fused_moe_layer(EXPERTS, HIDDEN, INTER)
        layer.mlp.cols = nn.Linear(4, 6, bias=False)  # weight (6, 4): FSDP shards its columns (evenly: FSDP2
        # refuses uneven sharding on a dim other than 0)
        layer.mlp.rows = nn.Linear(4, 9, bias=False)  # weight (9, 4): published per row block
        layer.self_attn = nn.Module()
        for proj, rows in (("q_proj", 6), ("k_proj", 3), ("v_proj", 3)):
            setattr(layer.self_attn, proj, nn.Linear(4, rows, bias=False))
        self.model.layers = nn.ModuleList([layer])


def split(path: str, shape: tuple[int, ...]) -> list[tuple[Any, ...]] | None:
    """The fused experts transposed (``transpose_fused_experts``), ``cols`` transposed whole, ``rows`` per block."""
    fused = transpose_fused_experts(path, shape)
    if fused is not None:
        return fused
    if path == COLS:
        return [(path, 0, shape, (1, 0))]
    if path == Q:  # rows regrouped as RoPE's permutation does within a head: (1, 2, 3) -> (1, 3, 2), published (6, 4)
        return [(path, 0, (1, 2, 3, 4), (0, 2, 1, 3), (6, 4))]
    if path == ROWS:
        return [(f"model.layers.0.mlp.rows.{i}.weight", start, part, (1, 0))
                for i, (start, part) in enumerate(ROW_BLOCKS)]
    return None


def rename(name: str) -> str | tuple[str, int]:
    """q, k and v joined as ``qkv_proj`` (in that order); row blocks 2 and 0 joined as ``rows.ends``."""
    qkv = re.fullmatch(r"(.*\.self_attn)\.([qkv])_proj\.weight", name)
    if qkv:
        return f"{qkv[1]}.qkv_proj.weight", "qkv".index(qkv[2])
    blocks = {"model.layers.0.mlp.rows.2.weight": 0, "model.layers.0.mlp.rows.0.weight": 1}
    if name in blocks:
        return "model.layers.0.mlp.rows.ends", blocks[name]
    return name


def raw_of(full: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], bytes]]:
    """Each tensor's shape and bytes, as the snapshot's files hold them."""
    out = {}
    for name, t in full.items():
        raw = RawTensor.from_any(t)
        out[name] = (list(raw.shape), raw.data.tobytes())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hf-dir", required=True, help="the base folder: its config.json")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--full-every", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)  # every rank builds the same weights
    model = TransposedMoe()
    mlp = model.model.layers[0].mlp
    fully_shard(model.model.layers[0], mesh=mesh,
                shard_placement_fn=lambda prm: Shard(1) if prm is mlp.cols.weight else None)
    fully_shard(model, mesh=mesh)
    placements = {n: [repr(pl) for pl in prm.placements] for n, prm in model.named_parameters()}
    cfg = HotloadConfig(bucket_url=args.bucket, hf_config_dir=args.hf_dir, full_every=args.full_every,
                        busy_policy="wait")
    gen = torch.Generator().manual_seed(100 + rank)  # each rank updates its own shards differently
    expected: dict[str, dict[str, tuple[list[int], bytes]]] = {}
    with HotloadCallback(model, cfg, split=split, rename=rename) as hot:
        chunks = [(c.name, c.space, c.box.to_json()) for c in hot.engine.chunks]
        for step in range(args.steps):
            if step:
                with torch.no_grad():
                    for prm in model.parameters():
                        local = prm.to_local()  # this rank's shard itself (no_grad: no copy)
                        mask = torch.rand(local.shape, generator=gen) < 0.15
                        local.add_(torch.randn(local.shape, generator=gen) * 0.5 * mask)
            hot.step(step)
            hot.wait()
            full = gather_full_state(model, split=split, rename=rename)  # collective: every rank calls it
            if rank == 0:
                expected[hot.metrics[-1].identity] = raw_of(full)
        metrics = list(hot.metrics)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, chunks)
    if rank == 0:
        rebuilt = rebuild_accepted(args.bucket, metrics)
        snapshots = []
        for m in metrics:
            want = expected.get(m.identity, {})
            got = {n: (list(t.shape), t.data.tobytes()) for n, t in rebuilt.get(m.identity, {}).items()}
            snapshots.append({"step": m.step, "kind": m.kind, "ok": m.ok, "identity": m.identity,
                              "names_match": sorted(got) == sorted(want) and bool(want),
                              "shape_mismatch": sorted(n for n in want if n in got and got[n][0] != want[n][0]),
                              "byte_mismatch": sorted(n for n in want if n in got and got[n][1] != want[n][1]),
                              "shapes": {n: s for n, (s, _) in got.items()}})
        module_shapes = {n: list(prm.shape) for n, prm in model.named_parameters()}
        result = {"snapshots": snapshots, "module_shapes": module_shapes, "placements": placements,
                  "chunks": everyone}
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
