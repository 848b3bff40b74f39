"""``HotloadCallback`` over 2 ranks whose ``bucket_url`` is, or is not, one place for every rank.

Cases: ``memory://`` (each process's own memory), a local path that resolves to each rank's own folder (a link to
``/proc/self/cwd``, each rank working in a folder of its own: the same ``bucket_url`` on every rank, as a local
path on each node's own disk is in a multi-node job), and a folder both ranks share. Each rank writes what its
construction raised, and how long it took, to --out/rank<r>.json; a final barrier shows the ranks still agree on
the collectives that follow.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.check_chunks import fsdp2  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shared", required=True, help="a folder both ranks see")
    p.add_argument("--per-rank", required=True, help="a link to /proc/self/cwd; rank r works in <it>/../node<r>")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = Path(args.per_rank).parent / f"node{rank}"
    node.mkdir(exist_ok=True)
    os.chdir(node)  # the link now leads this rank's process here, and only here
    model = fsdp2(dist.get_world_size(), hsdp=False)
    cases = {"memory": "memory://unshared-root/run", "per_rank": f"{args.per_rank}/run", "shared": args.shared}
    results: dict[str, Any] = {}
    out = Path(args.out, f"rank{rank}.json")
    for label, bucket in cases.items():
        t0 = time.monotonic()
        try:
            HotloadCallback(model, HotloadConfig(bucket_url=bucket, collective_timeout_s=120),
                            tie_word_embeddings=False).close()
            results[label] = ["ok", "", time.monotonic() - t0]
        except Exception as exc:  # noqa: BLE001 - recorded for the test to check
            results[label] = [type(exc).__name__, str(exc), time.monotonic() - t0]
        out.write_text(json.dumps(results))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
