"""Rebuild published snapshots from a bucket with the reference decoder, for bit-exactness checks."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.emulator_load import load_snapshot


def rebuild_accepted(bucket: str | Path, metrics: Sequence[Any]) -> dict[str, dict[str, RawTensor]]:
    """Every accepted snapshot of one publisher's run (its PublishMetrics, in order), each delta applied on
    top of the snapshot accepted before it, as the fleet would."""
    def get(path: str) -> bytes:
        return (Path(bucket) / path).read_bytes()

    out: dict[str, dict[str, RawTensor]] = {}
    parent: dict[str, RawTensor] = {}
    weight_map = None
    previous = None
    for m in metrics:
        if not m.ok:
            continue
        prev = previous if m.kind == "delta" else None
        parent, weight_map, _ = load_snapshot(get, m.identity, previous=prev, compression_format="arc_v2",
                                              parent=parent, parent_weight_map=weight_map)
        out[m.identity] = parent
        previous = m.identity
    return out
