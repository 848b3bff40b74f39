"""A set-up that fails on one rank fails every rank's ``HotloadCallback(...)``, at once and naming that rank.

Cases, each on an FSDP2 model over 2 ranks: a model still on the meta device (on every rank: the meta device's hint,
where the ranks' check of replicated values failed with "Cannot copy out of meta tensor"), rank 0 alone is given a
``metrics_path`` that is a folder (only rank 0 writes metrics), rank 0 alone an ``hf_config_dir`` without
``config.json`` (only rank 0 reads its files for the snapshots), and a ``rename`` that raises on rank 1 alone (each
rank walks its own model). Before, the failing rank raised alone and the others returned a callback, then waited in
the first publish's collective for the side group's timeout. Each rank writes what its construction raised, and how
long it took, to --out as JSON after every case (one file per rank); a final barrier shows the ranks still agree on
the collectives that follow.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.check_chunks import fsdp2  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--empty-dir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):  # not materialised yet (to_empty() and init come later)
        on_meta = torch.nn.Linear(4, 4)
    # sharded over a one-rank sub-mesh (expert parallelism's layout): each rank holds a whole replica, whose values
    # the ranks compare at construction
    fully_shard(on_meta, mesh=init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("ep", "edp"))["edp"])

    def rename_failing_on_rank1(name: str) -> str:
        if rank == 1:
            raise KeyError(f"no checkpoint name for {name!r} on this rank")
        return name

    base = dict(bucket_url=args.bucket, hf_config_dir=args.hf_dir, collective_timeout_s=120)
    cases: dict[str, tuple[dict[str, Any], Callable[[str], str] | None]] = {
        "meta": (base, None),
        "metrics": ({**base, "metrics_path": args.empty_dir if rank == 0 else None}, None),
        "hf_config_dir": ({**base, "hf_config_dir": args.empty_dir if rank == 0 else args.hf_dir}, None),
        "rename": (base, rename_failing_on_rank1),
    }
    results: dict[str, Any] = {}
    out = Path(args.out, f"rank{rank}.json")
    for label, (fields, rename) in cases.items():
        t0 = time.monotonic()
        try:
            HotloadCallback(on_meta if label == "meta" else model, HotloadConfig(**fields), rename=rename,
                            tie_word_embeddings=False).close()
            results[label] = ["ok", "", 0.0]
        except Exception as exc:  # noqa: BLE001 - recorded for the test to check
            results[label] = [type(exc).__name__, str(exc), time.monotonic() - t0]
        out.write_text(json.dumps(results))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
