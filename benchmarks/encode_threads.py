"""A delta's encode time per rank against the number of encode threads (``HotloadConfig.encode_workers``).

What is timed is ``ChunkEncoder.encode`` of one staged delta, as the publisher runs it: on CUDA the device diff,
then the host frames each chunk's changes; on the CPU one pass per chunk (``--path dense``, a CPU trainer's path),
or, with ``--path sparse``, the GPU rank's host share run on the CPU (the diff first, then the frames of the
changes). The baseline is one thread, measured in the same run; every thread count must write the same bytes.

    python benchmarks/encode_threads.py [--gb 0.5] [--changed 0.02] [--tensors 64] [--workers 1,2,4]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_hotload.arc.codecs import ArcV2, ElementDiff  # noqa: E402
from fsdp_hotload.engine.encode import ChunkEncoder  # noqa: E402

from benchmarks.bench_args import arg_fraction, arg_int, arg_int_list, arg_positive  # noqa: E402
from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from staged_delta import staged_delta  # noqa: E402


class FramesFromChanges:
    """``arc_v2`` without its one-pass host method, so host buffers take the GPU rank's path (diff, then frames)."""

    def __init__(self) -> None:
        self.codec = ArcV2()
        self.name = self.codec.name

    def encode(self, diff: ElementDiff) -> bytes:
        return self.codec.encode(diff)


def best_encode(enc: ChunkEncoder, buf: torch.Tensor, parts: list[tuple[int, int]], repeat: int
                ) -> tuple[float, float, list[Any]]:
    """Best wall time of ``repeat`` encodes, the diff seconds of that run, and the last run's chunks.

    One untimed encode comes first: it starts the threads and warms the caches, so it must not be the figure."""
    out = enc.encode(buf, "delta", parts)
    best, best_diff = float("inf"), 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = enc.encode(buf, "delta", parts)
        total = time.perf_counter() - t0
        if total < best:
            best, best_diff = total, out.diff_s
    return best, best_diff, list(zip(out.payloads, out.parts, out.changed))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=arg_positive(), default=0.5, help="bf16 shard size in GB")
    p.add_argument("--changed", type=arg_fraction(), default=0.02, help="fraction of elements changed")
    p.add_argument("--tensors", type=arg_int(1), default=64)
    p.add_argument("--workers", type=arg_int_list(1), default=[1, 2, 4],
                   help="comma list of thread counts (1 is always measured)")
    p.add_argument("--path", choices=["dense", "sparse"], default="dense",
                   help="CPU only: one pass per chunk (dense) or diff then frames (sparse, the GPU rank's host share)")
    p.add_argument("--repeat", type=arg_int(1), default=3, help="timed runs per thread count, best kept (one more, "
                                                                "untimed, always comes first)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    counts = sorted({1, *args.workers})
    chunks, st, buf = staged_delta(device, args.gb, args.changed, args.tensors)
    codec: Any = FramesFromChanges() if device == "cpu" and args.path == "sparse" else ArcV2()
    (codec.codec if isinstance(codec, FramesFromChanges) else codec).warm_up()
    path = "device diff, then frames of the changes" if device == "cuda" else (
        "diff, then frames of the changes (a GPU rank's host share)" if args.path == "sparse" else
        "one pass per chunk (a CPU trainer's path)")
    parts = [(0, 0)] * len(chunks)
    rows = []
    first: list[Any] | None = None
    for n in counts:
        enc = ChunkEncoder(chunks, st, codec, workers=n)
        best, best_diff, out = best_encode(enc, buf, parts, args.repeat)
        enc.close()
        got = [(bytes(payload), parts, changed) for payload, parts, changed in out]
        if first is None:
            first = got
        elif got != first:
            raise SystemExit(f"{n} threads wrote other bytes than one thread")
        rows.append((n, best, best_diff))
    changed = sum(e[2] for e in first or []) / sum(s.numel for s in st.slices)
    payload = sum(len(e[0]) for e in first or [])
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; path: {path}")
    print(f"shard {st.nbytes / 1e9:.2f} GB bf16 in {args.tensors} tensors, changed {100 * changed:.2f}%, "
          f"payload {payload / 1e6:.1f} MB; best of {args.repeat}; {len(os.sched_getaffinity(0))} usable cores")
    print(f"{'threads':>7} {'encode s':>9} {'of it diff s':>12} {'framing s':>9} {'vs 1 thread':>11}")
    base = rows[0][1] - rows[0][2]
    for n, total, diff_s in rows:
        framing = total - diff_s
        print(f"{n:>7} {total:>9.3f} {diff_s:>12.3f} {framing:>9.3f} {base / framing:>10.2f}x")
    print(f"machine: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
