"""The benchmark scripts still run end to end, on sizes small enough for CI.

Their figures are not checked here (timings belong in ``benchmarks/RESULTS.md``, never in assertions). What is
checked is what a broken script would get wrong: the job publishes and the emulator's replicas accept every
snapshot, the report carries its target lines, every codec payload round-trips, and the GPU script exits
cleanly without a GPU.
"""
from __future__ import annotations

import json
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
    assert "3% needs steps of about" in proc.stdout
    assert "extra memory <= 2x the bf16 local shard" in proc.stdout


def test_codec_benchmark_round_trips_every_payload() -> None:
    # codec.py decodes every payload and raises if one differs from the trainer's bytes.
    proc = _run([str(BENCH / "codec.py"), "--quick", "--params", "200000", "--steps", "2", "--repeat", "1"], 300)
    assert "arc_v2: encode" in proc.stdout and "sparse·dense: ratio" in proc.stdout


def test_gpu_diff_benchmark_runs_or_says_why_not() -> None:
    proc = _run([str(BENCH / "gpu_diff.py"), "--gb", "0.05"], 300)
    assert "GB/s" in proc.stdout or "no CUDA device here" in proc.stdout
