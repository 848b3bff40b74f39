"""The engine under rank-local faults: several ranks as threads (real publisher, real local storage)."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import fsdp_hotload.engine.comm as comm_mod
from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.engine.publisher import Publisher
from fsdp_hotload.layout import TensorSpec
from fsdp_hotload.publish import WholeChunk
from fsdp_hotload.retention import read_commit_marker
from fsdp_hotload.storage import Storage
from tests.s3_fixture import FaultyFileSystem
from tests.thread_comm import Meeting, ThreadComm, run_ranks

N = 4096
NAMES = ["a", "b"]
SPECS = [TensorSpec(name, (N,), "BF16") for name in NAMES]


def two_ranks(cfg: HotloadConfig, tensors: list[torch.Tensor], *, storage: Any = None, timeout_s: float = 60.0,
              outcome_delay_s: float = 0.0) -> list[Publisher]:
    """Rank r publishes tensor NAMES[r] whole; both tensors sit in one file, so each rank routes to the other."""
    data, ctrl = Meeting(2, timeout_s=timeout_s), Meeting(2, timeout_s=timeout_s)
    pubs: list[Any] = [None, None]

    def make(rank: int) -> None:
        chunk = WholeChunk(NAMES[rank], (N,), "BF16", "flat", Box.flat(0, N), tensors[rank])
        pubs[rank] = Publisher([chunk], SPECS, cfg, storage=storage(rank) if storage else None,
                               comm=ThreadComm(data, rank, 2, outcome_delay_s=outcome_delay_s if rank else 0.0),
                               ctrl=ThreadComm(ctrl, rank, 2))

    run_ranks(make, 2)
    return pubs


def test_keep_training_on_error_keeps_every_rank_on_the_same_steps(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A rank that hears of a failed snapshot late (its outcome arrives while the other rank already took the
    error) used to give its slot back and skip a step the other staged: every later snapshot then paired
    different steps and failed, which this mode only logs."""
    bucket = str(tmp_path / "bucket")
    tensors = [torch.zeros(N), torch.zeros(N)]
    cfg = HotloadConfig(bucket_url=bucket, busy_policy="wait", full_every=100, keep_training_on_error=True)

    def storage(rank: int) -> Storage:
        faulty = FaultyFileSystem(fsspec.filesystem("file"), delay_s=0.005)
        faulty.arm(100, match="step-000003-")
        return Storage(bucket, fs=faulty, max_attempts=1)

    pubs = two_ranks(cfg, tensors, storage=storage, outcome_delay_s=0.15)
    staged: dict[int, list[int]] = {0: [], 1: []}

    def train(rank: int) -> None:
        for step in range(10):
            tensors[rank].fill_(step)
            if pubs[rank].publish(step):
                staged[rank].append(step)
            time.sleep(0.06)
        pubs[rank].close()

    run_ranks(train, 2)
    assert staged[0] == staged[1] == list(range(10)), staged
    records = [(m.step, m.kind, m.ok) for m in pubs[0].metrics.records]
    assert records == [(0, "full", True), (1, "delta", True), (2, "delta", True), (3, "delta", False),
                       (4, "full", True)] + [(s, "delta", True) for s in range(5, 10)], records
    # once per rank at WARNING: rank 0's summary, and rank 1's line when its trainer hears of it (rank 0's is INFO)
    warned = [m for r in caplog.records if r.levelno >= logging.WARNING and "step-000003-" in (m := r.getMessage())]
    assert len(warned) == 2 and sum("FAILED" in m for m in warned) == 1, warned
    assert sum("publish failed (training goes on" in m for m in warned) == 1, warned
    storage0 = Storage(bucket)
    final = read_commit_marker(storage0, pubs[0].metrics.records[-1].identity)
    assert final is not None and final.kind == "delta"


def test_a_rank_that_cannot_route_its_pieces_fails_the_snapshot_without_hanging_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pickling a full snapshot's pieces can run out of memory on one rank; that rank must still take part in
    the snapshot's collectives, or the others wait until the side group's timeout (an hour by default)."""
    tensors = [torch.zeros(N), torch.zeros(N)]
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"), busy_policy="wait", full_every=100)
    pubs = two_ranks(cfg, tensors, timeout_s=20.0)
    real = comm_mod.dumps_buffer
    failed = []

    def dumps_buffer(obj: Any) -> Any:
        if threading.current_thread().name == "hotload-publisher-1" and obj and not failed:
            failed.append(1)
            raise MemoryError("pickling rank 1's pieces")
        return real(obj)

    monkeypatch.setattr(comm_mod, "dumps_buffer", dumps_buffer)
    waited: dict[int, float] = {}

    def train(rank: int) -> None:
        for step in range(4):
            tensors[rank].fill_(step + 1)
            t0 = time.perf_counter()
            try:
                pubs[rank].publish(step)
                pubs[rank].wait()
            except Exception as exc:  # noqa: BLE001 - step 1 raises step 0's error, on both ranks
                assert step == 1 and "routing failed" in str(exc), exc
            if step <= 1:  # the failed snapshot and the step that raises it (step 3's delta may wait for numba's
                waited[rank] = max(waited.get(rank, 0.0), time.perf_counter() - t0)  # compile on a busy machine)
        pubs[rank].close()

    run_ranks(train, 2, timeout_s=40)
    assert failed and max(waited.values()) < 10.0, waited
    records = [(m.step, m.kind, m.ok) for m in pubs[0].metrics.records]
    assert records[0] == (0, "full", False) and "MemoryError" in (pubs[0].metrics.records[0].error or "")
    assert records[1:] == [(2, "full", True), (3, "delta", True)], records  # step 1 raised, staging nothing
    assert [p.stopped for p in pubs] == [None, None]


@pytest.mark.slow
@pytest.mark.parametrize("world,failing", [(2, "1"), (3, "0,1")])
def test_a_rank_that_cannot_allocate_its_receive_buffers_fails_the_exchange_without_hanging_the_others(
        tmp_path: Path, world: int, failing: str) -> None:
    """The receiving side of the test above, over a real gloo group: see dist_scripts/exchange_alloc_failure.py.
    With two ranks failing, the error named the highest alone, beside the allocation error of the rank raising it
    (rank 0 quoted its own error as rank 1's)."""
    from tests.dist_util import SCRIPTS, run_torchrun

    out = tmp_path / "result"
    run_torchrun(str(SCRIPTS / "exchange_alloc_failure.py"), world,
                 ["--out", str(out), "--timeout", "6", "--failing", failing], timeout=120)
    assert [Path(f"{out}.{rank}").read_text() for rank in range(world)] == ["ok"] * world


def test_publisher_arguments_that_could_only_fail_later_fail_at_construction(tmp_path: Path) -> None:
    t = torch.zeros(64)
    chunk = WholeChunk("a", (64,), "BF16", "flat", Box.flat(0, 64), t)
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"))
    with pytest.raises(ValueError, match="session"):
        Publisher([chunk], [TensorSpec("a", (64,), "BF16")], cfg, session="run/1")
    with pytest.raises(ValueError, match="ctrl="):
        Publisher([chunk], SPECS[:1], cfg, comm=ThreadComm(Meeting(2), 0, 2))


def test_a_background_copys_wait_counts_once_in_blocking_ms(tmp_path: Path) -> None:
    t = torch.zeros(1 << 16)
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"), max_inflight=2, busy_policy="wait")
    pub = Publisher([WholeChunk("a", (t.numel(),), "BF16", "flat", Box.flat(0, t.numel()), t)],
                    [TensorSpec("a", (t.numel(),), "BF16")], cfg)
    copy = pub.stager._copy_host
    pub.stager._copy_host = lambda *a: (time.sleep(0.3), copy(*a))[1]  # type: ignore[method-assign]
    blocked = 0.0
    for step in range(2):
        t0 = time.perf_counter()
        pub.publish(step, background_copy=True)
        blocked += time.perf_counter() - t0
    t0 = time.perf_counter()
    pub.fence()
    blocked += time.perf_counter() - t0
    pub.close()
    reported = [m.blocking_ms for m in pub.metrics.records]
    assert blocked * 1e3 > 500 and reported[0] > 250 and reported[1] > 250, (blocked, reported)
    assert sum(reported) <= blocked * 1e3 + 100, (blocked, reported)  # counted twice, it would be ~300 ms over


@pytest.mark.parametrize("where", ["under-a-file", "a-folder"])
def test_a_metrics_path_that_cannot_be_written_fails_construction_naming_it(tmp_path: Path, where: str) -> None:
    """A path under a file failed with a bare 'File exists: <its folder>', and a folder was accepted, every
    publish then logging that its metrics were lost."""
    (tmp_path / "a-file").write_text("")
    path = tmp_path / "a-file" / "m.jsonl" if where == "under-a-file" else tmp_path
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"), metrics_path=str(path))
    chunk = WholeChunk("a", (64,), "BF16", "flat", Box.flat(0, 64), torch.zeros(64))
    with pytest.raises(OSError, match="^metrics_path "):  # the test's name is in tmp_path
        Publisher([chunk], [TensorSpec("a", (64,), "BF16")], cfg)


@pytest.mark.parametrize("broken", ["hf_config_dir", "metrics_path"])
def test_a_publisher_that_fails_at_construction_leaves_no_thread_behind(tmp_path: Path, broken: str) -> None:
    """A construction that failed on the HF folder or the metrics path left the signaller's worker thread
    running for the life of the process, one more per failed attempt."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "a-file").write_text("")
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(hf),
                        hotload_api_url="http://127.0.0.1:9", account_id="a", model_id="m", deployment_id="d",
                        api_key="k",
                        metrics_path=str(tmp_path / "a-file" / "m.jsonl") if broken == "metrics_path" else None)
    if broken == "hf_config_dir":
        (hf / "config.json").unlink()
    t = torch.zeros(64)
    chunk = WholeChunk("a", (64,), "BF16", "flat", Box.flat(0, 64), t)
    before = set(threading.enumerate())
    for _ in range(2):
        with pytest.raises(OSError):
            Publisher([chunk], [TensorSpec("a", (64,), "BF16")], cfg)
    left = [t.name for t in set(threading.enumerate()) - before if not t.name.startswith("hotload-warmup")]
    assert left == []


def test_a_step_that_raises_an_error_is_not_counted_as_skipped_for_being_busy(tmp_path: Path) -> None:
    """With several ranks a stored error is raised at a later step, whose slot is given back unstaged: that step
    was counted in the next snapshot's ``skipped_before`` (steps skipped because the publisher was busy), also
    under ``busy_policy="wait"``, which never skips. Two thread ranks; every upload of step 3 fails."""
    from fsdp_hotload.engine import PublishError

    bucket = str(tmp_path / "bucket")
    tensors = [torch.zeros(N), torch.zeros(N)]
    cfg = HotloadConfig(bucket_url=bucket, busy_policy="wait", max_inflight=1, full_every=100)

    def storage(rank: int) -> Storage:
        faulty = FaultyFileSystem(fsspec.filesystem("file"))
        faulty.arm(100, match="step-000003-")
        return Storage(bucket, fs=faulty, max_attempts=1)

    pubs = two_ranks(cfg, tensors, storage=storage)
    raised: dict[int, list[int]] = {0: [], 1: []}

    def train(rank: int) -> None:
        for step in range(8):
            tensors[rank].fill_(step)
            try:
                pubs[rank].publish(step)
            except PublishError:
                raised[rank].append(step)
        pubs[rank].close()

    run_ranks(train, 2)
    records = [(m.step, m.ok, m.skipped_before) for m in pubs[0].metrics.records]
    assert raised == {0: [4], 1: [4]}
    assert [r for r in records if not r[1]] == [(3, False, 0)] and all(r[2] == 0 for r in records), records


@pytest.mark.parametrize("slow", [0, 1])
def test_the_metrics_name_the_slowest_rank(slow: int, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 waits for every rank's files without knowing whose are late, and the metrics gave only the slowest
    time: with many ranks a throttled or overloaded node could not be found. Now they name the rank; and while
    it runs, a slow rank other than 0 reports its own uploads ("rank 1: ..."), while the ranks that only wait
    for it say nothing (rank 0 reports the wait)."""
    bucket = str(tmp_path / "bucket")
    tensors = [torch.ones(N), torch.ones(N)]
    # one file per tensor: each rank writes its own; rank 1 reports every 4 x 0.1 s
    cfg = HotloadConfig(bucket_url=bucket, max_file_bytes=2 * N, progress_log_s=0.1)

    def storage(rank: int) -> Storage:
        return Storage(bucket, fs=FaultyFileSystem(fsspec.filesystem("file"), delay_s=1.0 if rank == slow else 0.0))

    pubs = two_ranks(cfg, tensors, storage=storage)
    assert sorted(pubs[0].owners.values()) == [0, 1]

    def train(rank: int) -> None:
        assert pubs[rank].publish(0)
        pubs[rank].close()

    with caplog.at_level("INFO", logger="fsdp_hotload"):
        run_ranks(train, 2)
    (m,) = pubs[0].metrics.records
    assert m.ok and m.slowest_rank == slow and m.upload_s >= 1.0
    assert f"(slowest rank {slow})" in caplog.text
    lines = [r.getMessage() for r in caplog.records if "still publishing after" in r.getMessage()]
    own = [s for s in lines if s.startswith("hotload: rank 1: ")]
    if slow == 1:
        assert own and all(": uploading for " in s and "this rank wrote 0/1 files" in s for s in own), lines
        assert any(s.startswith(f"hotload: {m.identity} ") and "waiting for every rank's files" in s for s in lines)
    else:
        assert own == [] and any(": uploading for " in s for s in lines), lines


def test_a_rank_that_waited_for_a_slot_does_not_name_itself_slow(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """With the wait policy a publish waits for a free slot behind a slow rank 0, and each rank's report clock ran
    from the publish call: rank 1's next own stage (a quick encode) was reported at once, naming rank 1 as the
    late one. Now a rank other than 0 reports an own stage only once that stage has run the interval."""
    bucket = str(tmp_path / "bucket")
    cfg = HotloadConfig(bucket_url=bucket, busy_policy="wait", max_file_bytes=2 * N, progress_log_s=0.1)

    def storage(rank: int) -> Storage:
        return Storage(bucket, fs=FaultyFileSystem(fsspec.filesystem("file"), delay_s=0.6 if rank == 0 else 0.0))

    pubs = two_ranks(cfg, [torch.ones(N), torch.ones(N)], storage=storage)

    def train(rank: int) -> None:
        for step in range(3):
            assert pubs[rank].publish(step)
        pubs[rank].close()

    with caplog.at_level("INFO", logger="fsdp_hotload"):
        run_ranks(train, 2)
    assert [m.ok for m in pubs[0].metrics.records] == [True] * 3
    lines = [r.getMessage() for r in caplog.records if "still publishing after" in r.getMessage()]
    assert not [s for s in lines if s.startswith("hotload: rank 1: ")], lines
    assert any("waiting for every rank's files" in s or "uploading" in s for s in lines), lines  # rank 0's
