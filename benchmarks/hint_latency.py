"""Does a slow hint endpoint slow the uploads? Hook-to-served time of delta snapshots with per-file hints.

Each file's hint is a POST to the hot-load API; across regions its round trip is tens to hundreds of milliseconds.
This publishes delta snapshots of a model with ``--layers`` files (one layer per file) through a TensorPublisher
with ``--workers`` upload workers, over a local bucket whose every file write is made longer by ``--put-ms``
(standing in for an object store's round trip), and signals an in-process emulator through a real HTTP proxy
(``tests/http_fixture.forwarding``) that holds each hint for ``--hint-ms``. Printed per run: the median
hook-to-served seconds and the median upload seconds. The baseline, in the same run, sends no hints. Where hints
share the upload workers, each file costs a put plus a hint; where they run beside the uploads, a file costs the
longer of the two.

    python benchmarks/hint_latency.py [--hint-ms 200] [--put-ms 200] [--layers 16] [--workers 4] [--deltas 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_float, arg_int  # noqa: E402  (the repository root is on sys.path)

API_KEY = "bench-key"


def run(hints: bool, hint_s: float, put_s: float, layers: int, workers: int, deltas: int) -> tuple[float, float]:
    """Median (hook-to-served s, upload s) over ``deltas`` delta snapshots."""
    from fsdp_hotload.config import HotloadConfig
    from fsdp_hotload.emulator import HotLoadEmulator
    from fsdp_hotload.publish import TensorPublisher
    from fsdp_hotload.storage import Storage
    from tests.http_fixture import forwarding

    real = Storage.put_bytes

    def slow_put(self: Storage, relpath: str, data: bytes | bytearray | memoryview) -> None:
        if relpath.endswith(".safetensors"):
            time.sleep(put_s)
        real(self, relpath, data)

    Storage.put_bytes = slow_put  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    model = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(128, 128, generator=g) for i in range(layers)}
    try:
        with tempfile.TemporaryDirectory() as d, HotLoadEmulator(f"{d}/bucket", replicas=1, api_key=API_KEY) as emu, \
                forwarding(emu.url, lambda body: time.sleep(hint_s)) as url:
            (Path(d) / "hf").mkdir()
            (Path(d) / "hf" / "config.json").write_text('{"model_type": "llama"}')
            (Path(d) / "hf" / "tokenizer.json").write_text("{}")
            cfg = HotloadConfig(bucket_url=f"{d}/bucket", hf_config_dir=f"{d}/hf", hotload_api_url=url,
                                account_id="a", model_id="m", deployment_id="dep", api_key=API_KEY,
                                poll_interval_s=0.01, send_hints=hints, upload_concurrency=workers,
                                busy_policy="wait", full_every=deltas + 1, progress_log_s=None)
            with TensorPublisher(model, cfg) as pub:
                for step in range(deltas + 1):  # a full, then the deltas measured
                    for t in model.values():
                        t[step % 128].add_(1.0)
                    pub.publish(step, model)
                    pub.wait()
            measured = [m for m in pub.metrics if m.kind == "delta" and m.ok]
            if len(measured) != deltas:
                got = [(m.kind, m.ok, m.error) for m in pub.metrics]
                raise SystemExit(f"expected {deltas} served deltas, got {got}")
    finally:
        Storage.put_bytes = real  # type: ignore[method-assign]
    return statistics.median(m.total_s for m in measured), statistics.median(m.upload_s for m in measured)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hint-ms", type=arg_float(0), default=200.0, help="milliseconds the API takes to answer a hint")
    p.add_argument("--put-ms", type=arg_float(0), default=200.0, help="extra milliseconds per file written")
    p.add_argument("--layers", type=arg_int(1), default=16, help="files per snapshot (one layer each)")
    p.add_argument("--workers", type=arg_int(1), default=4, help="upload_concurrency")
    p.add_argument("--deltas", type=arg_int(1), default=4, help="delta snapshots measured per run")
    args = p.parse_args()
    from benchmarks.machine_info import machine

    print(f"machine: {machine()}")
    print(f"{args.layers} files, {args.workers} upload workers, {args.put_ms:g} ms per file write")
    print("| hints | hint ms | hook to served, median s | upload, median s |")
    print("|---|---|---|---|")
    figures = {}
    for hints, hint_ms in ((False, 0.0), (True, 0.0), (True, args.hint_ms)):
        total, upload = run(hints, hint_ms / 1e3, args.put_ms / 1e3, args.layers, args.workers, args.deltas)
        figures[(hints, hint_ms)] = total
        print(f"| {'on' if hints else 'off'} | {hint_ms:g} | {total:.3f} | {upload:.3f} |")
    print(f"ratio hook to served with {args.hint_ms:g} ms hints / no hints: "
          f"{figures[(True, args.hint_ms)] / figures[(False, 0.0)]:.2f}")


if __name__ == "__main__":
    main()
