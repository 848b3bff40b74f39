"""A ``HotloadCallback`` dropped without ``close()`` (a notebook cell run again) frees its side groups.

Its engine's finalizer ended its threads, but its gloo groups stayed in torch's registry, with gloo's threads
and a socket per peer each, for the rest of the process: more of them with every callback dropped. Each rank
drops three callbacks, then closes a fourth, and writes its open socket counts to ``--out``/rank<r>.json; a final
barrier shows the default group still works. It also writes, for each group destroyed by a drop, whether the
engine's own finalizer (which tells its threads to stop) had run by then: finalizers of one object run newest
first, so the groups were destroyed before it.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import weakref
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from fsdp_hotload.engine.comm import GlooComm  # noqa: E402
from tests.dist_scripts.check_chunks import fsdp2  # noqa: E402
from tests.dist_util import finish, start_rank  # noqa: E402


def sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # closed meanwhile
    return n


def main() -> None:
    bucket, out, rank = start_rank()
    dropping: list[weakref.finalize] = []  # the finalizer of the engine being dropped
    stopped_first: list[bool] = []
    close = GlooComm.close

    def recording_close(self: GlooComm) -> None:
        if dropping:
            stopped_first.append(not dropping[0].alive)
        close(self)

    GlooComm.close = recording_close  # type: ignore[method-assign]
    model = fsdp2(dist.get_world_size(), hsdp=False)
    counts, collected = [sockets()], []
    for step in range(3):
        cb = HotloadCallback(model, HotloadConfig(bucket_url=bucket, busy_policy="wait"))
        cb.step(step)
        cb.wait()
        engine = weakref.ref(cb.engine)
        dropping[:] = [cb.engine.drop_finalizer]
        del cb
        gc.collect()
        dropping.clear()
        time.sleep(0.3)  # gloo's threads close their sockets as they end
        collected.append(engine() is None)
        counts.append(sockets())
    cb = HotloadCallback(model, HotloadConfig(bucket_url=bucket, busy_policy="wait"))
    cb.step(10)
    cb.close()
    time.sleep(0.3)
    counts.append(sockets())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"sockets": counts, "collected": collected,
                                                         "stopped_first": stopped_first}))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
