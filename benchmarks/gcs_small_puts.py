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
import sys
import uuid
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.put_memory import MiB, add_arguments, measure, run_all  # noqa: E402  (the root is on sys.path)

_PROJECT = "bench"


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
    from fsdp_hotload.storage import Storage

    prefix = f"bench-{run}-{uuid.uuid4().hex[:8]}"
    st = Storage(f"gs://{bucket}/{prefix}", _options(endpoint), max_concurrency=threads)
    st.exists("warm-up")  # the filesystem, its session and a connection exist before the measurement
    return {"prefix": prefix, **measure(st, _buffers(files, mib), run, threads)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
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

        def read_back(prefix: str, expected: Sequence[bytes]) -> bool:
            reader = Storage(f"gs://{bucket}/{prefix}", _options(endpoint))
            same = all(reader.get_bytes(f"f{i:03d}.bin") == e for i, e in enumerate(expected))
            for i in range(len(expected)):  # the emulator holds them in memory
                reader.delete_prefix(f"f{i:03d}.bin")
            return same

        expected = [a.tobytes() for a in _buffers(args.files, args.mib)]
        return run_all(__file__, args, endpoint, bucket, "one request each", read_back, expected)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
