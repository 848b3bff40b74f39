"""Costs per tensor as the tensor count grows: a model of many tiny tensors, so what is timed is per-tensor Python.

Real checkpoints hold 50k-100k+ tensors (DeepSeek-V3: ~91k; an MoE published per expert), and a cost that grows
faster than the count only shows there. For each count this builds a plain module of that many 4x4 fp32
parameters (500 per layer, one layer per file) and times, in one process: ``HotloadCallback(...)``, the hook
(``step()``: the larger of the first two, where one-off costs would show, and the median of the rest), and the
background work of a full and of a delta snapshot (hook to durable, the hook taken off). The baseline, measured in
the same run, is one ``torch._foreach_copy_`` casting every parameter to bf16: the least any hook can do. The last lines give each figure's cost per tensor at the
largest count over that at the smallest: about 1 where the cost is linear in the count.

    python benchmarks/tensor_count.py [--counts 10000,40000] [--steps 6]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_int, arg_int_list  # noqa: E402  (the repository root is on sys.path)
PER_LAYER = 500


def build(n: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList()
    for first in range(0, n, PER_LAYER):
        layer = nn.Module()
        for k in range(min(PER_LAYER, n - first)):
            layer.register_parameter(f"p{k}", nn.Parameter(torch.randn(4, 4)))
        model.layers.append(layer)
    return model


def bare_copy_s(model: nn.Module) -> float:
    """One batched cast-copy of every parameter to bf16 (best of 3): the floor of a hook."""
    params = [p.detach() for p in model.parameters()]
    out = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch._foreach_copy_(out, params)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(n: int, steps: int, root: Path) -> dict[str, float]:
    from fsdp_hotload import HotloadCallback, HotloadConfig

    model = build(n)
    bare = bare_copy_s(model)
    cfg = HotloadConfig(bucket_url=str(root / f"bucket{n}"), busy_policy="wait", full_every=1000,
                        progress_log_s=None)
    t0 = time.perf_counter()
    cb = HotloadCallback(model, cfg)
    construct = time.perf_counter() - t0
    params = list(model.parameters())
    hooks, background = [], []
    try:
        for step in range(steps):
            with torch.no_grad():
                for p in params[step::97]:  # a few tensors change per step: a delta with something in it
                    p.add_(1.0)
            t0 = time.perf_counter()
            cb.step(step)
            hook = time.perf_counter() - t0
            cb.wait()
            hooks.append(hook)
            background.append(time.perf_counter() - t0 - hook)
        kinds = [m.kind for m in cb.metrics]
        assert kinds[0] == "full" and all(k == "delta" for k in kinds[1:]) and all(m.ok for m in cb.metrics), kinds
    finally:
        cb.close()
    return {"construct": construct, "first": max(hooks[:2]), "hook": statistics.median(hooks[2:]),
            "full": background[0], "delta": statistics.median(background[1:]), "bare": bare}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=arg_int_list(1), default=[10000, 40000], help="tensor counts, comma-separated")
    p.add_argument("--steps", type=arg_int(3), default=6, help="publishes per count: a full, then deltas (>= 3)")
    args = p.parse_args()
    counts = sorted(args.counts)
    from benchmarks.machine_info import machine

    rows: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        measure(100, 3, Path(tmp))  # once-per-process costs (imports, the codec's compiled code) left out
        for n in counts:
            rows[n] = measure(n, args.steps, Path(tmp))
    print(f"machine: {machine()}")
    print("| tensors | HotloadCallback(...) | first hooks (max of 2) | hook (step) | hook / bare cast-copy | "
          "full, background | delta, background |")
    print("|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        def cell(seconds: float, n: int = n) -> str:
            return f"{seconds * 1e3:.1f} ms ({seconds / n * 1e6:.1f} us/tensor)"
        print(f"| {n} | {cell(r['construct'])} | {cell(r['first'])} | {cell(r['hook'])} | "
              f"{r['hook'] / r['bare']:.1f}x | "
              f"{cell(r['full'])} | {cell(r['delta'])} |")
    if len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        growth = ", ".join(f"{k} {rows[hi][k] / hi / (rows[lo][k] / lo):.2f}"
                           for k in ("construct", "hook", "full", "delta"))
        print(f"cost per tensor at {hi} over that at {lo} (about 1: linear in the count): {growth}")


if __name__ == "__main__":
    main()
