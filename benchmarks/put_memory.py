"""What ``s3_small_puts.py`` and ``gcs_small_puts.py`` share: their flags, the measured puts of one run in a child
process, and the parent's table and summary. Each script keeps its store (a server on 127.0.0.1), how it opens the
storage and how it reads the objects back.

Each run writes ``--files`` numpy buffers of ``--mib`` MiB on ``--threads`` threads through ``Storage.put_bytes``
in a fresh process, and reports that process's peak resident memory during the puts over its resident memory just
before them (the kernel's high-water mark, reset first: the buffers are resident by then), its CPU seconds and the
wall time. Runs: ``copied`` (the baseline: each view copied to ``bytes`` and handed to ``Storage._pipe_file``, what
``put_bytes`` did before it sent buffers), ``views`` (``put_bytes`` of each view) and ``bytes``.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.bench_args import arg_int

MiB = 2**20
RUNS = ("copied", "views", "bytes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags both scripts take (and the hidden ones a child run is started with)."""
    p.add_argument("--files", type=arg_int(1), default=8, help="files written (default 8)")
    p.add_argument("--mib", type=arg_int(1, 63), default=48,
                   help="MiB per file, below the 64 MiB multipart threshold (default 48)")
    p.add_argument("--threads", type=arg_int(1), default=8, help="puts at once (upload_concurrency; default 8)")
    p.add_argument("--repeat", type=arg_int(1), default=1, help="rounds of the three runs (default 1)")
    p.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--bucket", help=argparse.SUPPRESS)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(st: Any, arrays: list[Any], run: str, threads: int) -> dict[str, float]:
    """One run's puts of ``arrays`` through ``st`` (a Storage whose client is warm), measured in this process."""
    from concurrent.futures import ThreadPoolExecutor

    datas: list[bytes | memoryview] = [a.tobytes() for a in arrays] if run == "bytes" else [memoryview(a)
                                                                                                for a in arrays]
    if run == "bytes":
        arrays.clear()  # the bytes are the buffers now

    def put(i: int) -> None:
        rel, data = f"f{i:03d}.bin", datas[i]
        if run == "copied":
            st._run("put", rel, lambda: st._pipe_file(st._path(rel), memoryview(data).tobytes()))
        else:
            st.put_bytes(rel, data)

    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the resident memory now
    rss0 = _status_kib("VmRSS")
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(put, range(len(datas))))
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = _status_kib("VmHWM")
    return {"peak_mib": (peak - rss0) / 1024, "wall_s": wall,
            "cpu_s": cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime}


def run_all(script: str, args: argparse.Namespace, endpoint: str, bucket: str, each: str,
            read_back: Callable[[str, Sequence[bytes]], bool], expected: Sequence[bytes]) -> int:
    """The parent: ``--repeat`` rounds of the three runs, each in a child of ``script``; a row per run, whether
    ``read_back(prefix, expected)`` found every object byte-identical, then the summary against the baseline."""
    from benchmarks.machine_info import machine

    print(f"machine: {machine()}")
    print(f"{args.files} files of {args.mib} MiB, {args.threads} puts at once, {each}; "
          f"peak = resident memory over that just before the puts (the buffers)")
    print(f"{'run':>7} {'peak MiB':>9} {'CPU s':>6} {'wall s':>7}  objects")
    results: dict[str, list[dict[str, Any]]] = {run: [] for run in RUNS}
    for _ in range(args.repeat):
        for run in RUNS:
            proc = subprocess.run([sys.executable, script, "--child", run, "--endpoint", endpoint, "--bucket", bucket,
                                   "--files", str(args.files), "--mib", str(args.mib), "--threads",
                                   str(args.threads)], capture_output=True, text=True,
                                  cwd=Path(script).resolve().parents[1], timeout=600)
            if proc.returncode != 0:
                print(f"run {run} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            same = read_back(out["prefix"], expected)
            results[run].append(out)
            print(f"{run:>7} {out['peak_mib']:9.0f} {out['cpu_s']:6.2f} {out['wall_s']:7.2f}  "
                  f"{'byte-identical' if same else 'DIFFERENT'}")
            if not same:
                return 1
    base = min(float(r["peak_mib"]) for r in results["copied"])
    total = args.files * args.mib
    print(f"copied (baseline): peak {base:.0f} MiB ({base / total:.2f}x the files' {total} MiB)")
    for run in RUNS[1:]:
        peak = min(float(r["peak_mib"]) for r in results[run])
        print(f"{run}: peak {peak:.0f} MiB ({peak / total:.2f}x the files' bytes), {peak - base:+.0f} MiB against "
              f"the baseline (lowest of {args.repeat})")
    return 0
