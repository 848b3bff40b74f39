"""The collective of the ranks' comparisons of their copies (``fsdp_recheck.RecheckReplicas``): one max-reduction
of a vector of 24 bytes per compared tensor, against the baseline it replaced, measured in the same run: every rank's
``{path: digest}`` dict gathered to rank 0, compared there, and the verdict broadcast.

Why: the baseline sends rank 0 a dict per rank, so what rank 0 receives and compares grows with ranks x tensors
(a reviewer's estimate: about 1.4 GB per comparison at 512 ranks and 40,000 plain tensors, once per full
snapshot's span); the reduction moves the same vector whatever the number of ranks. Each count builds a plain
module of that many 4x4 fp32 parameters (``tensor_count.build``, seeded alike on every rank), takes its digests
once, then times each collective (best of ``--repeats``, after a barrier) and one whole comparison
(``RecheckReplicas.run``: reading every copy, and the reduction). It prints what rank 0 receives per comparison
in each way, and the ratio of the times.

    python benchmarks/replica_compare.py [--nproc 2,4] [--counts 4000,40000] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_int, arg_int_list  # noqa: E402  (the repository root is on sys.path)


def best_of(repeats: int, fn: Callable[[], Any], barrier: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def job(counts: list[int], repeats: int, out: Path) -> None:
    import numpy as np
    import torch.distributed as dist

    from fsdp_hotload.engine.comm import GlooComm
    from fsdp_hotload.fsdp import storage_fingerprint
    from fsdp_hotload.fsdp_recheck import _TOP, RecheckReplicas
    from fsdp_hotload.fsdp_verify import Agreed, _plain_difference, plain_samples
    from tensor_count import build

    dist.init_process_group("gloo")
    comm = GlooComm.create()
    rank, world = comm.rank, comm.world
    rows = []
    for n in counts:
        model = build(n)
        plain = dict(model.named_parameters())
        digests = plain_samples(plain, whole=True)
        paths = sorted(digests)

        def gathered() -> None:  # the baseline: every rank's dict to rank 0, compared there, the verdict back
            got = comm.gather(digests)
            assert comm.broadcast(None if got is None else _plain_difference(got)) is None

        def reduced() -> None:  # one reduction of digests, complements and trains flags; every rank checks it
            mine = np.full(3 * n + 1, -1, dtype=np.int64)
            mine[:n] = [digests[p] for p in paths]
            mine[n:2 * n] = _TOP - mine[:n]
            mine[2 * n:3 * n] = 1
            top = comm.allreduce_max(mine)
            assert (top[:n] == _TOP - top[n:2 * n]).all() and top[-1] < 0

        recheck = RecheckReplicas(Agreed([], [], True, [], 0), [], plain, storage_fingerprint(model), comm, every=1)
        recheck.left = 0  # the later phase: every copy, each time

        def whole() -> None:
            assert recheck.run(model, {}, 0) is None

        rows.append({"n": n, "gather_s": best_of(repeats, gathered, dist.barrier),
                     "reduce_s": best_of(repeats, reduced, dist.barrier),
                     "run_s": best_of(repeats, whole, dist.barrier),
                     # rank 0 keeps its own dict: it receives the other ranks'; the reduction's is its vector's size
                     "gather_bytes": (world - 1) * len(pickle.dumps(digests)), "reduce_bytes": (3 * n + 1) * 8})
    if rank == 0:
        (out / f"world{world}.json").write_text(json.dumps(rows))
    dist.barrier()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=arg_int_list(1), default=[2, 4],
                   help="comma-separated rank counts, one torchrun each")
    p.add_argument("--counts", type=arg_int_list(1), default=[4000, 40000], help="comma-separated plain tensor counts")
    p.add_argument("--repeats", type=arg_int(1), default=5, help="timed runs of each collective")
    p.add_argument("--job", metavar="OUTDIR", help=argparse.SUPPRESS)  # the torchrun side
    args = p.parse_args()
    counts = args.counts
    if args.job:
        job(counts, args.repeats, Path(args.job))
        sys.stdout.flush()  # then leave without C++ teardown: gloo's static destructors can abort a finished run
        sys.stderr.flush()
        os._exit(0)
    from machine_info import machine

    print(f"{'ranks':>5} {'tensors':>8} {'gather s':>9} {'reduce s':>9} {'gather/reduce':>14} "
          f"{'rank 0 gets, gather':>20} {'reduce':>9} {'whole comparison s':>19}")
    with tempfile.TemporaryDirectory(prefix="hotload-compare-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=os.pathsep.join(x for x in (str(REPO), str(REPO / "benchmarks"),
                                                          os.environ.get("PYTHONPATH", "")) if x))
        for nproc in args.nproc:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   __file__, "--counts", ",".join(map(str, counts)), "--repeats", str(args.repeats), "--job", tmp]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            for r in json.loads(Path(tmp, f"world{nproc}.json").read_text()):
                print(f"{nproc:>5} {r['n']:>8} {r['gather_s']:>9.4f} {r['reduce_s']:>9.4f} "
                      f"{r['gather_s'] / r['reduce_s']:>14.2f} {r['gather_bytes'] / 1e6:>17.2f} MB "
                      f"{r['reduce_bytes'] / 1e6:>6.2f} MB {r['run_s']:>19.3f}")
    print(f"machine: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
