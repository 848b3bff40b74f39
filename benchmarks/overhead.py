"""Trainer overhead and end-to-end latency of publishing every step, measured against a run without publishing.

Starts the in-process hot-load emulator (2 replicas that really download, rebuild and verify every snapshot) on
a local-folder bucket, then launches ``benchmarks/overhead_job.py`` under
``python -m torch.distributed.run --standalone --nproc-per-node 2`` (gloo, CPU, OMP_NUM_THREADS=1): one FSDP2
job that trains a small HF-named transformer (bf16 compute over fp32 master weights, fused AdamW lr 1e-5) on
synthetic tokens, in interleaved phases of each variant:

* ``baseline``: no callback;
* ``skip``: ``HotloadCallback`` publishing every step, ``busy_policy="skip"`` (the default);
* ``wait``: the same with ``busy_policy="wait"`` (every step is published, the trainer waits for a slot);
* ``skip_nosignal``: ``skip`` without signalling, to separate the emulator's own CPU use (it shares the
  machine here; a real fleet does not) from the trainer's;
* ``skip_everyK`` (opt-in with ``--variants``): ``skip`` with ``publish_every=K``.

Publishing variants run from the optimizer hooks (``cb.attach(opt)``: the CPU copy of the shard overlaps the
next forward/backward, and the next ``optimizer.step()`` waits for it); ``--hook step`` calls ``cb.step()``
after ``optimizer.step()`` instead (a synchronous copy).

Then prints one table: step time (median, p90, ratio to baseline, and the geometric mean of the per-round
ratios of mean step times, i.e. of throughput, with its 95% confidence interval), CPU per step by thread role,
hook blocking against a bare bf16 copy of the local shard, publishes completed/skipped, end-to-end latency (hook
to all replicas ready), bytes written against a full snapshot per publish, staging memory against the bf16
shard, and whether each target is met. The step-time verdict is MET or MISSED only when the whole confidence
interval says so, else INCONCLUSIVE: on a shared 2-core VM single rounds move by several points, and a verdict
from one round would be a coin toss. Each phase's first steps (``--discard``) are not counted, and the publish
they started is waited for before the counted steps begin (it is a delta across the other variants' steps).

Example::

    .venv/bin/python benchmarks/overhead.py --quick          # < 90 s
    .venv/bin/python benchmarks/overhead.py                  # a few minutes; the numbers in RESULTS.md
    .venv/bin/python benchmarks/overhead.py --variants baseline,skip,skip_every4 --json out.json
    .venv/bin/python benchmarks/overhead.py --quick --layers 2 --poll 0.2   # unknown flags go to the job
    .venv/bin/python benchmarks/overhead.py --variants baseline,skip_nosignal --lr 1e-6 --hook step
    .venv/bin/python benchmarks/overhead.py --variants baseline,skip_nosignal --lr 1e-6 --batch 4 --seq 256
    .venv/bin/python benchmarks/overhead.py --from-json out.json            # the report again, from a saved run
    .venv/bin/python benchmarks/overhead.py --quick --profile-dir prof/    # cProfile (CPU time) of publishes
    python benchmarks/overhead.py --device cuda --nproc 1 --variants baseline,skip_nosignal --lr 1e-6 \
        --dim 2048 --hidden 5632 --layers 8 --vocab 32000 --batch 8 --seq 512   # a GPU trainer, one GPU per rank

Why the CPU columns: on 2 shared cores the step-time ratio mixes the publisher's own cost with the emulator's
and with other processes'; charging each step its core-seconds says which one moved it.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fsdp_hotload.emulator import HotLoadEmulator  # noqa: E402

JOB = Path(__file__).resolve().with_name("overhead_job.py")
API_KEY = "bench-key"
TARGET_STEP_OVERHEAD = 0.03
TARGET_BLOCKING_X = 1.5
TARGET_MEMORY_X = 2.0


# ------------------------------------------------------------------------------------------------ statistics
def pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (more: the value for 30, conservative).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-round step-time ratios and its 95% confidence interval (t-interval on the logs).

    Why per round: each round runs every variant back to back, so a round's ratio cancels the slow drifts of a
    shared VM that make single steps noisy; the spread between rounds is what the verdict must beat."""
    logs = [math.log(r) for r in ratios if r > 0]
    if not logs:
        return float("nan"), float("nan"), float("nan")
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(m), float("nan"), float("nan")
    half = _T975[min(len(logs) - 1, len(_T975)) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def verdict(lo: float, hi: float, limit: float) -> str:
    """MET when the whole interval is within the limit, MISSED when all of it is over, else INCONCLUSIVE."""
    if hi == hi and hi <= limit:
        return "MET"
    if lo == lo and lo > limit:
        return "MISSED"
    return "INCONCLUSIVE (more rounds)"


def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have run so far (from /proc/stat; NaN where unavailable)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """Samples this process's CPU seconds (the emulator's replicas live here) and the whole machine's, so steps
    can be charged for the emulator and for whatever else runs on the machine at the same time."""

    def __init__(self, period_s: float = 0.05) -> None:
        super().__init__(name="cpu-sampler", daemon=True)
        self.period_s = period_s
        self.samples: list[tuple[float, float, float]] = []
        self._stop_event = threading.Event()

    def _sample(self) -> None:
        self.samples.append((time.time(), time.process_time(), machine_busy_s()))

    def run(self) -> None:
        while not self._stop_event.is_set():
            self._sample()
            self._stop_event.wait(self.period_s)

    def stop(self) -> list[tuple[float, float, float]]:
        self._stop_event.set()
        self.join()
        self._sample()
        return self.samples


def cpu_between(samples: list[Any], a: float, b: float, col: int = 1) -> float:
    """CPU seconds (sample column ``col``) spent between wall times a and b, interpolated between samples."""
    if len(samples) < 2 or len(samples[0]) <= col:
        return float("nan")
    ws, cs = [x[0] for x in samples], [x[col] for x in samples]

    def at(t: float) -> float:
        i = min(max(bisect.bisect_right(ws, t), 1), len(ws) - 1)
        w0, w1, c0, c1 = ws[i - 1], ws[i], cs[i - 1], cs[i]
        return c0 if w1 == w0 else c0 + (c1 - c0) * min(max((t - w0) / (w1 - w0), 0.0), 1.0)

    return at(b) - at(a)


def _timed(rec: dict[str, Any], discard: int) -> bool:
    """A counted step: a timed round's, after the phase's first ``discard`` steps and its first publish (which the
    job waits for: a delta across the other variants' steps). Runs saved before the job recorded ``counted``
    counted every step from ``discard`` on."""
    return rec["round"] >= 0 and rec.get("counted", rec["i"] >= discard)


def _publishing_stats(res: dict[str, Any], v: str, discard: int) -> dict[str, Any]:
    """Hook time, publish counts, latency, bytes and memory of one publishing variant."""
    ranks = res["ranks"]
    variants = [x.strip() for x in res["args"]["variants"].split(",") if x.strip()]
    row: dict[str, Any] = {}
    timed = [x for x in ranks[0]["records"] if x["variant"] == v and x["round"] >= 0]
    # A phase ends with detach(), which waits for the last copy with no training step to hide it behind.
    last = max((x["i"] for x in timed), default=-1)
    phase_end = {x["step"] for x in timed if x["i"] == last}

    def staged_step(x: dict[str, Any]) -> bool:
        """A counted step that staged a snapshot, not a phase's last: the steps both the hook figures and
        PublishMetrics.blocking_ms are taken over (a phase's last copy is waited for by detach(), no step)."""
        return x["variant"] == v and _timed(x, discard) and x["started"] and x["step"] not in phase_end

    # hook time: per rank, on the steps where a snapshot was staged and on all steps
    # A background copy (attach) is waited for at the next optimizer step: that fence belongs to this publish,
    # and the fence in this step's own record (the previous copy's) does not.
    staged = [[x["hook_s"] - x["parts"].get("fence", 0.0)
               + (nxt["parts"].get("fence", 0.0) if nxt and nxt["variant"] == v else 0.0)
               for x, nxt in zip(r["records"], r["records"][1:] + [None]) if staged_step(x)]
              for r in ranks]
    all_steps = [[x["hook_s"] for x in r["records"] if x["variant"] == v and _timed(x, discard)] for r in ranks]
    row["hook_staged_med"] = max(med(s) for s in staged)
    row["hook_staged_p90"] = max(pct(s, 90) for s in staged)
    row["hook_all_med"] = max(med(s) for s in all_steps)
    # mean parts (means add up to the mean hook; the medians of skewed parts would not)
    row["parts_staged_mean"] = {
        k: max(statistics.fmean([(nxt["parts"].get(k, 0.0) if nxt and nxt["variant"] == v else 0.0)
                                 if k == "fence" else x["parts"].get(k, 0.0)
                                 for x, nxt in zip(r["records"], r["records"][1:] + [None])
                                 if staged_step(x)] or [float("nan")])
               for r in ranks)
        for k in ("sources", "busy", "acquire", "stage", "fence")}
    row["hook_staged_mean"] = max(statistics.fmean(s or [float("nan")]) for s in staged)
    row["started"] = sum(x["started"] for x in timed)
    every = int(v[len("skip_every"):]) if v.startswith("skip_every") else 1
    # due, but busy; over every timed step, each phase's uncounted first ones included (with --hook step the first
    # due step of a phase is skipped for want of an agreement, not because the publisher is busy)
    row["skipped"] = sum(not x["started"] for x in timed if x["step"] % every == 0)
    row["steps_total"] = len(timed)
    # Only publishes a timed step started: close() publishes a skipped last step after training has stopped.
    started_steps = {x["step"] for x in timed if x["started"]}
    ms = [m for m in res["metrics"][v] if m["step"] in started_steps]
    ok = [m for m in ms if m["ok"]]
    row["ok"], row["failed"] = len(ok), len(ms) - len(ok)
    row["errors"] = sorted({m["error"] for m in ms if not m["ok"]})[:3]
    # Bytes and latency from the publishes of counted steps only: a phase's first publish is a delta across the
    # other variants' steps (its callback's cache is a phase old), several times the size of a steady one.
    counted = [x for x in timed if _timed(x, discard)]
    steady = {x["step"] for x in counted if x["started"]}
    # Steps per publish over the counted steps, the ones the CPU and step-time figures come from: the phases'
    # uncounted first steps always publish, so counting them too would make a skipping variant look cheaper.
    started_counted = sum(x["started"] for x in counted)
    row["steps_per_publish"] = len(counted) / started_counted if started_counted else float("nan")
    ok = [m for m in ok if m["step"] in steady]
    row["ok_counted"] = len(ok)
    for kind in ("delta", "full"):
        ks = [m for m in ok if m["kind"] == kind]
        row[kind] = {"n": len(ks), "total_s": med([m["total_s"] for m in ks]),
                     "upload_s": med([m["upload_s"] for m in ks]), "ready_s": med([m["ready_s"] for m in ks]),
                     "encode_s": med([m["encode_s"] for m in ks]), "diff_s": med([m["diff_s"] for m in ks]),
                     "route_s": med([m["route_s"] for m in ks]), "signal_s": med([m["signal_s"] for m in ks]),
                     "bytes": med([m["bytes_written"] for m in ks]),
                     "changed": med([m["changed_fraction"] for m in ks if m["changed_fraction"] is not None])}
    row["total_s"] = med([m["total_s"] for m in ok])
    row["upload_s"] = med([m["upload_s"] for m in ok])
    row["ready_s"] = med([m["ready_s"] for m in ok])
    row["engine_blocking_ms"] = med([m["blocking_ms"] for m in ok if m["step"] not in phase_end])
    row["staleness"] = med([m["staleness_steps"] for m in ok])
    raw = ok[0]["raw_bytes"] if ok else 0
    row["raw_bytes"] = raw
    row["bytes_written"] = sum(m["bytes_written"] for m in ok)
    row["bytes_vs_full_each_publish"] = row["bytes_written"] / (raw * len(ok)) if ok and raw else float("nan")
    row["bytes_vs_full_each_step"] = (row["bytes_written"] / (raw * len(counted))) if counted and raw else \
        float("nan")
    row["stager"] = [r["stagers"][v] for r in ranks]
    base_rss = [med([x["rss"] for x in r["records"] if x["variant"] == "baseline" and _timed(x, discard)])
                for r in ranks]
    var_rss = [max([x["rss"] for x in r["records"] if x["variant"] == v and _timed(x, discard)], default=0)
               for r in ranks]
    row["rss_peak_over_base"] = max(b - a for a, b in zip(base_rss, var_rss)) if "baseline" in variants \
        else float("nan")
    return row


def analyse(res: dict[str, Any]) -> dict[str, Any]:
    """Turn the job's raw records into the numbers of the table (all times in seconds unless named _ms)."""
    discard = res["args"]["discard"]
    ranks = res["ranks"]
    variants = [v.strip() for v in res["args"]["variants"].split(",") if v.strip()]
    # Per step, the job's step time is the slowest rank's (the ranks are coupled by FSDP's collectives).
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        for rec in r["records"]:
            by_step.setdefault(rec["step"], []).append(rec)
    out: dict[str, Any] = {"variants": {}}
    base_rounds: dict[int, float] = {}
    for v in variants:
        steps = [recs for recs in by_step.values() if recs[0]["variant"] == v and _timed(recs[0], discard)]
        step_s = [max(x["step_s"] for x in recs) for recs in steps]
        per_round: dict[int, list[float]] = {}
        for recs in steps:
            per_round.setdefault(recs[0]["round"], []).append(max(x["step_s"] for x in recs))
        # Per-round means, not medians: the overhead is on throughput, and where a publish's cost lands on one
        # step in k, the median of a round's steps picks the larger group (a +10% cost on every 4th step read +2%).
        row: dict[str, Any] = {"n": len(step_s), "median": med(step_s), "p90": pct(step_s, 90),
                               "mean": statistics.fmean(step_s) if step_s else float("nan"),
                               "round_means": {k: statistics.fmean(x) for k, x in sorted(per_round.items())}}
        # CPU seconds per step: the job's processes (all threads) and the emulator (launcher process)
        job_cpu = [sum(x["cpu_s"] for x in recs) for recs in steps]
        row["job_cpu"] = statistics.fmean(job_cpu) if job_cpu else float("nan")
        roles = sorted({k for recs in steps for x in recs for k in x.get("threads", {})})
        row["thread_cpu"] = {k: statistics.fmean([sum(x.get("threads", {}).get(k, 0.0) for x in recs)
                                                  for recs in steps]) for k in roles} if steps else {}
        emu = res.get("emulator_cpu") or []
        emu_cpu = [cpu_between(emu, *recs[0]["wall"]) for recs in steps]
        row["emu_cpu"] = statistics.fmean(emu_cpu) if emu_cpu and emu else float("nan")
        all_cpu = [cpu_between(emu, *recs[0]["wall"], col=2) for recs in steps]
        row["machine_cpu"] = statistics.fmean(all_cpu) if all_cpu and emu else float("nan")
        if v == "baseline":
            base_rounds = row["round_means"]
        else:
            row.update(_publishing_stats(res, v, discard))
        out["variants"][v] = row
    base = out["variants"].get("baseline")
    for v, row in out["variants"].items():
        if v == "baseline" or base is None:
            continue
        row["ratio_median"] = row["median"] / base["median"]
        row["ratio_mean"] = row["mean"] / base["mean"]
        row["round_ratios"] = [row["round_means"][k] / base_rounds[k] for k in row["round_means"] if k in base_rounds]
        row["ratio_ci"] = ratio_ci(row["round_ratios"])
    copies = [r["copies"] for r in ranks if r["copies"]]
    if copies:
        out["copies"] = {k: max(c[k] for c in copies) for k in copies[0]}
        out["bf16_shard_bytes_per_rank"] = [c["bf16_shard_bytes"] for c in copies]
    return out


# ------------------------------------------------------------------------------------------------ report
def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _yes(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def report(res: dict[str, Any], a: dict[str, Any]) -> str:
    """The table as markdown-ish plain text (pasted as is into RESULTS.md)."""
    args, vs = res["args"], a["variants"]
    device = args.get("device", "cpu")  # the job records the device it trained on (runs before it: the CPU)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    lines = [f"model: {res['full_params'] / 1e6:.1f}M params ({args['layers']} layers, dim {args['dim']}, mlp "
             f"{args['hidden']}, vocab {args['vocab']}), batch {args['batch']}x{args['seq']} tokens/rank, "
             f"{res['world']} ranks FSDP2 ({backend}, {device}); {args['rounds']} rounds x {args['phase_steps']} "
             f"steps per variant (first {args['discard']} of each phase and a {args['warmup']}-step warm-up not "
             f"counted); emulator poll interval {args['poll']} s"]
    c = a.get("copies", {})
    shard = max(a.get("bf16_shard_bytes_per_rank", [0]))
    if c:
        lines.append(f"bf16 local shard: {shard / 1e6:.1f} MB/rank in {c['chunks']} chunks. Copies, publisher idle "
                     f"(max over ranks of the medians): bare bf16 copy empty_like(b).copy_(b) {_ms(c['bare_copy_s'])} "
                     f"ms; fp32->bf16 cast-copy into a new buffer {_ms(c['fresh_cast_s'])} ms, into a preallocated "
                     f"one {_ms(c['warm_cast_s'])} ms; Stager.stage {_ms(c['stage_idle_s'])} ms; local_chunks() "
                     f"walk {_ms(c['walk_s'])} ms; cached chunk views (storage fingerprint) {_ms(c['sources_s'])} ms")
    cores = res.get("cores") or 2
    lines += ["", "Step = forward + backward + optimizer (with its hooks) [+ cb.step()], slowest rank. CPU s/step = core-seconds per step "
              "of both ranks' processes (all threads), of the emulator (launcher process), and of every other "
              f"process on the machine (/proc/stat minus ours); cores busy = all of it / ({cores} cores x mean step).",
              "", "| variant | steps | median ms | p90 ms | ratio (median) | ratio (mean) | per-round ratios (mean) | "
              "overhead: per-round geomean [95% CI] | CPU s/step: job / emulator / others | cores busy |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for v, r in vs.items():
        rr = " ".join(f"{x:.2f}" for x in r.get("round_ratios", []))
        emu = r["emu_cpu"] if r["emu_cpu"] == r["emu_cpu"] else 0.0
        others = max(r["machine_cpu"] - r["job_cpu"] - emu, 0.0) if r["machine_cpu"] == r["machine_cpu"] else 0.0
        busy = (r["job_cpu"] + emu + others) / (cores * r["mean"])
        g, lo, hi = r.get("ratio_ci", (float("nan"),) * 3)
        ci = f"{g - 1:+.1%} [{lo - 1:+.1%}, {hi - 1:+.1%}]" if hi == hi else "-"
        lines.append(f"| {v} | {r['n']} | {_ms(r['median'])} | {_ms(r['p90'])} | "
                     f"{r.get('ratio_median', 1.0):.3f} | {r.get('ratio_mean', 1.0):.3f} | {rr or '-'} | {ci} | "
                     f"{r['job_cpu']:.3f} / {emu:.3f} / {others:.3f} | {busy:.0%} |")
    order = ["main", "publisher", "stage", "upload", "py-other", "gloo", "native-other", "exited", "native+exited"]
    present = {k for r in vs.values() for k in r.get("thread_cpu", {})}
    roles = [k for k in order if k in present] + sorted(present - set(order))
    if roles:
        lines += ["", "CPU ms per step by thread (both ranks; main = the training loop, publisher = the engine's "
                  "thread, stage = the copy helper, upload = the file writers, gloo = the native threads of the "
                  "training group and of the publisher's side groups, exited = threads that ended within the step, "
                  "mostly file writers; runs before 2026-11-22 afternoon lumped gloo and exited threads as "
                  "native+exited):", "", "| variant | " + " | ".join(roles) + " |",
                  "|---|" + "---|" * len(roles)]
        for v, r in vs.items():
            tc = r.get("thread_cpu", {})
            lines.append(f"| {v} | " + " | ".join(f"{1e3 * tc.get(k, 0.0):.1f}" for k in roles) + " |")
    pubs = [v for v in vs if v != "baseline"]
    if pubs:
        hook = ("the optimizer's post-step hook (attach), plus the pre-step wait for its background copy at "
                "the next step" if args.get("hook", "step") == "attach" else "cb.step()")
        lines += ["", f"Hook = trainer-thread time of a publish: {hook}, on the counted steps that staged a "
                  "snapshot, each phase's last left out (max over ranks). Its parts (means, so they add up to the "
                  "mean hook): chunk views (storage fingerprint; a model walk only when storage changed) / busy "
                  "check (the skip policy's async agreement, read on the main thread; absorbs rank skew) / waiting "
                  "for a free slot / Stager.stage (the copy, or handing it to the helper thread) / fence (waiting for "
                  "a background copy at the next optimizer step). PublishMetrics.blocking_ms is the engine's own "
                  "figure: the hook without attach's pre-step agreement, plus the fence, over the same steps (a "
                  "phase's last publish is left out of both: its fence is detach's wait, no training step's). "
                  "Ratios use the median hook and the idle copies above.",
                  "", "| variant | hook ms med / p90 / mean | parts ms (mean): views / busy / slot / stage / fence | "
                  "hook ms, "
                  "all steps (med) | PublishMetrics.blocking_ms (med) | hook / bare bf16 copy | hook / cast-copy | "
                  "stage (mean) / cast-copy | started / skipped, all timed steps | ok / failed | staleness (steps) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in pubs:
            r = vs[v]
            pm = r["parts_staged_mean"]
            x = r["hook_staged_med"] / c["bare_copy_s"] if c else float("nan")
            y = r["hook_staged_med"] / c["warm_cast_s"] if c else float("nan")
            z = pm["stage"] / c["warm_cast_s"] if c else float("nan")
            lines.append(f"| {v} | {_ms(r['hook_staged_med'])} / {_ms(r['hook_staged_p90'])} / "
                         f"{_ms(r['hook_staged_mean'])} | {_ms(pm['sources'])} / {_ms(pm['busy'])} / "
                         f"{_ms(pm['acquire'])} / {_ms(pm['stage'])} / {_ms(pm['fence'])} | "
                         f"{_ms(r['hook_all_med'])} | "
                         f"{r['engine_blocking_ms']:.1f} | {x:.1f}x | {y:.2f}x | {z:.2f}x | "
                         f"{r['started']} / {r['skipped']} | {r['ok']} / {r['failed']} | {r['staleness']:.0f} |")
        lines += ["", "End-to-end latency per publish (medians; PublishMetrics: stages are the max over ranks, "
                  "total = hook until every replica of the deployment serves the snapshot; on CPU the diff is fused into "
                  "the encode, so diff s is 0):",
                  "", "| variant | kind | n | total s | diff s | encode s | route s | upload s | signal s | ready s | "
                  "MB written | changed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for v in pubs:
            for kind in ("delta", "full"):
                k = vs[v][kind]
                if not k["n"]:
                    continue
                ch = f"{100 * k['changed']:.2f}%" if k["changed"] == k["changed"] else "-"
                lines.append(f"| {v} | {kind} | {k['n']} | {k['total_s']:.3f} | {k['diff_s']:.3f} | "
                             f"{k['encode_s']:.3f} | {k['route_s']:.3f} | {k['upload_s']:.3f} | {k['signal_s']:.3f} | "
                             f"{k['ready_s']:.3f} | {k['bytes'] / 1e6:.2f} | {ch} |")
        lines += ["", "Extra CPU per publish = (CPU/step - baseline CPU/step) x steps / publishes, both ranks + emulator. "
                  "Staging memory = Stager.nbytes x (max_inflight + 1) (the design: slots + cache; 'held' = buffers "
                  "the stager holds at the end). Transient RSS = peak RSS during the variant's steps over the "
                  "baseline median (staging buffers were allocated before, so this is the pipeline's temporaries).",
                  "", "| variant | total s / upload s / ready s (all ok publishes) | extra CPU s per publish: job + "
                  "emulator | bytes written / (full snapshot x publishes) | / (full snapshot x steps) | staging+cache "
                  "vs bf16 shard | transient RSS |", "|---|---|---|---|---|---|---|"]
        base_row = vs.get("baseline")
        for v in pubs:
            r = vs[v]
            mem = max(s["nbytes"] * (s["max_inflight"] + 1) for s in r["stager"])
            held = max(s["free"] + int(s["cache"]) for s in r["stager"])
            extra = "-"
            if base_row is not None and r["steps_per_publish"] == r["steps_per_publish"]:
                per = r["steps_per_publish"]
                emu = (r["emu_cpu"] - base_row["emu_cpu"]) if r["emu_cpu"] == r["emu_cpu"] else 0.0
                extra = f"{(r['job_cpu'] - base_row['job_cpu']) * per:.3f} + {emu * per:.3f}"
            lines.append(f"| {v} | {r['total_s']:.3f} / {r['upload_s']:.3f} / {r['ready_s']:.3f} | {extra} | "
                         f"{r['bytes_vs_full_each_publish']:.3f} ({r['bytes_written'] / 1e6:.1f} MB in "
                         f"{r['ok_counted']}, "
                         f"full = {r['raw_bytes'] / 1e6:.1f} MB) | {r['bytes_vs_full_each_step']:.3f} | "
                         f"{mem / shard:.3f}x ({mem / 1e6:.1f} MB/rank, held {held}) | "
                         f"{r['rss_peak_over_base'] / 1e6:.0f} MB |")
    every_step = [v for v in ("skip", "skip_nosignal") if v in vs]
    if every_step and c:
        lines += ["", "Targets (busy_policy=skip, publishing every step; skip_nosignal = the trainer's side alone). "
                  "The step-time verdict uses the 95% confidence interval of the per-round ratios of mean step "
                  "times: MET when all of it is within the target, MISSED when all of it is over, INCONCLUSIVE "
                  "otherwise:"]
        for v in every_step:
            r = vs[v]
            if "ratio_ci" not in r:  # every ratio needs the baseline's steps of the same run
                lines.append(f"- {v}: step-time overhead <= {TARGET_STEP_OVERHEAD:.0%}: not measured (no baseline "
                             "variant in this run)")
                continue
            g, lo, hi = r["ratio_ci"]
            if g != g:
                lines.append(f"- {v}: step-time overhead <= {TARGET_STEP_OVERHEAD:.0%}: not measured (no timed steps)")
                continue
            lines.append(f"- {v}: step-time overhead <= {TARGET_STEP_OVERHEAD:.0%}: {g - 1:+.1%} (95% CI "
                         f"{lo - 1:+.1%} to {hi - 1:+.1%}; median of steps {r['ratio_median'] - 1:+.1%}, mean "
                         f"{r['ratio_mean'] - 1:+.1%}) -> {verdict(lo, hi, 1 + TARGET_STEP_OVERHEAD)}")
            base = vs.get("baseline")
            if base is not None and g == g and r["steps_per_publish"] == r["steps_per_publish"]:
                # The cost is fixed per publish (it scales with parameters per rank, not tokens): this says how
                # long a step must be on this machine for that cost to fit the target when every step publishes.
                step = base["mean"]
                per = r["steps_per_publish"]  # 1 when every counted step published
                extra = (g - 1) * step
                span = f" ({1e3 * (lo - 1) * step:.0f} to {1e3 * (hi - 1) * step:.0f})" if hi == hi else ""
                need = f"{max(extra * per, 0.0) / TARGET_STEP_OVERHEAD:.2f} s"
                if hi == hi:
                    need += (f" (95% CI {max((lo - 1) * step * per, 0.0) / TARGET_STEP_OVERHEAD:.2f} to "
                             f"{max((hi - 1) * step * per, 0.0) / TARGET_STEP_OVERHEAD:.2f} s)")
                lines.append(f"  {v}: that is {1e3 * extra:.0f} ms per step{span} on a {1e3 * step:.0f} ms baseline "
                             f"step (mean), one publish per {per:.2f} counted steps; at that cost per "
                             f"publish, {TARGET_STEP_OVERHEAD:.0%} publishing every step needs steps of about "
                             f"{need} on this machine")
        r = vs[every_step[0]]
        blk = r["hook_staged_med"] / c["bare_copy_s"]
        mem = max(s["nbytes"] * (s["max_inflight"] + 1) for s in r["stager"]) / shard
        cast = r["hook_staged_med"] / c["warm_cast_s"]
        lines += [f"- {every_step[0]}: hook blocking <= {TARGET_BLOCKING_X}x a bare bf16 copy of the local shard: "
                  + (f"{blk:.2f}x -> {_yes(blk <= TARGET_BLOCKING_X)} (against the fp32->bf16 cast-copy that staging "
                     f"must do: {cast:.2f}x -> {_yes(cast <= TARGET_BLOCKING_X)})" if blk == blk else
                     "not measured (no timed step staged a snapshot)"),
                  f"- extra memory <= {TARGET_MEMORY_X:.0f}x the bf16 local shard: allocated by design, not measured "
                  f"here: Stager.nbytes (the shard, each chunk 8-byte aligned) x (max_inflight "
                  f"{r['stager'][0]['max_inflight']} + 1) = {mem:.4f}x -> {_yes(mem <= TARGET_MEMORY_X)} (what the "
                  "process holds, measured: benchmarks/full_memory.py)"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ launch
from benchmarks.bench_args import arg_int, arg_positive  # noqa: E402  (the repository root is on sys.path)
from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def main(argv: list[str] | None = None) -> int:
    from overhead_job import job_flags  # noqa: E402  (the flags it passes through, for --help)

    jp = argparse.ArgumentParser(prog="overhead.py", add_help=False)  # also checks them before the job starts
    job_flags(jp)
    job_help = jp.format_help().split("\n\n", 1)[1].replace("options:", "flags passed to the job "
                                                             "(here --warmup defaults to 5, quick 3):", 1)
    p = argparse.ArgumentParser(description=__doc__, epilog=job_help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer, shorter phases (< 90 s)")
    p.add_argument("--variants", help="comma list of baseline, skip, wait, skip_nosignal, skip_everyK "
                                      "(default: the first four; quick: baseline,skip,wait)")
    p.add_argument("--rounds", type=arg_int(1), help="interleaved rounds (default 6, quick 2)")
    p.add_argument("--phase-steps", type=arg_int(1), help="steps per variant per round (default 12, quick 6)")
    p.add_argument("--replicas", type=arg_int(1), default=2, help="emulator replicas per deployment")
    p.add_argument("--nproc", type=arg_int(1), default=2, help="trainer ranks (torchrun --nproc-per-node)")
    p.add_argument("--json", help="also write the raw results and the analysis here")
    p.add_argument("--timeout", type=arg_positive(), default=900.0, help="seconds before the job is killed")
    p.add_argument("--from-json", metavar="PATH", help="print the report of a run saved with --json, without "
                                                       "running anything (the analysis is recomputed)")
    args, job_extra = p.parse_known_args(argv)  # anything else (--dim, --layers, --poll ...) goes to the job
    jp.parse_known_args(job_extra)  # a job flag out of range is a usage error now, not a failed torchrun later
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())["raw"]
        print(f"(re-analysis of {args.from_json}; machine: {res.get('machine', 'not recorded')}; command: "
              f"{res.get('command', 'not recorded')})\n")
        print(report(res, analyse(res)))
        return 0
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 6)
    phase = args.phase_steps if args.phase_steps is not None else (6 if args.quick else 12)
    warmup = 3 if args.quick else 5
    variants = args.variants or ("baseline,skip,wait" if args.quick else "baseline,skip,wait,skip_nosignal")
    tmp = Path(tempfile.mkdtemp(prefix="hotload-overhead-"))
    try:
        bucket, hf, out = tmp / "bucket", tmp / "hf", tmp / "result.json"
        bucket.mkdir()
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps({"model_type": "bench", "architectures": ["BenchForCausalLM"]}))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR",
                   PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x))
        t0 = time.perf_counter()
        load_before = os.getloadavg()
        sampler = CpuSampler()
        sampler.start()
        with HotLoadEmulator(str(bucket), replicas=args.replicas, api_key=API_KEY) as emu:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(args.nproc), str(JOB), "--bucket", str(bucket), "--url", emu.url, "--api-key", API_KEY,
                   "--hf-dir", str(hf), "--out", str(out), "--variants", variants, "--rounds", str(rounds),
                   "--phase-steps", str(phase), "--warmup", str(warmup), *job_extra]
            proc = subprocess.run(cmd, cwd=str(REPO), env=env, timeout=args.timeout)
        samples = sampler.stop()
        if proc.returncode != 0:
            print(f"overhead job failed with exit code {proc.returncode}", file=sys.stderr)
            return proc.returncode
        res = json.loads(out.read_text())
        res["emulator_cpu"] = samples
        res["cores"] = os.cpu_count()
        res["machine"] = machine()
        res["command"] = " ".join(["benchmarks/overhead.py", *(argv if argv is not None else sys.argv[1:])])
        a = analyse(res)
        if args.json:  # first: a report that fails must not lose the run (--from-json re-analyses it)
            Path(args.json).write_text(json.dumps({"raw": res, "analysis": a}, indent=1, default=str))
        print(f"\nmachine: {res['machine']}")
        print(f"command: {res['command']}; "
              f"wall {time.perf_counter() - t0:.0f} s (training phases {res['train_s']:.0f} s); load average "
              f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after\n")
        print(report(res, a))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
