"""The test harness's own contracts: a failure on a thread a test runs fails that test, never just a warning."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.thread_comm import run_ranks

ROOT = Path(__file__).resolve().parent.parent


def test_run_ranks_raises_the_lowest_failing_ranks_exception() -> None:
    """An assert in a rank's body must fail the test: ranks 1 and 2 fail, rank 0 returns, and the caller gets
    rank 1's exception (chained, so its traceback is shown) after every rank ended."""
    ended: list[int] = []

    def body(rank: int) -> None:
        try:
            assert rank == 0, f"rank {rank}'s check failed"
        finally:
            ended.append(rank)

    with pytest.raises(AssertionError, match=r"^rank 1 raised AssertionError\(\"rank 1's check failed") as info:
        run_ranks(body, 3, timeout_s=10)
    assert isinstance(info.value.__cause__, AssertionError) and "rank 1's check failed" in str(info.value.__cause__)
    assert sorted(ended) == [0, 1, 2]
    run_ranks(lambda rank: None, 3, timeout_s=10)  # no rank raised: returns


def test_run_ranks_names_a_hung_rank_and_what_another_rank_raised() -> None:
    """A rank left waiting is usually waiting for a rank that failed: the hang's message says what that one
    raised."""
    release = threading.Event()

    def body(rank: int) -> None:
        if rank == 0:
            raise RuntimeError("rank 0 broke before the collective")
        release.wait(30)

    try:
        with pytest.raises(AssertionError, match=r"a rank hung: rank\(s\) \[1\] still running after 0.3 s; "
                                                 r"rank 0 raised RuntimeError\('rank 0 broke") as info:
            run_ranks(body, 2, timeout_s=0.3)
    finally:
        release.set()
    assert isinstance(info.value.__cause__, RuntimeError)


def test_an_exception_on_a_thread_a_test_started_fails_that_test(tmp_path: Path) -> None:
    """Under the project's pytest settings, a test whose own thread raised fails (pytest's default is a warning,
    which let a broken check in a helper thread pass)."""
    (tmp_path / "test_one.py").write_text(
        "import threading\n\n"
        "def test_thread_fails():\n"
        "    t = threading.Thread(target=lambda: 1 / 0)\n"
        "    t.start()\n"
        "    t.join()\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed" in proc.stdout and "ZeroDivisionError" in proc.stdout, proc.stdout
