"""Device-side diff throughput against the device's own copy bandwidth (needs CUDA; prints why not otherwise).

What is timed is what the publisher does per rank on a GPU for a delta: ``Stager.diff`` over a staged bf16 shard
against the cache (compare on the device, pull only changed positions and values to the host), reported in GB/s
of bf16 bytes in, next to a plain device-to-device copy of the same bytes measured in the same run; then the
host's share of the same delta, on one core: the arc_v2 frames of those changes and the Adler-32 update.
Device memory: the diff's peak temporaries, against the bound ``DIFF_BLOCK`` sets.

    python benchmarks/gpu_diff.py [--gb 2] [--changed 0.02]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_hotload.arc.adler import update_parts  # noqa: E402
from fsdp_hotload.arc.codecs import ArcV2, ElementDiff  # noqa: E402
from fsdp_hotload.engine.staging import DIFF_BLOCK  # noqa: E402

from benchmarks.bench_args import arg_fraction, arg_int, arg_positive  # noqa: E402
from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from staged_delta import staged_delta  # noqa: E402


def timed(fn, repeat: int = 5) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def host_share(codec: ArcV2, diffs: Sequence[ElementDiff]) -> tuple[int, float, float]:
    """Payload bytes, then seconds on one core for the arc_v2 frames and for the Adler-32 update of ``diffs``.

    Each is run once on the first diff before it is timed: the first call of a numba kernel loads it from the
    disk cache, or compiles it on a cold one (a fresh machine), which is no part of a publish's cost."""
    codec.warm_up()
    codec.encode(diffs[0])
    d0 = diffs[0]
    update_parts((0, 0), d0.idx, d0.old, d0.new, d0.itemsize, d0.n * d0.itemsize)
    t0 = time.perf_counter()
    payload = sum(len(codec.encode(d)) for d in diffs)
    encode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for d in diffs:
        update_parts((0, 0), d.idx, d.old, d.new, d.itemsize, d.n * d.itemsize)
    return payload, encode_s, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=arg_positive(), default=2.0, help="bf16 shard size in GB")
    p.add_argument("--changed", type=arg_fraction(), default=0.02, help="fraction of elements changed")
    p.add_argument("--tensors", type=arg_int(1), default=64)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_diff: no CUDA device here; nothing measured (run it on a GPU machine)")
        return 0
    _, st, buf = staged_delta("cuda", args.gb, args.changed, args.tensors)
    stage_s = timed(lambda: st.wait_event(st.stage(buf)))
    diff_s = timed(lambda: st.diff(buf), repeat=3)
    dst = torch.empty_like(buf)
    copy_s = timed(lambda: dst.copy_(buf))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    diffs = st.diff(buf)
    peak = torch.cuda.max_memory_allocated() - base
    changed = sum(d.changed for d in diffs) / sum(s.numel for s in st.slices)
    codec = ArcV2()
    payload, encode_s, adler_s = host_share(codec, diffs)
    nbytes = st.nbytes
    print(f"device: {torch.cuda.get_device_name()}  shard {nbytes / 1e9:.2f} GB bf16 in {args.tensors} tensors, "
          f"changed {100 * changed:.2f}%")
    print(f"{'operation':<40} {'seconds':>9} {'GB/s':>9}")
    for name, s in [("device copy (baseline)", copy_s), ("stage (cast fp32->bf16 copy)", stage_s),
                    ("diff (device compare + pull)", diff_s), ("host: arc_v2 frames (one core)", encode_s),
                    ("host: Adler-32 update (one core)", adler_s)]:
        print(f"{name:<40} {s:>9.4f} {nbytes / s / 1e9:>9.1f}")
    print(f"diff / copy bandwidth: {copy_s / diff_s:.3f}; diff peak device temporaries {peak / 2**20:.0f} MiB "
          f"(bound {DIFF_BLOCK * 13 / 2**20:.0f} MiB for bf16); payload {payload / 1e6:.1f} MB "
          f"({100 * payload / nbytes:.2f}% of the shard); frames by {codec.encoder_info}, {codec.delta_path()}")
    print(f"machine: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
