"""Publishes and staleness while retention (keep_last) deletes old snapshots: does a slow retention cost steps?

On an object store a retention pass is a listing, a read per commit marker and a delete per file: hundreds of
milliseconds to seconds. This runs a TensorPublisher (skip policy, one in-flight slot, keep_last=2) over a local
bucket for a fixed number of short trainer steps, with every retention pass made longer by a sleep of ``--ret-s``
standing in for those round trips, and prints per run: the steps published, the staleness of the served snapshots
(trainer steps between the published step and the moment the fleet served it) and the median hook-to-served
time. The baseline, in the same run, is a retention that takes no extra time. Where retention holds the
publisher, the steps during it are skipped; where it runs beside the next snapshot, none are.

    python benchmarks/retention_overlap.py [--ret-s 0.5] [--step-s 0.1] [--steps 60]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_float, arg_int  # noqa: E402  (the repository root is on sys.path)


def run(ret_s: float, step_s: float, steps: int) -> tuple[int, list[int], float]:
    import fsdp_hotload.retention as retention
    from fsdp_hotload.config import HotloadConfig
    from fsdp_hotload.publish import TensorPublisher

    real = retention.retain_after

    def slow(*args: object, **kwargs: object) -> None:
        time.sleep(ret_s)
        real(*args, **kwargs)  # type: ignore[arg-type]

    retention.retain_after = slow  # type: ignore[assignment]
    try:
        g = torch.Generator().manual_seed(0)
        model = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(256, 256, generator=g) for i in range(4)}
        with tempfile.TemporaryDirectory() as d:
            cfg = HotloadConfig(bucket_url=d, keep_last=2, publish_on_close=False, full_every=10,
                                progress_log_s=None)
            with TensorPublisher(model, cfg) as pub:
                pub.publish(0, model)  # the codec's warm-up and the first full, outside the figures
                pub.wait()
                published = 0
                for step in range(1, steps + 1):
                    model["model.layers.0.mlp.up_proj.weight"][step % 256].add_(1.0)
                    published += bool(pub.publish(step, model))
                    time.sleep(step_s)
                pub.wait()
            served = [m for m in pub.metrics if m.ok][1:]
    finally:
        retention.retain_after = real
    return published, [m.staleness_steps for m in served], statistics.median(m.total_s for m in served)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ret-s", type=arg_float(0), default=0.5, help="extra seconds each retention pass takes")
    p.add_argument("--step-s", type=arg_float(0), default=0.1, help="seconds per trainer step")
    p.add_argument("--steps", type=arg_int(1), default=60, help="trainer steps per run (after a first full)")
    args = p.parse_args()
    from benchmarks.machine_info import machine

    print(f"machine: {machine()}")
    print("| retention extra s | published | staleness mean | staleness max | hook to served, median s |")
    print("|---|---|---|---|---|")
    figures = {}
    for ret_s in (0.0, args.ret_s):
        published, stale, total = run(ret_s, args.step_s, args.steps)
        figures[ret_s] = published
        print(f"| {ret_s:g} | {published}/{args.steps} | {statistics.mean(stale):.2f} | {max(stale)} | {total:.3f} |")
    print(f"ratio published with retention {args.ret_s:g} s / baseline: {figures[args.ret_s] / figures[0.0]:.2f}")


if __name__ == "__main__":
    main()
