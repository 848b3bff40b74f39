"""A rank's shard staged as a delta against its cache, for the benchmarks that time what follows the staging."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_hotload.arc.boxes import Box  # noqa: E402
from fsdp_hotload.engine.staging import Stager  # noqa: E402
from fsdp_hotload.publish import WholeChunk  # noqa: E402


def staged_delta(device: str, gb: float, changed: float, tensors: int
                 ) -> tuple[list[WholeChunk], Stager, torch.Tensor]:
    """``tensors`` fp32 tensors of ``gb`` GB of bf16 in all: their bytes promoted to the cache, then a fraction
    ``changed`` of the elements (random positions) moved and staged again into the slot returned."""
    per = int(gb * 1e9 / 2 / tensors)
    g = torch.Generator(device=device).manual_seed(0)
    chunks = [WholeChunk(f"t{i}", (per,), "BF16", "flat", Box.flat(0, per),
                         torch.randn(per, device=device, generator=g) * 0.02) for i in range(tensors)]
    st = Stager(chunks, slots=1)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    st.promote(buf)
    with torch.no_grad():
        for c in chunks:
            c.source.add_((torch.rand(per, device=device, generator=g) < changed) * 1e-2)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    return chunks, st, buf
