"""Does a throttled store still take a large file? Multipart uploads to S3 while part requests get SlowDown.

An object store under load answers a share of requests with 503 SlowDown. A large shard goes up as a multipart
upload of many parts; if one refused part fails the whole object, each attempt of the object must get every part
through, and the odds of that fall with the number of parts (a 160-part shard at a 30% refusal rate: ~3e-7 per
attempt with botocore's two tries per part). This writes ``--parts`` parts of 5 MiB through ``Storage.put_bytes``
to a real moto S3 server on 127.0.0.1, behind a real HTTP proxy (``tests/s3_fault_proxy``) that answers each
UploadPart with SlowDown at ``--rate`` (seeded), ``--trials`` times. The baseline, in the same run, is the same
upload with no refusals.

Printed per trial: whether the write succeeded, its seconds, the UploadPart requests sent and refused, the parts the
store took (each a 5 MiB body sent), how often the object was started over (CreateMultipartUpload - 1), and the
multipart uploads left open. Then the success rate, the median time against the baseline's and the part bodies
sent per part of the object.

    python benchmarks/s3_throttle.py [--parts 16] [--rate 0.3] [--trials 5] [--attempts 6] [--backoff-s 0.2]
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_float, arg_fraction, arg_int  # noqa: E402  (the repository root is on sys.path)

MiB = 2**20
PART = 5 * MiB  # S3's smallest part: the most parts for the bytes sent
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@dataclass
class Trial:
    ok: bool
    seconds: float
    part_requests: int
    refused: int
    parts_taken: int
    restarts: int
    left_open: int
    error: str = ""


def trial(endpoint: str, bucket: str, proxy: object, data: bytes, rate: float, seed: int, attempts: int,
          backoff_s: float) -> Trial:
    """One ``put_bytes`` of ``data`` through ``proxy``, each UploadPart refused at ``rate`` (drawn from ``seed``)."""
    import botocore.session

    from fsdp_hotload.storage import Storage, StorageError

    draw = random.Random(seed)
    proxy.reset()  # type: ignore[attr-defined]
    proxy.rule = lambda req: "slowdown" if req.op == "UploadPart" and draw.random() < rate else None  # type: ignore
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    options = {"key": "bench", "secret": "bench", "endpoint_url": proxy.url,  # type: ignore[attr-defined]
               "client_kwargs": {"region_name": "us-east-1"}, "skip_instance_cache": True}
    # Every object above the threshold goes in 5 MiB parts (the part size is at least S3's 5 MiB minimum).
    st = Storage(f"s3://{bucket}/{prefix}", options, max_attempts=attempts, multipart_threshold=PART,
                 throttle_backoff_s=backoff_s, base_backoff_s=backoff_s / 5, rng=random.Random(seed))
    t0 = time.perf_counter()
    error = ""
    try:
        st.put_bytes("model-00001.safetensors", data)
    except StorageError as exc:
        error = str(exc).splitlines()[0][:160]
    seconds = time.perf_counter() - t0
    count = proxy.count  # type: ignore[attr-defined]
    client = botocore.session.get_session().create_client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                                           aws_access_key_id="bench", aws_secret_access_key="bench")
    left = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    return Trial(not error, seconds, count("UploadPart"), count("UploadPart", "slowdown"),
                 count("UploadPart", "forward"), max(0, count("CreateMultipartUpload") - 1), len(left), error)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", type=arg_int(2), default=16, help="5 MiB parts in the object (default 16: 80 MiB)")
    p.add_argument("--rate", type=arg_fraction(), default=0.3, help="share of UploadPart requests answered 503")
    p.add_argument("--trials", type=arg_int(1), default=5)
    p.add_argument("--attempts", type=arg_int(1), default=6, help="Storage's max_attempts (storage_attempts)")
    p.add_argument("--backoff-s", type=arg_float(0.0), default=0.2,
                   help="throttle_backoff_s (the plugin's default is 1.0; lower here to keep the run short)")
    p.add_argument("--seed", type=arg_int(0), default=0)
    args = p.parse_args(argv)
    os.environ.update(_CREDENTIALS)
    os.environ["NO_PROXY"] = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    logging.getLogger("fsdp_hotload").setLevel(logging.ERROR)  # each retry logs a warning
    import botocore.session
    from moto.server import ThreadedMotoServer

    from benchmarks.machine_info import machine
    from tests.s3_fault_proxy import S3FaultProxy

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint, bucket = f"http://{host}:{port}", f"bench-{uuid.uuid4().hex[:8]}"
        botocore.session.get_session().create_client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
            aws_secret_access_key="bench").create_bucket(Bucket=bucket)
        data = os.urandom(args.parts * PART)
        print(f"machine: {machine()}")
        print(f"object: {args.parts} parts of 5 MiB ({len(data) / MiB:.0f} MiB); UploadPart refused at "
              f"{args.rate:.0%}; {args.attempts} attempts; throttle backoff {args.backoff_s} s")
        with S3FaultProxy(endpoint) as proxy:
            base = trial(endpoint, bucket, proxy, data, 0.0, args.seed, args.attempts, args.backoff_s)
            if not base.ok:
                print(f"the baseline upload failed: {base.error}", file=sys.stderr)
                return 1
            print(f"{'run':>9} {'ok':>3} {'s':>7} {'part reqs':>9} {'refused':>7} {'taken':>5} {'restarts':>8} "
                  f"{'open':>4}")
            runs = []
            for i, t in enumerate([base] + [trial(endpoint, bucket, proxy, data, args.rate, args.seed + k,
                                                  args.attempts, args.backoff_s) for k in range(args.trials)]):
                label = "baseline" if i == 0 else f"trial {i}"
                print(f"{label:>9} {'yes' if t.ok else 'no':>3} {t.seconds:7.2f} {t.part_requests:9d} {t.refused:7d} "
                      f"{t.parts_taken:5d} {t.restarts:8d} {t.left_open:4d}" + (f"  {t.error}" if t.error else ""))
                if i:
                    runs.append(t)
    finally:
        server.stop()
    ok = [t for t in runs if t.ok]
    print(f"succeeded: {len(ok)}/{len(runs)}; open uploads left: {sum(t.left_open for t in runs)}")
    if ok:
        median = statistics.median(t.seconds for t in ok)
        print(f"median time of the writes that succeeded: {median:.2f} s, {median / base.seconds:.2f}x the "
              f"baseline's {base.seconds:.2f} s; part bodies sent per part of the object: "
              f"{statistics.mean(t.parts_taken for t in ok) / args.parts:.2f} (baseline "
              f"{base.parts_taken / args.parts:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
