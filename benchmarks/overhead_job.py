"""The torchrun side of ``benchmarks/overhead.py``: one FSDP2 job that trains with and without publishing.

Why one job for every variant: step times on a shared 2-core machine drift (other processes, page cache, the
other rank), so a baseline measured in another process would make the ratios meaningless. Here the variants run as
interleaved phases of the same process, each phase ``--phase-steps`` steps, in a rotated order every round, and
every publishing variant keeps one long-lived ``HotloadCallback`` (its own deployment in the emulator), so the
cadence (a full snapshot every ``full_every`` publishes, deltas in between) is the real one. At the end of a
phase the callback's in-flight snapshot is waited for outside the timed region, so no background work spills
into the next phase.

Rank 0 writes everything measured to ``--out`` as JSON; ``benchmarks/overhead.py`` turns it into the table.
Run it through ``benchmarks/overhead.py``, which starts the emulator and torchrun.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from fsdp_hotload.demo import CausalLM  # noqa: E402
from fsdp_hotload.fsdp import local_chunks  # noqa: E402

from benchmarks.bench_args import arg_int, arg_positive  # noqa: E402  (the repository root is on sys.path)

PUBLISHING = ("skip", "wait", "skip_nosignal", "skip_everyK")
_VARIANT = re.compile(r"^(baseline|skip|wait|skip_nosignal|skip_every([1-9][0-9]*))$")


def build_model(args: argparse.Namespace) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = CausalLM(args.vocab, args.dim, args.hidden, args.heads, args.layers).to(args.device)
    # bf16 compute and gradient reduction over fp32 master weights, as RL trainers run; keeping the
    # parameters gathered between forward and backward halves gloo's (slow, loopback) all-gather traffic.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    # named: without a mesh, fully_shard picks CUDA wherever torch sees a GPU
    mesh = init_device_mesh(args.device.split(":")[0], (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


# ------------------------------------------------------------------------------------------------ helpers
def balanced_orders(n: int) -> list[list[int]]:
    """Phase orders for the rounds: a Williams square, in which each variant follows every other one equally often
    (over n rounds for even n, 2n for odd). Why: a phase may leave work behind (page-cache writeback, allocator
    state) that slows the next; a cyclic rotation of 4 variants puts each one after the same variant in 5 of 6
    rounds, so that carry-over lands on one variant. With 2 variants it is the rotation: [[0, 1], [1, 0]]."""
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


class PublisherProfile:
    """cProfile of every publish (``Publisher._run``) from now on, timed by the running thread's CPU clock.

    Why CPU time: a publish spends most of its wall time waiting for the other rank or for upload threads; what
    the trainer pays for is the CPU the publisher burns beside it."""

    def __init__(self) -> None:
        import cProfile

        from fsdp_hotload.engine.publisher import Publisher

        self.prof = cProfile.Profile(time.thread_time)  # one publish runs at a time (phases end with cb.wait())
        self.publishes = 0
        orig = Publisher._run
        prof = self

        def run(pub: Any, job: Any) -> Any:
            prof.publishes += 1
            prof.prof.enable()
            try:
                return orig(pub, job)
            finally:
                prof.prof.disable()

        Publisher._run = run  # type: ignore[method-assign,assignment]

    def save(self, folder: Path, rank: int) -> None:
        import io
        import pstats

        folder.mkdir(parents=True, exist_ok=True)
        self.prof.dump_stats(str(folder / f"publisher-rank{rank}.pstats"))
        text = io.StringIO()
        stats = pstats.Stats(self.prof, stream=text)
        text.write(f"rank {rank}: {self.publishes} publishes, publisher-thread CPU s in total (cProfile adds its "
                   "own overhead)\n")
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
        (folder / f"publisher-rank{rank}.txt").write_text(text.getvalue())


def thread_cpu() -> dict[int, tuple[str, float]]:
    """Role and CPU seconds so far of each live thread, by native id. Roles: ``main`` (the trainer),
    ``publisher``, ``stage`` (the copy helper), ``upload`` (the publisher's file writers), ``py-other``, ``gloo``
    (the native threads of every gloo group: the trainer's and the publisher's side groups) and ``native-other``.
    A step's share of a thread is its CPU now minus its CPU at the step's start; threads that exited within the
    step are what the process used beyond the live ones."""
    out: dict[int, tuple[str, float]] = {}
    main = threading.main_thread()
    for th in threading.enumerate():
        try:
            used = time.clock_gettime(time.pthread_getcpuclockid(th.ident))  # type: ignore[arg-type]
        except (OSError, TypeError, AttributeError):
            continue
        role = ("main" if th is main else "publisher" if th.name.startswith("hotload-publisher")
                else "stage" if th.name.startswith("hotload-stage")
                else "upload" if th.name.startswith(("hotload-upload", "hotload-storage")) else "py-other")
        out[th.native_id] = (role, used)  # type: ignore[index]
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        if int(tid) in out:
            continue
        try:  # schedstat: nanoseconds on CPU (the tick-based stat file is too coarse for one step)
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                used = int(f.read().split()[0]) / 1e9
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[int(tid)] = ("gloo" if "gloo" in comm else "native-other", used)
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def sync() -> None:
    """Wait for the training stream's work (CUDA), so that a time covers the work and not only its launch. Only
    that stream: the publisher's own stream (its diff, its host copies) is not the trainer's time."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def timed_median(fn: Any, reps: int) -> float:
    """Median seconds of ``fn()``, both ranks starting each repetition together (as staging does)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class HookProbe:
    """Splits the trainer-thread time of one callback into parts by wrapping a few methods of its own objects.

    Only instance attributes are replaced (the classes are untouched) and each wrapper adds two clock reads, so
    the hook does exactly the work it does unobserved. ``publish`` is the whole hook (``cb.step`` or the
    optimizer post-step hook); its parts: ``sources`` (chunk views: a storage fingerprint, or a walk of the
    model when storage changed), ``busy`` (the skip policy's cross-rank busy check, which also absorbs the
    ranks' skew), ``acquire`` (waiting for a free slot: the whole wait of ``busy_policy="wait"``), ``stage``
    (the copy, or handing it to the helper thread). ``fence`` is the wait for a background copy at the next
    optimizer step (``attach``), outside the hook but also on the trainer's thread; ``agree`` is the start of
    the busy check in ``attach``'s pre-step hook (counted only there, not when ``publish`` calls it).
    """

    PARTS = ("publish", "sources", "busy", "acquire", "stage", "fence", "agree")

    def __init__(self, cb: HotloadCallback) -> None:
        eng = cb.engine
        self.t: dict[str, float] = {}
        self.started = False
        self.in_publish = False
        for part, obj, attr in (("publish", cb, "_publish"), ("sources", cb, "_sources"),
                                ("busy", eng.ctrl, "allreduce_max_async"), ("acquire", eng.stager, "acquire"),
                                ("stage", eng.stager, "stage"), ("fence", cb, "fence"), ("agree", eng, "agree")):
            setattr(obj, attr, self._wrap(part, getattr(obj, attr)))
        self.take()

    def _wrap(self, part: str, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            if part == "agree" and self.in_publish:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            self.in_publish = self.in_publish or part == "publish"
            try:
                out = fn(*a, **kw)
            finally:
                self.t[part] += time.perf_counter() - t0
                if part == "publish":
                    self.in_publish = False
            if part == "publish":
                self.started = self.started or bool(out)
            # The async busy check returns a function read at the next publish step: time that read too.
            return self._wrap(part, out) if part == "busy" and callable(out) else out
        return timed

    def take(self) -> tuple[dict[str, float], bool]:
        out, self.t = self.t, {p: 0.0 for p in self.PARTS}
        started, self.started = self.started, False
        return out, started


def bare_copies(model: nn.Module, cb: HotloadCallback, reps: int) -> dict[str, float]:
    """What staging fundamentally costs on this rank, timed the same way as the hook (seconds, median)."""
    srcs = [c.source.detach() for c in local_chunks(model)]
    with torch.no_grad():
        pre = [s.to(torch.bfloat16) for s in srcs]
        warm = [torch.empty_like(p) for p in pre]

        def fresh_copy() -> None:  # the reference the targets use: a new bf16 buffer, copy the bf16 shard
            for p in pre:
                torch.empty_like(p).copy_(p)

        def fresh_cast() -> None:  # a new bf16 buffer filled from the fp32 shard (cast included)
            for s in srcs:
                torch.empty(s.shape, dtype=torch.bfloat16, device=s.device).copy_(s)

        def warm_cast() -> None:  # into a preallocated buffer: the floor for staging's cast-copy
            for w, s in zip(warm, srcs):
                w.copy_(s)

        stager = cb.engine.stager
        buf = stager.acquire(wait=True)  # every publisher is idle now: this is the engine's copy, uncontended
        try:
            sources = cb._sources()
            stage_idle = timed_median(lambda: stager.stage(buf, sources), reps)
        finally:
            stager.release(buf)
        return {"bare_copy_s": timed_median(fresh_copy, reps), "fresh_cast_s": timed_median(fresh_cast, reps),
                "warm_cast_s": timed_median(warm_cast, reps), "stage_idle_s": stage_idle,
                "walk_s": timed_median(lambda: local_chunks(model), reps),  # what the hook did before caching
                "sources_s": timed_median(cb._sources, reps),  # what it does now: a storage fingerprint
                "bf16_shard_bytes": sum(p.numel() * 2 for p in pre), "chunks": len(pre)}


# ------------------------------------------------------------------------------------------------ main
def job_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``benchmarks/overhead.py`` passes through unchanged: its ``--help`` lists them from here."""
    p.add_argument("--discard", type=arg_int(0), default=1, help="first steps of every phase not counted")
    p.add_argument("--warmup", type=arg_int(0), default=6, help="untimed steps per variant before round 0")
    p.add_argument("--copy-reps", type=arg_int(1), default=25,
                   help="timed bare bf16 copies of the shard (the baseline)")
    p.add_argument("--vocab", type=arg_int(1), default=8192, help="model: vocabulary size")
    p.add_argument("--dim", type=arg_int(1), default=512, help="model: hidden size")
    p.add_argument("--hidden", type=arg_int(1), default=1536, help="model: MLP intermediate size")
    p.add_argument("--heads", type=arg_int(1), default=8, help="model: attention heads")
    p.add_argument("--layers", type=arg_int(1), default=4, help="model: decoder layers")
    p.add_argument("--batch", type=arg_int(1), default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=arg_int(1), default=64, help="tokens per sequence")
    p.add_argument("--poll", type=arg_positive(), default=0.05, help="HotloadConfig.poll_interval_s")
    p.add_argument("--lr", type=arg_positive(), default=1e-5, help="AdamW learning rate (RL runs use ~1e-6)")
    p.add_argument("--nice", type=arg_int(0, 19), default=None,
                   help="HotloadConfig.background_nice (default: the config's)")
    p.add_argument("--switch-interval", type=arg_positive(), default=None,
                   help="sys.setswitchinterval for the job (seconds; default: Python's 0.005)")
    p.add_argument("--hook", choices=["attach", "step"], default="attach",
                   help="publish from the optimizer hooks (async CPU copy) or call cb.step() after optimizer.step()")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="train on the CPU (gloo) or on one GPU per rank (nccl; step times then wait for the GPU)")
    p.add_argument("--profile-dir", default=None,
                   help="write a cProfile of each rank's publisher thread (CPU time, timed rounds only) here")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default="baseline,skip,wait,skip_nosignal")
    p.add_argument("--rounds", type=arg_int(1), default=6)
    p.add_argument("--phase-steps", type=arg_int(1), default=12)
    job_flags(p)
    args = p.parse_args()

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        args.device = f"cuda:{torch.cuda.current_device()}"
    dist.init_process_group("cpu:gloo,cuda:nccl" if args.device.startswith("cuda") else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)  # fused: 5x faster than foreach on CPU
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
               for _ in range(8)]

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if not _VARIANT.match(v)]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: baseline, {', '.join(PUBLISHING)}")
    callbacks: dict[str, HotloadCallback] = {}
    for v in variants:
        if v == "baseline":
            continue
        signal = v != "skip_nosignal"
        every = _VARIANT.match(v).group(2)  # type: ignore[union-attr]
        cfg = HotloadConfig(bucket_url=args.bucket, hf_config_dir=args.hf_dir, identity_prefix=v,
                            busy_policy="wait" if v == "wait" else "skip", publish_every=int(every or 1),
                            hotload_api_url=args.url if signal else None, account_id="bench" if signal else None,
                            model_id="bench" if signal else None, deployment_id=f"dep-{v}" if signal else None,
                            api_key=args.api_key if signal else None,
                            poll_interval_s=args.poll, ready_timeout_s=120,
                            **({} if args.nice is None else {"background_nice": args.nice}))
        callbacks[v] = HotloadCallback(model, cfg)
    probes = {v: HookProbe(cb) for v, cb in callbacks.items()}

    records: list[dict[str, Any]] = []
    step = 0

    def run_phase(variant: str, n: int, rnd: int) -> None:
        nonlocal step
        cb = callbacks.get(variant)
        if cb is not None and args.hook == "attach":
            cb.attach(opt, first_step=step)
        # The phase's first publish is a delta across the other variants' steps (this callback's cache is a phase
        # old): it is waited for, and the steps up to the one that started it are not counted, so that its extra
        # work lands on none of them. With publish_every=K it need not start in the first --discard steps.
        settled = cb is None
        for i in range(n):
            ids = batches[step % len(batches)]
            th0 = thread_cpu()
            w0, c0 = time.time(), time.process_time()
            t0 = time.perf_counter()
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()  # with attach: the fence (pre-step hook) and the publish (post-step hook) run in here
            opt.zero_grad(set_to_none=True)
            if cb is not None and args.hook == "step":
                cb.step(step)
            sync()  # a GPU step ends when its kernels do
            t2 = time.perf_counter()
            cpu_s = time.process_time() - c0
            th1 = thread_cpu()
            threads: dict[str, float] = {}
            for tid, (role, used) in th1.items():
                threads[role] = threads.get(role, 0.0) + used - th0.get(tid, (role, 0.0))[1]
            threads["exited"] = max(cpu_s - sum(threads.values()), 0.0)
            parts, started = probes[variant].take() if cb is not None else ({}, False)
            hook_s = parts.get("publish", 0.0) + parts.get("fence", 0.0) + parts.get("agree", 0.0)
            records.append({"variant": variant, "round": rnd, "i": i, "step": step, "step_s": t2 - t0,
                            "hook_s": hook_s, "started": started, "counted": settled and i >= args.discard,
                            "parts": parts, "rss": rss_bytes(), "cpu_s": cpu_s, "threads": threads,
                            "wall": (w0, time.time())})
            step += 1
            if cb is not None and (i == args.discard - 1 or (started and not settled)):
                cb.wait()
                settled = settled or started
        if cb is not None:
            cb.detach()  # no-op without attach
            cb.wait()  # outside the timed steps: the next phase starts with an idle publisher
            probes[variant].take()  # detach's fence is not a step's: the next phase's first step starts clean

    t_start = time.perf_counter()
    for v in variants:  # warm-up: allocator, first full snapshots, numba JIT (compiled on first use)
        run_phase(v, args.warmup, -1)
    profiler = PublisherProfile() if args.profile_dir else None
    orders = balanced_orders(len(variants))
    for rnd in range(args.rounds):
        order = [variants[k] for k in orders[rnd % len(orders)]]
        for v in order:
            run_phase(v, args.phase_steps, rnd)
    t_train = time.perf_counter() - t_start

    if profiler is not None:
        profiler.save(Path(args.profile_dir), rank)
    any_cb = next(iter(callbacks.values()), None)
    copies = bare_copies(model, any_cb, args.copy_reps) if any_cb is not None else {}
    stagers = {v: {"nbytes": cb.engine.stager.nbytes, "max_inflight": cb.config.max_inflight,
                   "free": cb.engine.stager.free_slots(), "cache": cb.engine.stager.cache is not None}
               for v, cb in callbacks.items()}
    for cb in callbacks.values():
        cb.close()

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "records": records, "copies": copies, "stagers": stagers})
    if rank == 0:
        out = {"args": vars(args), "world": world, "train_s": t_train, "ranks": gathered,
               "metrics": {v: [asdict(m) for m in cb.metrics] for v, cb in callbacks.items()},
               "full_params": sum(int(torch.Size(p.shape).numel()) for p in model.parameters()),
               "torch": torch.__version__}
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without C++ teardown, as the demo does: gloo can abort in its static destructors after all the work
    # is done ("terminate called without an active exception"), which failed a finished run (seen once in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
