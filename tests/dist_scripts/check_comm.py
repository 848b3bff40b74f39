"""torchrun script for tests/test_publisher_threads.py: the side group's collectives with objects that fit the
fixed-size buffers and objects that do not (a status or an error message can be long), checked on every rank."""
from __future__ import annotations

import os
import sys
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fsdp_hotload.engine.comm import _INLINE, GlooComm  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = GlooComm.create()
    for round_ in range(3):
        # round 0: everything small; round 1: the last rank's status is too big; round 2: every status is.
        big = (round_ == 1 and rank == world - 1) or round_ == 2
        status = {"rank": rank, "round": round_, "pad": bytes([rank % 251]) * (_INLINE * 3 + rank if big else rank)}
        got = comm.gather(status)
        if rank == 0:
            assert got is not None and len(got) == world, got
            for r, s in enumerate(got):
                want_big = (round_ == 1 and r == world - 1) or round_ == 2
                assert s == {"rank": r, "round": round_,
                             "pad": bytes([r % 251]) * (_INLINE * 3 + r if want_big else r)}, (round_, r)
        else:
            assert got is None
        outcome = {"round": round_, "error": "x" * (_INLINE + 1000 * round_) if round_ else None}
        seen = comm.broadcast(outcome if rank == 0 else None)
        assert seen == outcome, (rank, round_)
        blobs: list[Any] = [bytes([rank, dst]) * (1000 * round_ + dst) for dst in range(world)]
        if round_ % 2:  # writable buffers, as the publisher sends them (shared with the send, not copied)
            blobs = [memoryview(bytearray(b)) for b in blobs]
        incoming = comm.exchange(blobs)
        assert [bytes(b) for b in incoming] == [bytes([src, rank]) * (1000 * round_ + rank) for src in range(world)], \
            (rank, round_)
        assert comm.allreduce_max_async(rank * round_)() == (world - 1) * round_
    dist.barrier()
    if rank == 0:
        print(f"comm ok on {world} ranks")
    dist.destroy_process_group()
    finish()


if __name__ == "__main__":
    main()
