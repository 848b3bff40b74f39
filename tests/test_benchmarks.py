"""The benchmark scripts still run end to end, on sizes small enough for CI.

Their figures are not checked here (timings belong in ``benchmarks/RESULTS.md``, never in assertions). What is
checked is what a broken script would get wrong: the job publishes and the emulator's replicas accept every
snapshot, the report carries its target lines, every codec payload round-trips, every encode thread count
writes the same bytes, and the GPU script exits cleanly without a GPU.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_overhead_benchmark_publishes_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = _run([str(BENCH / "overhead.py"), "--variants", "baseline,wait,skip_nosignal", "--rounds", "1",
                 "--phase-steps", "4", "--layers", "1", "--dim", "64", "--hidden", "128", "--vocab", "256",
                 "--json", str(out)], 300)
    variants = json.loads(out.read_text())["analysis"]["variants"]
    assert set(variants) == {"baseline", "wait", "skip_nosignal"}
    wait = variants["wait"]
    # busy_policy="wait" publishes every timed step; each one was signalled and served by both replicas, which
    # verify what they load.
    assert wait["started"] == wait["steps_total"] >= 3 and wait["skipped"] == 0, wait
    assert wait["ok"] == wait["started"] and wait["failed"] == 0, wait["errors"]
    assert wait["bytes_written"] > 0 and wait["raw_bytes"] > 0
    assert variants["skip_nosignal"]["failed"] == 0, variants["skip_nosignal"]["errors"]
    assert "- skip_nosignal: step-time overhead <= 3%" in proc.stdout
    assert "3% publishing every step needs steps of about" in proc.stdout
    assert "extra memory <= 2x the bf16 local shard" in proc.stdout

    # Without the baseline variant there is no step-time ratio; the rest of the report (hook, latency, bytes,
    # memory) must still come out, not a KeyError after minutes of training. Re-analysed from this run (a job of
    # its own would add a torchrun start and exit to the suite for the same code path).
    saved = json.loads(out.read_text())
    raw = saved["raw"]
    raw["args"]["variants"] = "wait,skip_nosignal"
    raw["metrics"].pop("baseline", None)
    for rank in raw["ranks"]:
        rank["records"] = [r for r in rank["records"] if r["variant"] != "baseline"]
    without = tmp_path / "without_baseline.json"
    without.write_text(json.dumps(saved))
    proc = _run([str(BENCH / "overhead.py"), "--from-json", str(without)], 60)
    assert "step-time overhead <= 3%: not measured (no baseline variant in this run)" in proc.stdout
    assert "extra memory <= 2x the bf16 local shard" in proc.stdout


def test_codec_benchmark_round_trips_every_payload() -> None:
    # codec.py decodes every payload and raises if one differs from the trainer's bytes.
    proc = _run([str(BENCH / "codec.py"), "--quick", "--params", "200000", "--steps", "2", "--repeat", "1"], 300)
    assert "arc_v2: encode" in proc.stdout and "sparse·dense: ratio" in proc.stdout
    # the target lines say which rows they read (their min is not the table's) and what "met" asks of them
    heading = next(line for line in proc.stdout.splitlines() if line.startswith("Targets ("))
    assert heading in ("Targets (rows with 1-5% changed):", "Targets (every row: none has 1-5% changed):")
    assert proc.stdout.count("(the minimum must reach") == 2 and "(every row)" not in proc.stdout, proc.stdout


def test_codec_targets_heading_names_the_rows_the_targets_read() -> None:
    codec = _bench_module("codec")
    row = ("synthetic", 1e-6, 1)
    assert codec.targets_heading([(*row, {"changed": 0.02}), (*row, {"changed": 0.3})]) == \
        "Targets (rows with 1-5% changed):"
    assert codec.targets_heading([(*row, {"changed": 0.3})]) == "Targets (every row: none has 1-5% changed):"


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_encode_threads_benchmark_writes_the_same_bytes_on_every_thread_count(path: str) -> None:
    proc = _run([str(BENCH / "encode_threads.py"), "--gb", "0.02", "--tensors", "8", "--workers", "1,3",
                 "--repeat", "1", "--path", path], 300)
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().endswith("x")]
    assert [r[0] for r in rows] == ["1", "3"], proc.stdout  # it exits non-zero if 3 threads wrote other bytes


def test_full_memory_benchmark_reports_every_rank() -> None:
    proc = _run([str(BENCH / "full_memory.py"), "--gb", "0.02", "--nproc", "2"], 300)
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"], proc.stdout
    assert "kinds ['full', 'delta', 'full']" in proc.stdout
    # held memory is measured: at least the staging slot and the cache (2x the shard), each touched by then
    assert all(float(r[3]) >= 2.0 for r in rows), proc.stdout


def test_gpu_diff_benchmark_runs_or_says_why_not() -> None:
    proc = _run([str(BENCH / "gpu_diff.py"), "--gb", "0.05"], 300)
    assert "GB/s" in proc.stdout or "no CUDA device here" in proc.stdout


def test_overhead_analysis_charges_each_copy_wait_once_and_only_started_publishes() -> None:
    """A step's record holds the wait for the previous step's copy; the staged hook adds the next step's wait
    (its own copy) instead, so each wait is counted once. A publish close() makes after training is no step's."""
    sys.path.insert(0, str(BENCH))
    try:
        import overhead
    finally:
        sys.path.remove(str(BENCH))

    def rec(i: int) -> dict[str, object]:
        return {"variant": "wait", "round": 0, "i": i, "step": 10 + i, "hook_s": 0.201, "started": True,
                "parts": {"publish": 0.001, "fence": 0.2}, "rss": 0}

    def metric(step: int) -> dict[str, object]:
        return {"step": step, "ok": True, "kind": "delta", "error": None, "total_s": 1.0, "upload_s": 0.1,
                "ready_s": 0.1, "encode_s": 0.1, "diff_s": 0.0, "route_s": 0.0, "signal_s": 0.0,
                "bytes_written": 10, "raw_bytes": 100, "changed_fraction": 0.01,
                "blocking_ms": 200.0 if step == 13 else 1.0, "staleness_steps": 0}

    res = {"args": {"variants": "wait"}, "metrics": {"wait": [metric(s) for s in (10, 11, 12, 13)]},
           "ranks": [{"records": [rec(i) for i in range(4)], "stagers": {"wait": {}}}]}
    row = overhead._publishing_stats(res, "wait", discard=0)
    assert row["hook_staged_med"] == pytest.approx(0.201)  # was 0.401: both waits on every step
    assert row["ok"] == 4 and row["started"] == 4
    assert row["engine_blocking_ms"] == 1.0  # the phase's last publish carries detach's wait
    res["ranks"][0]["records"][3]["started"] = False  # step 13 published by close(), not by the step
    assert overhead._publishing_stats(res, "wait", discard=0)["ok"] == 3


def test_overhead_hook_and_engine_blocking_medians_cover_the_same_steps() -> None:
    """The hook median and PublishMetrics.blocking_ms's median sit side by side in the Hook table: both leave out
    each phase's uncounted first step and its last (whose copy detach() waits for), so where the engine's figure
    is the hook's they agree (the hook's median also read the last step: 20 ms against 15 ms)."""
    overhead = _bench_module("overhead")
    hooks = {10: 0.9, 11: 0.010, 12: 0.020, 13: 0.5}  # step 10 is the phase's first, 13 its last

    def rec(i: int) -> dict[str, object]:
        return {"variant": "wait", "round": 0, "i": i, "step": 10 + i, "hook_s": hooks[10 + i], "started": True,
                "parts": {}, "rss": 0}

    def metric(step: int) -> dict[str, object]:
        return {"step": step, "ok": True, "kind": "delta", "error": None, "total_s": 1.0, "upload_s": 0.1,
                "ready_s": 0.1, "encode_s": 0.1, "diff_s": 0.0, "route_s": 0.0, "signal_s": 0.0,
                "bytes_written": 10, "raw_bytes": 100, "changed_fraction": 0.01, "blocking_ms": 1e3 * hooks[step],
                "staleness_steps": 0}

    res = {"args": {"variants": "wait"}, "metrics": {"wait": [metric(s) for s in hooks]},
           "ranks": [{"records": [rec(i) for i in range(4)], "stagers": {"wait": {}}}]}
    row = overhead._publishing_stats(res, "wait", discard=1)
    assert row["engine_blocking_ms"] == pytest.approx(15.0)
    assert 1e3 * row["hook_staged_med"] == pytest.approx(row["engine_blocking_ms"])
    assert 1e3 * row["hook_staged_mean"] == pytest.approx(15.0)


def test_overhead_statistics_on_known_inputs() -> None:
    """The interval is a t-interval on the logs of the per-round ratios (df = rounds - 1); the verdict reads
    all of it; no interval from one round, and nothing from none."""
    overhead = _bench_module("overhead")
    g, lo, hi = overhead.ratio_ci([1.07, 1.00, 1.10, 1.31, 1.03, 0.99, 1.11, 1.10])
    assert (round(g, 4), round(lo, 4), round(hi, 4)) == (1.0849, 1.0079, 1.1679)
    g, lo, hi = overhead.ratio_ci([1.05, 1.05])
    assert g == pytest.approx(1.05) and lo == pytest.approx(1.05) and hi == pytest.approx(1.05)
    g, lo, hi = overhead.ratio_ci([1.2])
    assert g == pytest.approx(1.2) and lo != lo and hi != hi
    assert all(x != x for x in overhead.ratio_ci([]))
    assert overhead.verdict(1.01, 1.03, 1.03) == "MET"  # the interval may touch the target
    assert overhead.verdict(1.0301, 1.05, 1.03) == "MISSED"
    assert overhead.verdict(1.02, 1.04, 1.03).startswith("INCONCLUSIVE")
    assert overhead.verdict(float("nan"), float("nan"), 1.03).startswith("INCONCLUSIVE")


def test_overhead_ratio_follows_mean_step_time_where_every_fourth_step_pays() -> None:
    """Throughput is the mean step: a publish costing 40% of a step on every 4th step is +10%. The ratio of
    per-round medians read it as +0% (the median step is a step that did not pay), and a MET verdict."""
    overhead = _bench_module("overhead")

    def records(variant: str, rnd: int) -> list[dict[str, object]]:
        out = []
        for i in range(12):
            slow = variant == "skip_every4" and i % 4 == 0
            out.append({"variant": variant, "round": rnd, "i": i, "step": 100 * rnd + 50 * (variant != "baseline") + i,
                        "step_s": (1.4 if slow else 1.0) * (1 + 0.01 * rnd), "cpu_s": 0.0, "threads": {},
                        "wall": (0.0, 0.0), "hook_s": 0.0, "parts": {}, "started": slow, "rss": 0})
        return out

    ranks = [{"records": [r for rnd in range(4) for v in ("baseline", "skip_every4") for r in records(v, rnd)],
              "stagers": {"skip_every4": {}}, "copies": {}}]
    res = {"args": {"variants": "baseline,skip_every4", "discard": 0}, "ranks": ranks,
           "metrics": {"baseline": [], "skip_every4": []}}
    row = overhead.analyse(res)["variants"]["skip_every4"]
    g, lo, hi = row["ratio_ci"]
    assert g == pytest.approx(1.10) and lo == pytest.approx(1.10) and hi == pytest.approx(1.10)
    assert overhead.verdict(lo, hi, 1.03) == "MISSED"
    assert row["ratio_median"] == pytest.approx(1.0, abs=0.02)  # kept as a side figure


def _bench_module(name: str):  # type: ignore[no-untyped-def]
    """Import a benchmark script as a module (benchmarks/ is not a package; its scripts import each other)."""
    import importlib

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def test_encode_threads_leaves_the_warm_up_run_out_of_the_best_time(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The first encode of each thread count starts the threads and warms caches: it must not be the figure."""
    import time
    from types import SimpleNamespace

    encode_threads = _bench_module("encode_threads")

    class FirstCallFast:
        def __init__(self, chunks: object, st: object, codec: object, workers: int) -> None:
            self.calls = 0

        def encode(self, buf: object, kind: str, parts: object) -> object:
            self.calls += 1
            if self.calls > 1:  # every timed run takes 50 ms; only the warm-up is instant
                time.sleep(0.05)
            return SimpleNamespace(payloads=[b"x"], parts=[(0, 0)], changed=[1], diff_s=0.0)

        def close(self) -> None:
            pass

    monkeypatch.setattr(encode_threads, "ChunkEncoder", FirstCallFast)
    monkeypatch.setattr(sys, "argv", ["encode_threads.py", "--gb", "0.001", "--tensors", "2", "--workers", "1",
                                      "--repeat", "2"])
    assert encode_threads.main() == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().endswith("x")]
    assert [r[0] for r in rows] == ["1"]
    assert float(rows[0][1]) >= 0.045, rows  # the warm-up's ~0 s would be the best of the runs


def test_overhead_report_names_the_device_the_job_trained_on() -> None:
    overhead = _bench_module("overhead")
    args = {"layers": 1, "dim": 64, "hidden": 128, "vocab": 256, "batch": 2, "seq": 64, "rounds": 1,
            "phase_steps": 3, "discard": 1, "warmup": 3, "poll": 0.05}
    res = {"args": {**args, "device": "cuda:0"}, "full_params": 10**6, "world": 2}
    assert "2 ranks FSDP2 (nccl, cuda:0)" in overhead.report(res, {"variants": {}})
    res["args"] = args  # runs saved before the job recorded its device trained on the CPU
    assert "2 ranks FSDP2 (gloo, cpu)" in overhead.report(res, {"variants": {}})


def test_gpu_diff_times_the_host_share_after_a_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Adler-32 figure must not carry the first call's numba load or compile, as the frames' does not."""
    import time

    import numpy as np

    from fsdp_hotload.arc.adler import update_parts
    from fsdp_hotload.arc.codecs import ArcV2, element_diff

    gpu_diff = _bench_module("gpu_diff")
    calls = []

    def first_call_slow(*a: object) -> tuple[int, int]:
        calls.append(a)
        if len(calls) == 1:
            time.sleep(1.0)  # what loading or compiling the kernel costs on a fresh machine
        return update_parts(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu_diff, "update_parts", first_call_slow)
    parent = np.zeros(4096, np.uint8)
    new = parent.copy()
    new[::50] = 1
    diffs = [element_diff(parent, new, 2) for _ in range(2)]
    payload, encode_s, adler_s = gpu_diff.host_share(ArcV2(), diffs)
    assert payload > 0 and len(calls) == 3  # one warm-up call, then one per diff
    assert adler_s < 0.9, adler_s  # two ~microsecond calls: a margin for a loaded machine


def test_split_staging_benchmark_copies_runs_of_parts() -> None:
    proc = _run([str(BENCH / "split_staging.py"), "--layers", "2", "--experts", "8", "--inter", "4", "--hidden",
                 "8", "--reps", "2"], 120)
    assert "48 parts of 4 fused tensors" in proc.stdout and "staged in 4 copies" in proc.stdout, proc.stdout
    assert "one copy per chunk" in proc.stdout and "machine:" in proc.stdout
    proc = _run([str(BENCH / "split_staging.py"), "--layers", "2", "--experts", "8", "--inter", "4", "--hidden",
                 "8", "--reps", "2", "--transposed"], 120)
    assert "4 parts of 4 fused tensors" in proc.stdout and "Stager.stage" in proc.stdout, proc.stdout


def test_routing_exchange_benchmark_moves_the_payload_bit_exact() -> None:
    proc = _run([str(BENCH / "routing_exchange.py"), "--gib", "0.005"], 120)  # exits 1 where the bytes differ
    assert proc.stdout.count("bit-exact: True") == 2 and "errors: none" in proc.stdout, proc.stdout
    assert "ratio exchange_objects / bare" in proc.stdout and "machine:" in proc.stdout, proc.stdout


def test_tensor_count_benchmark_publishes_fulls_and_deltas_at_every_count() -> None:
    proc = _run([str(BENCH / "tensor_count.py"), "--counts", "300,600", "--steps", "3"], 120)
    assert "| 300 |" in proc.stdout and "| 600 |" in proc.stdout and "machine:" in proc.stdout, proc.stdout
    assert "cost per tensor at 600 over that at 300" in proc.stdout, proc.stdout


def test_replica_compare_benchmark_times_both_collectives_on_every_count() -> None:
    # each collective asserts that the copies agree, so a reduction that misread them fails the run
    proc = _run([str(BENCH / "replica_compare.py"), "--nproc", "2", "--counts", "100,300", "--repeats", "1"], 120)
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("2", "100"), ("2", "300")], proc.stdout
    assert "machine:" in proc.stdout, proc.stdout


def test_phase_orders_put_each_variant_after_every_other_equally_often() -> None:
    """A cyclic rotation of 4 variants put each one after the same variant in 5 of 6 rounds, so that whatever a
    phase leaves behind landed on one variant; the orders are now a Williams square."""
    from collections import Counter

    orders = _bench_module("overhead_job").balanced_orders
    for n in range(2, 7):
        rows = orders(n)
        assert all(sorted(row) == list(range(n)) for row in rows), rows
        pairs = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1, (n, pairs)
    assert orders(2) == [[0, 1], [1, 0]]  # two variants: the rotation of the runs in RESULTS.md


def test_routing_exchange_benchmark_fails_fast_when_a_rank_dies() -> None:
    """A rank that dies (here: a payload size it cannot allocate, about an exabyte; on a real run, the OOM killer at
    4 GiB) puts nothing in the results queue: the launcher must report it and exit non-zero, not wait an hour."""
    proc = subprocess.run([sys.executable, str(BENCH / "routing_exchange.py"), "--gib", "1e9"],
                          capture_output=True, text=True, timeout=90, cwd=BENCH.parent)
    assert proc.returncode != 0
    assert "rank" in proc.stderr and "exit" in proc.stderr, proc.stderr[-2000:]


def test_overhead_steps_per_publish_come_from_the_counted_steps() -> None:
    """The CPU and step-time figures are means over the counted steps; the steps per publish that turn them into a
    cost per publish must come from the same steps. A phase's uncounted steps (its first, and those up to its first
    publish, which the job waits for) always publish, so counting them made a skipping variant look cheaper."""
    overhead = _bench_module("overhead")

    def rec(i: int) -> dict[str, object]:  # a phase of 6: the first step publishes (uncounted), then every second
        return {"variant": "skip", "round": 0, "i": i, "step": i, "hook_s": 0.0, "parts": {}, "rss": 0,
                "started": i == 0 or i % 2 == 1, "counted": i >= 1}

    res = {"args": {"variants": "skip"}, "metrics": {"skip": []},
           "ranks": [{"records": [rec(i) for i in range(6)], "stagers": {"skip": {}}}]}
    row = overhead._publishing_stats(res, "skip", discard=1)
    assert row["steps_per_publish"] == pytest.approx(5 / 3)  # steps 1-5, publishes at 1, 3, 5 (was 6 / 4)

    # With publish_every=2 the first publish of a phase may come after the --discard steps: the job marks the
    # steps up to it uncounted, and the analysis follows that mark.
    recs = [rec(i) | {"counted": i >= 2} for i in range(6)]
    res["ranks"][0]["records"] = recs
    row = overhead._publishing_stats(res, "skip", discard=1)
    assert row["steps_per_publish"] == pytest.approx(4 / 2)



def test_benchmark_help_shows_the_whole_docstring_and_overhead_lists_the_job_flags() -> None:
    """``--help`` is where a reader looks for the examples; overhead.py's unknown flags go to the job, so its help
    lists them too, from the job's own parser."""
    scripts = [s for s in sorted(BENCH.glob("*.py")) if "ArgumentParser(" in s.read_text()]
    assert len(scripts) >= 9, scripts
    # one interpreter for all of them (each alone would import torch again)
    loop = ("import contextlib, io, runpy, sys\n"
            "for path in sys.argv[1:]:\n"
            "    sys.argv, buf = [path, '--help'], io.StringIO()\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(buf):\n"
            "        runpy.run_path(path, run_name='__main__')\n"
            "    print('=====', path, buf.getvalue(), sep='\\n')\n")
    out = _run(["-c", loop, *map(str, scripts)], 180).stdout
    helps = dict(part.split("\n", 1) for part in out.split("=====\n")[1:])
    assert len(helps) == len(scripts), list(helps)
    for script in scripts:
        doc = ast.get_docstring(ast.parse(script.read_text()), clean=False)
        assert doc, script.name
        last = [line.strip() for line in doc.splitlines() if line.strip()][-1]
        assert last in helps[str(script)], (script.name, last, helps[str(script)][-500:])
    job = helps[str(BENCH / "overhead.py")].split("flags passed to the job", 1)[1]
    for flag in ("--layers LAYERS", "--device {cpu,cuda}", "--hook {attach,step}", "--discard DISCARD", "--lr LR"):
        assert flag in job, flag


def test_retention_overlap_benchmark_reports_both_runs() -> None:
    """Both rows, each with the steps it published (how many is a figure: a publish that outlasts a 0.05 s step on a
    loaded machine skips the next one, with or without retention)."""
    proc = _run([str(BENCH / "retention_overlap.py"), "--steps", "8", "--ret-s", "0.3", "--step-s", "0.05"], 120)
    rows = re.findall(r"^\| (0|0\.3) \| ([1-8])/8 \|", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "0.3"] and "machine:" in proc.stdout, proc.stdout
    assert "ratio published with retention 0.3 s / baseline:" in proc.stdout, proc.stdout


def test_hint_latency_benchmark_reports_each_run() -> None:
    proc = _run([str(BENCH / "hint_latency.py"), "--layers", "4", "--workers", "2", "--deltas", "1",
                 "--hint-ms", "50", "--put-ms", "20"], 120)
    assert "| off | 0 |" in proc.stdout and "| on | 0 |" in proc.stdout and "| on | 50 |" in proc.stdout, proc.stdout
    assert "ratio hook to served with 50 ms hints / no hints:" in proc.stdout and "machine:" in proc.stdout


def test_s3_throttle_benchmark_writes_through_refused_parts_and_leaves_no_upload_open() -> None:
    pytest.importorskip("moto.server")
    proc = _run([str(BENCH / "s3_throttle.py"), "--parts", "2", "--trials", "1", "--rate", "0.5",
                 "--backoff-s", "0.01"], 180)
    assert re.search(r"^ baseline yes +[\d.]+ +2 +0 +2 +0 +0$", proc.stdout, re.M), proc.stdout
    assert "succeeded: 1/1; open uploads left: 0" in proc.stdout and "machine:" in proc.stdout, proc.stdout
    assert "part bodies sent per part of the object:" in proc.stdout, proc.stdout


def test_s3_small_puts_benchmark_reads_back_every_object_of_every_run() -> None:
    pytest.importorskip("moto.server")
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("the benchmark resets the peak resident memory through /proc/self/clear_refs")
    proc = _run([str(BENCH / "s3_small_puts.py"), "--files", "2", "--mib", "2", "--threads", "2"], 180)
    for run in ("copied", "views", "bytes"):
        assert re.search(rf"^ *{run} +\d+ +[\d.]+ +[\d.]+  byte-identical$", proc.stdout, re.M), proc.stdout
    assert "copied (baseline): peak" in proc.stdout and "machine:" in proc.stdout, proc.stdout


def test_retention_markers_benchmark_reads_each_marker_once() -> None:
    proc = _run([str(BENCH / "retention_markers.py"), "--chain", "20", "--get-ms", "1", "--passes", "2"], 120)
    # 21 then 22 markers; with the cache the new one, and the one before it again (keep_last=2)
    assert "| off | 21.5 |" in proc.stdout and "| on | 2 |" in proc.stdout, proc.stdout
    assert "ratio GETs per pass with the cache / without: 0.093" in proc.stdout and "machine:" in proc.stdout


def test_catch_up_benchmark_reports_a_deployment_that_catches_up() -> None:
    proc = _run([str(BENCH / "catch_up.py"), "--steps", "6", "--out-from", "1", "--out-to", "2", "--load-s", "0",
                 "--step-s", "0.3"], 120)
    rows = {line.split(" | ")[0]: line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| o")}
    assert set(rows) == {"| off", "| on"} and "machine:" in proc.stdout, proc.stdout
    assert rows["| off"][1] == "0 1 2 3 4 5" and rows["| on"][1].endswith("0 0"), proc.stdout  # behind from step 1
    assert int(rows["| on"][2]) < int(rows["| off"][2]), proc.stdout


def test_catch_up_benchmark_with_a_late_manager_and_hanging_loads() -> None:
    """--fault manager: pool-eu's manager is down for step 0, and it catches up from the full snapshot once up.
    --fault hang: its loads outlast ready_timeout_s for steps 1-3; the full snapshot of step 3 does not wait for it
    on the publisher's thread, so the readiness waits add up to less than the baseline's."""
    def table(steps: int, step_s: float, *args: str) -> dict[str, list[str]]:
        proc = _run([str(BENCH / "catch_up.py"), "--steps", str(steps), "--load-s", "0", "--step-s", str(step_s),
                     "--ready-timeout-s", "1", *args], 180)
        rows = {line.split(" | ")[0]: line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| o")}
        assert set(rows) == {"| off", "| on"}, proc.stdout
        return rows

    # The catch-up loads steps 0 and 1 within the step after the manager is back (0.5 s: it took 0.1 s on an idle
    # machine, more than that under load); the last step is read after two such steps.
    rows = table(3, 0.5, "--fault", "manager", "--out-from", "0", "--out-to", "0")
    on = [int(s) for s in rows["| on"][1].split()]
    assert rows["| off"][1] == "1 2 3" and on[0] == 1 and on[-1] == 0 and sum(on) < 6, rows
    rows = table(5, 0.1, "--fault", "hang", "--out-from", "1", "--out-to", "3", "--full-every", "3", "--hang-s", "30")
    assert float(rows["| on"][-1].rstrip(" |")) < float(rows["| off"][-1].rstrip(" |")) - 0.5, rows


def test_catch_up_benchmark_with_a_slow_region_and_straggler_wait_s() -> None:
    """pool-eu's loads take 1.5 s for steps 1-3 (within ready_timeout_s): the publishes wait for it, but with
    straggler_wait_s they leave its loads to its catch-up 0.2 s after pool-us serves, and it ends on the newest."""
    proc = _run([str(BENCH / "catch_up.py"), "--steps", "6", "--load-s", "0", "--step-s", "0.1", "--ready-timeout-s",
                 "5", "--fault", "hang", "--hang-s", "1.5", "--out-from", "1", "--out-to", "3",
                 "--straggler-wait-s", "0.2"], 180)
    rows = {line.split(" | ")[0]: line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| o")}
    assert set(rows) == {"| off", "| on", "| on, straggler_wait_s=0.2"}, proc.stdout
    cut = rows["| on, straggler_wait_s=0.2"]
    assert rows["| on"][1] == "0 0 0 0 0 0", rows  # waited for at each publish
    assert float(cut[-1].rstrip(" |")) < float(rows["| on"][-1].rstrip(" |")) - 2, rows  # ~0.4 s against ~4.5 s
    assert cut[1].split()[-1] == "0" and cut[5] == "6", rows  # on the newest at the end; each step loaded once
