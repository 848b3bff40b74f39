"""What does a retention pass cost with a long delta chain? GETs and seconds per pass, with and without the
publisher's cache of commit markers it has read.

Retention (``keep_last``) keeps the newest full snapshot's whole delta chain, so with ``full_every=1000`` the bucket
holds up to a thousand committed snapshots, and a pass read every one's marker on each publish: a GET each, on the
retention thread. This commits a chain of ``--chain`` snapshots (a marker and a small shard each) under a local root
whose every GET is made longer by ``--get-ms`` (an object store's round trip), then times ``--passes`` passes, each
after one more delta is committed, as a publisher runs them. The baseline, in the same run, is the pass that reads
every marker (no cache). Printed: GETs and median seconds per pass, and their ratios.

    python benchmarks/retention_markers.py [--chain 300] [--get-ms 20] [--passes 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_float, arg_int  # noqa: E402  (the repository root is on sys.path)

SESSION = "a1b2c3d4"


def run(cached: bool, chain: int, get_s: float, passes: int) -> tuple[float, float]:
    """(median GETs, median seconds) per pass."""
    from fsdp_hotload.markers import MarkerCache
    from fsdp_hotload.retention import CommitInfo, apply_retention, write_commit_marker
    from fsdp_hotload.storage import Storage

    real = Storage.get_bytes

    def slow_get(self: Storage, relpath: str, size_hint: int | None = None) -> bytes:
        time.sleep(get_s)
        return real(self, relpath, size_hint)

    def commit(st: Storage, step: int) -> str:
        name = f"step-{step:06d}-{SESSION}"
        parent = None if step == 0 else f"step-{step - 1:06d}-{SESSION}"
        st.put_bytes(f"{name}/model-00001-of-00001.safetensors", b"xx")
        write_commit_marker(st, CommitInfo(name, "delta" if parent else "full", parent,
                                           {"model-00001-of-00001.safetensors": {"size": 2}}, t0 + step))
        return name

    t0 = time.time()
    markers = MarkerCache(SESSION) if cached else None
    gets, seconds = [], []
    Storage.get_bytes = slow_get  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as d:
            st = Storage(d)
            for step in range(chain):
                commit(st, step)
            apply_retention(st, 2, {f"step-{chain - 1:06d}-{SESSION}"}, session=SESSION, since=t0,
                            markers=markers)  # the first pass reads every marker, cache or not
            for step in range(chain, chain + passes):
                served = commit(st, step)
                before = st.stats.snapshot()["gets"]
                t = time.perf_counter()
                deleted = apply_retention(st, 2, {served}, session=SESSION, since=t0, markers=markers)
                seconds.append(time.perf_counter() - t)
                gets.append(st.stats.snapshot()["gets"] - before)
                if deleted:
                    raise SystemExit(f"a delta chain lost snapshots: {deleted}")
    finally:
        Storage.get_bytes = real  # type: ignore[method-assign]
    return statistics.median(gets), statistics.median(seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chain", type=arg_int(1), default=300,
                   help="committed snapshots in the chain (one full, then deltas)")
    p.add_argument("--get-ms", type=arg_float(0), default=20.0, help="extra milliseconds per GET")
    p.add_argument("--passes", type=arg_int(1), default=5, help="passes measured, each after one more delta")
    args = p.parse_args()
    from benchmarks.machine_info import machine

    print(f"machine: {machine()}")
    print(f"a chain of {args.chain} snapshots, {args.get_ms:g} ms per GET, 8 marker reads at a time")
    print("| marker cache | GETs per pass | pass, median s |")
    print("|---|---|---|")
    figures = {}
    for cached in (False, True):
        figures[cached] = run(cached, args.chain, args.get_ms / 1e3, args.passes)
        print(f"| {'on' if cached else 'off'} | {figures[cached][0]:g} | {figures[cached][1]:.3f} |")
    print(f"ratio GETs per pass with the cache / without: {figures[True][0] / figures[False][0]:.3f}")
    print(f"ratio pass seconds with the cache / without: {figures[True][1] / figures[False][1]:.3f}")


if __name__ == "__main__":
    main()
