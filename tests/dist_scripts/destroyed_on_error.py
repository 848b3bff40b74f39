"""After ``torch.distributed.destroy_process_group()``, closing on an exception or with ``raise_errors=False``:
the error that close() raises after it (the side groups went with the default group) replaced the body's own
exception, and close(raise_errors=False) raised it too. Each rank builds two callbacks, publishes step 0 and skips
step 1 on both (``publish_every=2``), destroys the process group, calls ``close(raise_errors=False)`` on the first,
then leaves a ``with`` block of the second on a KeyError; it writes how each ended to ``--out``/rank<r>.json.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.check_chunks import fsdp2  # noqa: E402
from tests.dist_util import start_rank  # noqa: E402


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    bucket, out, rank = start_rank()
    said = _Lines()
    logging.getLogger("fsdp_hotload").addHandler(said)
    model = fsdp2(dist.get_world_size(), hsdp=False)
    first, second = (HotloadCallback(model, HotloadConfig(bucket_url=f"{bucket}/{name}", busy_policy="wait",
                                                          publish_every=2)) for name in ("a", "b"))
    for step in range(2):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
        for cb in (first, second):
            cb.step(step)
            cb.wait()
    dist.destroy_process_group()
    got: dict[str, object] = {}
    try:
        first.close(raise_errors=False)
        got["close"] = "returned"
    except Exception as exc:  # noqa: BLE001 - what is tested
        got["close"] = f"{type(exc).__name__}: {exc}"
    try:
        with second:
            raise KeyError("the body's own error")
    except Exception as exc:  # noqa: BLE001 - what is tested
        got["with"] = f"{type(exc).__name__}: {exc}"
    got["warnings"] = said.lines
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main()
