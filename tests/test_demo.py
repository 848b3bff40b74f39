"""The README's first command, shortened: the demo job runs, and every replica verifies every publish."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_demo_publishes_and_verifies(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fsdp_hotload.cli", "demo", "--steps", "7", "--full-every", "3",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "demo_result.json").read_text())
    assert result["verified"]
    assert [r["kind"] for r in result["rows"]] == ["full", "delta", "delta"] * 2 + ["full"]
    assert all(r["verified"] for r in result["rows"])
    assert "every replica verified bit-exact: yes" in proc.stdout
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 7 and all(m["ok"] for m in metrics)
