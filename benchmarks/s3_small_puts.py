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
import sys
import uuid
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.put_memory import MiB, add_arguments, measure, run_all  # noqa: E402  (the root is on sys.path)

_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def _buffers(files: int, mib: int) -> list:
    """The files' contents (numpy uint8 arrays), the same in every process."""
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, mib * MiB, dtype=np.uint8) for _ in range(files)]


def child(run: str, endpoint: str, bucket: str, files: int, mib: int, threads: int) -> dict[str, float | str]:
    """One run in this (fresh) process: the puts, measured; what it measured, and the prefix it wrote under."""
    from fsdp_hotload.storage import Storage

    prefix = f"bench-{run}-{uuid.uuid4().hex[:8]}"
    options = {"key": "bench", "secret": "bench", "endpoint_url": endpoint,
               "client_kwargs": {"region_name": "us-east-1"}}
    st = Storage(f"s3://{bucket}/{prefix}", options, max_concurrency=threads)
    st.exists("warm-up")  # the client, its session and a connection exist before the measurement
    return {"prefix": prefix, **measure(st, _buffers(files, mib), run, threads)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    os.environ.update(_CREDENTIALS)
    os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    if args.child:
        print(json.dumps(child(args.child, args.endpoint, args.bucket, args.files, args.mib, args.threads)))
        return 0
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import botocore.session
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint, bucket = f"http://{host}:{port}", f"bench-{uuid.uuid4().hex[:8]}"
        client = botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
            aws_secret_access_key="bench")
        client.create_bucket(Bucket=bucket)

        def read_back(prefix: str, expected: Sequence[bytes]) -> bool:
            keys = [f"{prefix}/f{i:03d}.bin" for i in range(len(expected))]
            same = all(client.get_object(Bucket=bucket, Key=k)["Body"].read() == e for k, e in zip(keys, expected))
            client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys]})  # moto's memory
            return same

        expected = [a.tobytes() for a in _buffers(args.files, args.mib)]
        return run_all(__file__, args, endpoint, bucket, "one PutObject each", read_back, expected)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
