"""Every benchmark script refuses an impossible argument as a usage error naming the flag, before any work.

A count of 0, a size of 0, a fraction of 1.5 or a negative time used to end in a traceback minutes into a run (a
division by zero, the median of no samples, a torchrun assertion) or in figures with exit 0 that mean nothing; in
``codec.py`` and ``overhead.py`` a 0 silently meant the default. Only argument parsing runs here: each script's
``__main__`` path with one bad flag must stop with exit 2 before it measures anything.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

# script, a bad argument list, the flag the error must name
CASES = [
    ("catch_up.py", ["--steps", "0"], "--steps"),
    ("catch_up.py", ["--load-s", "-1"], "--load-s"),
    ("catch_up.py", ["--ready-timeout-s", "0"], "--ready-timeout-s"),
    ("codec.py", ["--quick", "--repeat", "-1"], "--repeat"),
    ("codec.py", ["--params", "0"], "--params"),  # 0 meant the default 64M
    ("codec.py", ["--steps", "0"], "--steps"),
    ("encode_threads.py", ["--gb", "0"], "--gb"),
    ("encode_threads.py", ["--tensors", "0"], "--tensors"),
    ("encode_threads.py", ["--changed", "1.5"], "--changed"),
    ("encode_threads.py", ["--workers", "1,0"], "--workers"),
    ("full_memory.py", ["--gb", "0"], "--gb"),
    ("full_memory.py", ["--nproc", "0"], "--nproc"),
    ("gcs_small_puts.py", ["--files", "0"], "--files"),
    ("gcs_small_puts.py", ["--mib", "64"], "--mib"),  # 64 MiB is the multipart threshold: no longer one request
    ("gpu_diff.py", ["--changed", "-0.1"], "--changed"),
    ("gpu_diff.py", ["--gb", "nan"], "--gb"),
    ("hint_latency.py", ["--deltas", "0"], "--deltas"),
    ("hint_latency.py", ["--put-ms", "-5"], "--put-ms"),
    ("overhead.py", ["--rounds", "0"], "--rounds"),  # 0 meant the default 6
    ("overhead.py", ["--phase-steps", "0"], "--phase-steps"),
    ("overhead.py", ["--dim", "0"], "--dim"),  # a job flag: checked before the job starts
    ("overhead_job.py", ["--rounds", "0"], "--rounds"),
    ("overhead_job.py", ["--lr", "0"], "--lr"),
    ("replica_compare.py", ["--repeats", "0"], "--repeats"),
    ("replica_compare.py", ["--nproc", "0"], "--nproc"),
    ("replica_compare.py", ["--counts", ""], "--counts"),
    ("retention_markers.py", ["--passes", "0"], "--passes"),
    ("retention_overlap.py", ["--steps", "0"], "--steps"),
    ("routing_exchange.py", ["--gib", "0"], "--gib"),
    ("s3_throttle.py", ["--parts", "1"], "--parts"),  # one part is no multipart upload
    ("s3_throttle.py", ["--rate", "1.5"], "--rate"),
    ("s3_small_puts.py", ["--files", "0"], "--files"),
    ("s3_small_puts.py", ["--mib", "64"], "--mib"),  # 64 MiB is the multipart threshold: no longer one PUT
    ("split_staging.py", ["--layers", "0"], "--layers"),
    ("split_staging.py", ["--reps", "0"], "--reps"),
    ("tensor_count.py", ["--steps", "2"], "--steps"),
    ("tensor_count.py", ["--counts", "300,x"], "--counts"),
]


# One interpreter for every case (each alone would import torch again), apart from this one: a script's module-level
# settings (codec.py's NUMBA_NUM_THREADS, for one) must not reach the other tests.
_LOOP = """
import contextlib, io, json, runpy, sys
out, cases, bench = [], json.loads(sys.argv[1]), sys.argv[2]
for script, args in cases:
    path, err = bench + "/" + script, io.StringIO()
    sys.argv = [path, *args]
    saved, sys.path = sys.path, [bench, *sys.path]  # as for `python benchmarks/<script>`: its folder first
    code = "no exit: the script ran past its argument parsing"
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:
            code = stop.code
    sys.path = saved
    out.append({"code": code, "stderr": err.getvalue()})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed() -> list[dict[str, object]]:
    """Each case run as ``python benchmarks/<script> <args>`` would run it: its exit code and stderr."""
    cases = json.dumps([[script, args] for script, args, _ in CASES])
    proc = subprocess.run([sys.executable, "-c", _LOOP, cases, str(BENCH)], capture_output=True, text=True,
                          timeout=300, cwd=BENCH.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_benchmark_refuses_an_impossible_argument_by_name(parsed: list[dict[str, object]], case: int) -> None:
    flag, got = CASES[case][2], parsed[case]
    assert got["code"] == 2, got
    assert f"error: argument {flag}" in str(got["stderr"]), got  # argparse's "argument --flag: <why>"


def test_every_benchmark_with_flags_has_a_case() -> None:
    """A new script with numeric flags comes with a bad-value case here."""
    with_parser = {s.name for s in BENCH.glob("*.py") if "ArgumentParser(" in s.read_text()}
    assert with_parser == {c[0] for c in CASES}
