"""Host memory of concurrent one-request puts to S3: files below the multipart threshold, sent from their buffers.

A publisher assembles each file it owns in one buffer and uploads up to ``upload_concurrency`` (8) at once. A file
below the multipart threshold (64 MiB) goes up in one PutObject; when its body had to be ``bytes``, each buffer was
copied whole first, so 8 files of 48 MiB took up to 384 MiB more host memory than the buffers themselves. This
writes ``--files`` buffers of ``--mib`` MiB (numpy, as the publisher's are) on ``--threads`` threads through
``Storage.put_bytes`` (the publisher's pattern: a pool calling it per file) to a real moto S3 server on 127.0.0.1,
in a child process per run, and reports the child's peak resident memory during the puts over its resident memory
just before them (the kernel's high-water mark, reset first; the buffers are already resident then), its CPU
seconds (the server runs in another process) and the wall time. Every object is read back and compared.

Runs, in the same invocation:

- ``copied`` (the baseline): each worker copies its view to ``bytes`` and sends that as the PutObject body
  (``Storage._pipe_file``, under ``Storage._run``), which is what ``put_bytes`` did with a view before it read the
  view itself; over plain HTTP the unsent rest of a ``bytes`` body is copied again into the socket's buffer.
- ``views``: ``put_bytes`` of the views as they are, as the publisher passes a full snapshot's files.
- ``bytes``: ``put_bytes`` of buffers that are ``bytes`` already, as a delta's files are.

    python benchmarks/s3_small_puts.py [--files 8] [--mib 48] [--threads 8] [--repeat 1]
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
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(run: str, endpoint: str, bucket: str, files: int, mib: int, threads: int) -> dict[str, float | str]:
    """One run in this (fresh) process: the puts, measured; what it measured, and the prefix it wrote under."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from fsdp_hotload.storage import Storage

    prefix = f"bench-{run}-{uuid.uuid4().hex[:8]}"
    options = {"key": "bench", "secret": "bench", "endpoint_url": endpoint,
               "client_kwargs": {"region_name": "us-east-1"}}
    st = Storage(f"s3://{bucket}/{prefix}", options, max_concurrency=threads)
    st.exists("warm-up")  # the client, its session and a connection exist before the measurement
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, mib * MiB, dtype=np.uint8) for _ in range(files)]
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


def _expected(files: int, mib: int) -> list[bytes]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, mib * MiB, dtype=np.uint8).tobytes() for _ in range(files)]


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
    os.environ.update(_CREDENTIALS)
    os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    if args.child:
        print(json.dumps(child(args.child, args.endpoint, args.bucket, args.files, args.mib, args.threads)))
        return 0
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import botocore.session
    from moto.server import ThreadedMotoServer

    from benchmarks.machine_info import machine

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint, bucket = f"http://{host}:{port}", f"bench-{uuid.uuid4().hex[:8]}"
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
            aws_secret_access_key="bench")
        client.create_bucket(Bucket=bucket)
        expected = _expected(args.files, args.mib)
        print(f"machine: {machine()}")
        print(f"{args.files} files of {args.mib} MiB, {args.threads} puts at once, one PutObject each; "
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
                same = all(client.get_object(Bucket=bucket, Key=f"{out['prefix']}/f{i:03d}.bin")["Body"].read()
                           == expected[i] for i in range(args.files))
                client.delete_objects(Bucket=bucket, Delete={"Objects": [
                    {"Key": f"{out['prefix']}/f{i:03d}.bin"} for i in range(args.files)]})  # moto holds them in memory
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
