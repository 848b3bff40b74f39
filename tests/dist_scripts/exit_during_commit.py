"""A trainer that ends while rank 0's commit is writing the snapshot's small files, and that write hangs (a stuck
mount, a store that never answers). Run as a plain process (one rank): ``close()`` gives up after its timeout, or
``--no-close`` returns from main without it; either way the process must then exit, dropping the snapshot.

Prints "returning from main" just before main returns; the test measures how long the process takes after that.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadConfig  # noqa: E402
from fsdp_hotload.publish import TensorPublisher  # noqa: E402
from fsdp_hotload.storage import Storage  # noqa: E402


class HangingIndex:
    """An in-memory store whose writes of the snapshot's index never return."""

    def __init__(self) -> None:
        self.inner = fsspec.filesystem("memory")
        self.stuck = threading.Event()

    def _hang_on(self, path: str) -> None:
        if str(path).endswith("model.safetensors.index.json"):
            self.stuck.set()
            threading.Event().wait()  # for good

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode:
            self._hang_on(path)
        return self.inner.open(path, mode, *args, **kwargs)

    def pipe_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._hang_on(path)
        return self.inner.pipe_file(path, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-close", action="store_true")
    args = parser.parse_args()
    fs = HangingIndex()
    model = {"model.embed_tokens.weight": torch.randn(16, 8), "model.norm.weight": torch.ones(8)}
    bucket = "memory://exit-during-commit/run"
    pub = TensorPublisher(model, HotloadConfig(bucket_url=bucket, close_timeout_s=1.0),
                          storage=Storage(bucket, fs=fs))
    pub.publish(0, model)
    if not fs.stuck.wait(60):
        raise SystemExit("the index write was never reached")
    if not args.no_close:
        try:
            pub.close()
        except Exception as exc:  # noqa: BLE001 - the timeout it reports is expected
            print(f"close raised {type(exc).__name__}", flush=True)
    print(f"returning from main at {time.monotonic():.3f}", flush=True)


if __name__ == "__main__":
    main()
