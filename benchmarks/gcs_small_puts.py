"""Host memory of concurrent one-request puts to GCS (gs://, gcsfs): files below the multipart threshold.

A publisher assembles each file it owns in one buffer and uploads up to ``upload_concurrency`` (8) at once. On gs://
a file below the multipart threshold (64 MiB) goes up in one request (a multipart/related upload: a JSON part with
the object's name, then the bytes). gcsfs builds that body by joining its framing and the file into one new
``bytes``, after ``put_bytes`` had turned a view into ``bytes`` already, and the event loop copies what the socket
did not take at once into its send buffer. This writes ``--files`` buffers of ``--mib`` MiB (numpy, as the
publisher's are) on ``--threads`` threads through ``Storage.put_bytes`` (the publisher's pattern) to a real GCS
JSON API server on 127.0.0.1 (gcp-storage-emulator, in the parent process), one child process per run, and reports
the child's peak resident memory during the puts over its resident memory just before them (the kernel's high-water
mark, reset first; the buffers are already resident then), its CPU seconds and the wall time. Every object is read
back and compared.

Runs, in the same invocation:

- ``copied`` (the baseline): each worker copies its view to ``bytes`` and hands that to gcsfs's ``pipe_file``
  (``Storage._pipe_file``, under ``Storage._run``), which is what ``put_bytes`` did on gs:// before it sent the
  buffer itself.
- ``views``: ``put_bytes`` of the views as they are, as the publisher passes a full snapshot's files.
- ``bytes``: ``put_bytes`` of buffers that are ``bytes`` already, as a delta's files are.

Each buffer's last byte is made other than 0x0d: the emulator drops a final carriage return from a one-request
upload framed the way gcsfs frames it (the ``copied`` run), which is the emulator's parser, not the data.

    python benchmarks/gcs_small_puts.py [--files 8] [--mib 48] [--threads 8] [--repeat 1]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_int  # noqa: E402  (the repository root is on sys.path)

MiB = 2**20
RUNS = ("copied", "views", "bytes")
_PROJECT = "bench"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _buffers(files: int, mib: int) -> list:
    """The files' contents (numpy uint8 arrays), the same in every process: seeded, last byte never 0x0d."""
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(files):
        a = rng.integers(0, 256, mib * MiB, dtype=np.uint8)
        if a[-1] == 0x0D:
            a[-1] = 0
        out.append(a)
    return out


def _options(endpoint: str) -> dict[str, str]:
    return {"endpoint_url": endpoint, "token": "anon", "project": _PROJECT}


def child(run: str, endpoint: str, bucket: str, files: int, mib: int, threads: int) -> dict[str, float | str]:
    """One run in this (fresh) process: the puts, measured; what it measured, and the prefix it wrote under."""
    from concurrent.futures import ThreadPoolExecutor

    from fsdp_hotload.storage import Storage

    prefix = f"bench-{run}-{uuid.uuid4().hex[:8]}"
    st = Storage(f"gs://{bucket}/{prefix}", _options(endpoint), max_concurrency=threads)
    st.exists("warm-up")  # the filesystem, its session and a connection exist before the measurement
    arrays = _buffers(files, mib)
    datas: list[bytes | memoryview] = [a.tobytes() for a in arrays] if run == "bytes" else [memoryview(a)
                                                                                                for a in arrays]
    if run == "bytes":
        del arrays  # the bytes are the buffers now

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
        list(pool.map(put, range(files)))
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = _status_kib("VmHWM")
    return {"prefix": prefix, "peak_mib": (peak - rss0) / 1024, "wall_s": wall,
            "cpu_s": cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=arg_int(1), default=8, help="files written (default 8)")
    p.add_argument("--mib", type=arg_int(1, 63), default=48,
                   help="MiB per file, below the 64 MiB multipart threshold (default 48)")
    p.add_argument("--threads", type=arg_int(1), default=8, help="puts at once (upload_concurrency; default 8)")
    p.add_argument("--repeat", type=arg_int(1), default=1, help="rounds of the three runs (default 1)")
    p.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--bucket", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # gcsfs's default filesystem asks a bucket's layout over gRPC, which the emulator does not serve
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    os.environ.pop("STORAGE_EMULATOR_HOST", None)
    os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    if args.child:
        print(json.dumps(child(args.child, args.endpoint, args.bucket, args.files, args.mib, args.threads)))
        return 0
    logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
    from gcp_storage_emulator.server import create_server

    from benchmarks.machine_info import machine
    from fsdp_hotload.storage import Storage

    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
    server.start()
    httpd = server._api._httpd
    report = httpd.handle_error

    def handle_error(request: object, address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went before its answer
            report(request, address)

    httpd.handle_error = handle_error
    try:
        endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"
        expected = [a.tobytes() for a in _buffers(args.files, args.mib)]
        print(f"machine: {machine()}")
        print(f"{args.files} files of {args.mib} MiB, {args.threads} puts at once, one request each; "
              f"peak = resident memory over that just before the puts (the buffers)")
        print(f"{'run':>7} {'peak MiB':>9} {'CPU s':>6} {'wall s':>7}  objects")
        results: dict[str, list[dict[str, float | str]]] = {run: [] for run in RUNS}
        for _ in range(args.repeat):
            for run in RUNS:
                proc = subprocess.run([sys.executable, __file__, "--child", run, "--endpoint", endpoint,
                                       "--bucket", bucket, "--files", str(args.files), "--mib", str(args.mib),
                                       "--threads", str(args.threads)], capture_output=True, text=True,
                                      cwd=REPO, timeout=600)
                if proc.returncode != 0:
                    print(f"run {run} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}", file=sys.stderr)
                    return 1
                out = json.loads(proc.stdout.strip().splitlines()[-1])
                reader = Storage(f"gs://{bucket}/{out['prefix']}", _options(endpoint))
                same = all(reader.get_bytes(f"f{i:03d}.bin") == expected[i] for i in range(args.files))
                for i in range(args.files):  # the emulator holds them in memory
                    reader.delete_prefix(f"f{i:03d}.bin")
                results[run].append(out)
                print(f"{run:>7} {out['peak_mib']:9.0f} {out['cpu_s']:6.2f} {out['wall_s']:7.2f}  "
                      f"{'byte-identical' if same else 'DIFFERENT'}")
                if not same:
                    return 1
    finally:
        server.stop()
    base = min(float(r["peak_mib"]) for r in results["copied"])
    total = args.files * args.mib
    print(f"copied (baseline): peak {base:.0f} MiB ({base / total:.2f}x the files' {total} MiB)")
    for run in RUNS[1:]:
        peak = min(float(r["peak_mib"]) for r in results[run])
        print(f"{run}: peak {peak:.0f} MiB ({peak / total:.2f}x the files' bytes), {peak - base:+.0f} MiB against "
              f"the baseline (lowest of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
