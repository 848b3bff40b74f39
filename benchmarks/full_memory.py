"""Host memory a full snapshot takes per rank, beyond the staging buffer and the cache, against the rank's bf16 shard.

A full snapshot moves every rank's whole shard: into pieces, over the side group to each file's owner, into files.
Each copy on the way costs the shard's size again in host memory, for a GPU rank with a 10 GB shard 10 GB per
copy. This runs ``--nproc`` ranks (gloo, CPU) that publish a full snapshot, a delta and a full snapshot of 16
row-sharded tensors through the engine, and reports each rank's peak resident memory during the second full
snapshot over its resident memory just before it (the kernel's high-water mark, reset first), as a multiple of its
bf16 shard. Staging and cache are already resident then, so they are not counted there; they are in "held": the
resident memory the publisher keeps after the first full snapshot and a delta, over that before it was made.

    python benchmarks/full_memory.py [--gb 1] [--nproc 2]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_int, arg_positive  # noqa: E402  (the repository root is on sys.path)
TARGET_HELD_X = 2.0  # the design's buffers: the cache and one staging slot, each the size of the bf16 shard


def job(gb: float, workdir: Path) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_hotload import HotloadConfig
    from fsdp_hotload.arc import get_codec
    from fsdp_hotload.arc.boxes import Box
    from fsdp_hotload.engine.comm import GlooComm
    from fsdp_hotload.engine.publisher import Publisher
    from fsdp_hotload.layout import TensorSpec
    from fsdp_hotload.publish import WholeChunk

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n_tensors, rows = 16, 1024 * world
    cols = max(int(gb * 1e9 / 2 / n_tensors / rows), 1)
    specs = [TensorSpec(f"model.layers.{i}.mlp.up_proj.weight", (rows, cols), "BF16") for i in range(n_tensors)]
    per = rows // world
    sources = [torch.randn(per * cols) for _ in range(n_tensors)]
    chunks = [WholeChunk(s.name, s.shape, "BF16", "shape", Box((rank * per, 0), (per, cols)), t)
              for s, t in zip(specs, sources)]
    (workdir / "hf").mkdir(exist_ok=True)
    (workdir / "hf" / "config.json").write_text('{"model_type": "bench"}')
    cfg = HotloadConfig(bucket_url=str(workdir / "bucket"), hf_config_dir=str(workdir / "hf"), full_every=2,
                        busy_policy="wait")
    comm, ctrl = GlooComm(dist.new_group(backend="gloo")), GlooComm(dist.new_group(backend="gloo"))
    get_codec(cfg.codec).warm_up()  # compiled or loaded code is the process's, not the publisher's
    gc.collect()
    before = _resident()
    pub = Publisher(chunks, specs, cfg, comm=comm, ctrl=ctrl)

    def update(step: int) -> None:  # strided, in place: no temporaries the size of the shard
        for t in sources:
            t[step::50] += 1e-2

    for step in (0, 1):  # a full snapshot, then a delta: staging and cache are resident, the codec warm
        update(step)
        pub.publish(step)
        pub.wait()
    gc.collect()
    held = _resident() - before  # staging, cache, the publisher's threads and pools, kept between publishes
    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark to the current resident size
    base = _resident()
    update(2)
    pub.publish(2)
    pub.wait()
    peak = max(_high_water(), _resident())
    kinds = [m.kind for m in pub.metrics.records]
    pub.close()
    out = {"rank": rank, "shard": n_tensors * per * cols * 2, "transient": peak - base, "held": held, "kinds": kinds}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        (workdir / "result.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=arg_positive(), default=1.0, help="bf16 size of the whole model (GB)")
    p.add_argument("--nproc", type=arg_int(1), default=2)
    p.add_argument("--job", metavar="WORKDIR", help=argparse.SUPPRESS)  # the torchrun side
    args = p.parse_args()
    if args.job:
        job(args.gb, Path(args.job))
        sys.stdout.flush()  # then leave without C++ teardown: gloo's static destructors can abort a finished run
        sys.stderr.flush()
        os._exit(0)
    if not Path("/proc/self/clear_refs").exists():
        print("full_memory: needs Linux /proc (the peak resident memory); nothing measured")
        return 0
    from machine_info import machine

    with tempfile.TemporaryDirectory(prefix="hotload-fullmem-") as tmp:
        # Freed buffers go back to the kernel at once, so memory kept by the allocator from the first full
        # snapshot does not sit in the baseline and hide the second one's.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               __file__, "--gb", str(args.gb), "--job", tmp]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        ranks = json.loads(Path(tmp, "result.json").read_text())
    print(f"full snapshot, {args.nproc} rank(s), model {args.gb:g} GB bf16; kinds {ranks[0]['kinds']}")
    print(f"{'rank':>4} {'bf16 shard MB':>14} {'held MB':>8} {'x shard':>8} {'transient MB':>13} {'x shard':>8}")
    for r in ranks:
        print(f"{r['rank']:>4} {r['shard'] / 1e6:>14.1f} {r['held'] / 1e6:>8.1f} {r['held'] / r['shard']:>8.3f} "
              f"{r['transient'] / 1e6:>13.1f} {r['transient'] / r['shard']:>8.2f}")
    over = max(r["held"] - TARGET_HELD_X * r["shard"] for r in ranks)
    print(f"held = resident memory the publisher keeps between publishes (staging, cache, threads, pools), measured "
          f"after a full snapshot and a delta; the design's buffers are {TARGET_HELD_X:g}x the bf16 shard (one "
          f"staging slot + the cache), and the rest is at most {over / 1e6:+.1f} MB per rank. transient = peak "
          "during the next full snapshot over the resident memory before it")
    print(f"machine: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
