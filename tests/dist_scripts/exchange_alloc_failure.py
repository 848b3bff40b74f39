"""torchrun script for tests/test_engine_faults.py: one rank cannot allocate a receive buffer of the exchange.

Why: a full snapshot's pieces are a rank's whole shard, so the owner of the largest files allocates that much to
receive them, the same memory pressure under which pickling them fails (test_engine_faults covers that side). A
rank that raised there alone would leave the others in the exchange until the side group's timeout (an hour by
default), and break the group for the rest of the job. Every rank must instead return at once with an error, and
the next exchange must work, and each rank's error must name every rank that failed, with its own error only.
Writes one line per rank to ``--out``.<rank>: "ok" or what went wrong.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fsdp_hotload.engine.comm import GlooComm, exchange_objects  # noqa: E402
from tests.dist_util import finish  # noqa: E402

BIG = 1 << 20  # a receive buffer at least this big fails on each rank of --failing, once


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=6.0)
    p.add_argument("--failing", default="1", help="comma-separated ranks whose allocation fails")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = GlooComm.create(args.timeout)
    failing = [int(r) for r in args.failing.split(",")]
    if rank in failing:
        real, failed = torch.empty, []

        def empty(*a: object, **kw: object) -> torch.Tensor:
            # the receive buffers only (GlooComm.exchange's), not the one the sending side pickles into
            if a and isinstance(a[0], int) and a[0] >= BIG and not failed and \
                    sys._getframe(1).f_code.co_name == "exchange":
                failed.append(1)
                raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory on rank {rank} (injected)")
            return real(*a, **kw)  # type: ignore[arg-type]

        torch.empty = empty  # type: ignore[assignment]
    problems = []
    t0 = time.perf_counter()
    try:
        incoming, error = exchange_objects(comm, [[bytes([rank]) * (2 * BIG)] for _ in range(world)])
        took = time.perf_counter() - t0
        if took > args.timeout / 2:
            problems.append(f"the first exchange took {took:.1f} s")
        named = f"rank{'s' if len(failing) > 1 else ''} {', '.join(map(str, failing))} could not"
        quoted = [r for r in range(world) if f"on rank {r} " in (error or "")]  # the allocation errors it quotes
        if error is None or named not in error or quoted != ([rank] if rank in failing else []):
            problems.append(f"first exchange: error {error!r}")
        if incoming[rank] != [bytes([rank]) * (2 * BIG)]:
            problems.append("first exchange: own part lost")
        # the group is still usable: the next exchange moves everything
        incoming, error = exchange_objects(comm, [[bytes([rank, d])] for d in range(world)])
        if error is not None or incoming != [[bytes([s, rank])] for s in range(world)]:
            problems.append(f"second exchange: {error!r} {incoming!r}")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        problems.append(f"raised after {time.perf_counter() - t0:.1f} s: {exc!r}"[:300])
    Path(f"{args.out}.{rank}").write_text("; ".join(problems) or "ok")
    if problems:
        finish()  # the group may be broken: do not wait in destroy_process_group
    comm.close()
    dist.destroy_process_group()
    finish()


if __name__ == "__main__":
    main()
