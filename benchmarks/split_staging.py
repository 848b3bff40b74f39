"""Staging a MoE model's split experts: the trainer's copy of thousands of adjacent parts against one cast-copy.

``split=split_fused_experts`` publishes every expert's gate, up and down weights as tensors of their own, each a
range of a fused parameter, so a rank stages thousands of chunks, each a view next to the last. What is timed is
``Stager.stage`` of those chunks (fp32 masters cast to bf16, as the callback's hook or its helper thread runs it)
against one cast-copy of the same bytes into a preallocated buffer, measured in the same run (the floor), also
given the chunks' views as a list (the callback's call, which checks the sources it is given), and against
staging each chunk by a copy of its own (always timed too: how it was before runs of adjacent chunks were
copied together).

``--transposed`` times ``split=transpose_fused_experts`` instead (Qwen3-VL-MoE's checkpoint layout): one chunk per
fused tensor, its source the shard viewed with the last two dims swapped, so the staging copy reads it strided.

    python benchmarks/split_staging.py [--layers 16] [--experts 128] [--inter 64] [--hidden 128] [--device cpu]
                                       [--transposed]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_args import arg_int  # noqa: E402  (the repository root is on sys.path)

from fsdp_hotload.arc.boxes import Box  # noqa: E402
from fsdp_hotload.engine.copies import CopyGroup  # noqa: E402
from fsdp_hotload.engine.staging import Stager  # noqa: E402
from fsdp_hotload.naming import split_fused_experts, transpose_fused_experts  # noqa: E402
from fsdp_hotload.publish import WholeChunk  # noqa: E402

from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def medians_s(fns: dict[str, Callable[[], None]], reps: int, sync: Callable[[], None]) -> dict[str, float]:
    """Each variant's median time, the variants run round-robin within each repetition: timed one block after
    another, a slow stretch of a busy machine lands on one whole variant and can invert the comparison."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t[2:]) for name, t in times.items()}  # two rounds warm allocator and caches


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=arg_int(1), default=16)
    p.add_argument("--experts", type=arg_int(1), default=128)
    p.add_argument("--inter", type=arg_int(1), default=64, help="each expert's intermediate size")
    p.add_argument("--hidden", type=arg_int(1), default=128)
    p.add_argument("--reps", type=arg_int(1), default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--transposed", action="store_true", help="publish the fused tensors whole, last two dims swapped")
    args = p.parse_args()
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    fused, chunks = [], []
    e, i, h = args.experts, args.inter, args.hidden
    for layer in range(args.layers):
        for path, shape in ((f"model.layers.{layer}.mlp.experts.gate_up_proj", (e, 2 * i, h)),
                            (f"model.layers.{layer}.mlp.experts.down_proj", (e, h, i))):
            t = torch.randn(shape, device=device)
            fused.append(t)
            flat = t.view(-1)
            if args.transposed:
                for name, _start, part, dims in transpose_fused_experts(path, shape) or []:
                    moved = tuple(part[d] for d in dims)
                    chunks.append(WholeChunk(name, moved, "BF16", "shape", Box.whole(moved), t.permute(*dims)))
                continue
            for name, start, part in split_fused_experts(path, shape) or []:
                n = part[0] * part[1]
                chunks.append(WholeChunk(name, part, "BF16", "flat", Box.flat(0, n), flat[start:start + n]))
    st = Stager(chunks)
    buf = st.acquire(wait=False)
    assert buf is not None
    runs = len(st._groups)
    one = Stager(chunks)  # the same chunks, one copy each
    one._groups = [CopyGroup(k, k + 1, (c.source,), None) for k, c in enumerate(chunks)]
    one._plans.clear()
    one._where = []
    one_buf = one.acquire(wait=False)
    assert one_buf is not None
    views = [c.source for c in chunks]  # what the callback passes each publish: the chunks' own views, listed anew
    whole = torch.cat([t.view(-1) for t in fused])
    out = torch.empty(whole.numel(), dtype=torch.bfloat16, device=device)
    got = medians_s({"staged": lambda: st.wait_event(st.stage(buf)),
                     "given": lambda: st.wait_event(st.stage(buf, views)),
                     "per_chunk": lambda: one.wait_event(one.stage(one_buf)),
                     "copy": lambda: out.copy_(whole)}, args.reps, sync)
    staged_s, given_s, per_chunk_s, copy_s = got["staged"], got["given"], got["per_chunk"], got["copy"]
    assert torch.equal(buf, one_buf), "the two ways of staging disagree"
    print(f"{len(chunks)} parts of {2 * args.layers} fused tensors ({st.nbytes / 1e6:.0f} MB bf16) on {device}, "
          f"staged in {runs} copies")
    print(f"{'one cast-copy (floor)':>28}: {copy_s * 1e3:8.2f} ms")
    print(f"{'Stager.stage':>28}: {staged_s * 1e3:8.2f} ms  ({staged_s / copy_s:.2f}x the floor)")
    print(f"{'given the views (callback)':>28}: {given_s * 1e3:8.2f} ms  ({given_s / copy_s:.2f}x the floor)")
    print(f"{'one copy per chunk':>28}: {per_chunk_s * 1e3:8.2f} ms  ({per_chunk_s / copy_s:.2f}x the floor, "
          f"{(per_chunk_s - copy_s) / len(chunks) * 1e6:.1f} us per chunk over it)")
    print(f"machine: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
