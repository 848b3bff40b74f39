"""A failure on one rank only must end the same snapshot, and raise at the same step, on every rank: a rank that
raises alone stops staging a step the others stage, and from then on every snapshot pairs two different steps."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.engine import PublishError
from fsdp_hotload.engine.jobs import Job, RankStatus, summarize
from fsdp_hotload.engine.publisher import Publisher
from fsdp_hotload.layout import TensorSpec
from fsdp_hotload.publish import WholeChunk
from tests.snapshots import rebuild_accepted
from tests.thread_comm import Meeting, ThreadComm, run_ranks


def test_bookkeeping_failing_on_one_rank_fails_the_next_snapshot_on_every_rank(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's bookkeeping after step 0's (accepted) outcome fails. Step 1's snapshot then fails on both ranks,
    both raise at step 2 (the publish that takes step 1's slot), step 3 is full, and the fleet's bytes, rebuilt
    from the bucket, are the trainer's at every accepted step."""
    bucket = str(tmp_path / "bucket")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    names, n = ["a", "b"], 4096
    tensors = [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    specs = [TensorSpec(name, (n,), "BF16") for name in names]
    cfg = HotloadConfig(bucket_url=bucket, hf_config_dir=str(hf), busy_policy="wait", max_inflight=1,
                        full_every=100)
    data, ctrl = Meeting(2), Meeting(2)
    pubs: list[Any] = [None, None]
    raised: dict[int, list[int]] = {0: [], 1: []}
    expected: dict[int, dict[str, str]] = {}
    failures: list[BaseException] = []

    def make(rank: int) -> None:
        chunk = WholeChunk(names[rank], (n,), "BF16", "flat", Box.flat(0, n), tensors[rank])
        pubs[rank] = Publisher([chunk], specs, cfg, comm=ThreadComm(data, rank, 2), ctrl=ThreadComm(ctrl, rank, 2))
        if rank == 1:
            stager, promote = pubs[rank].stager, pubs[rank].stager.promote
            calls = []

            def failing_promote(buf: torch.Tensor) -> None:
                promote(buf)
                calls.append(buf)
                if len(calls) == 1:
                    raise RuntimeError("injected: bookkeeping after the outcome")

            stager.promote = failing_promote

    def train(rank: int) -> None:
        try:
            for step in range(6):
                torch.manual_seed(step * 10 + rank)
                idx = torch.randint(0, n, (64,))
                tensors[rank][idx] = torch.randn(64, dtype=torch.bfloat16)
                if rank == 0:
                    expected[step] = {}
                try:
                    pubs[rank].publish(step)
                except PublishError:
                    raised[rank].append(step)
                pubs[rank].wait()
                expected.setdefault(step, {})[names[rank]] = RawTensor.from_any(tensors[rank]).digest()
            pubs[rank].close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    for target in (make, train):
        run_ranks(target, 2, timeout_s=90)
    assert not failures, failures
    assert raised == {0: [2], 1: [2]}, raised
    records = pubs[0].metrics.records
    assert [(m.step, m.kind, m.ok) for m in records] == [
        (0, "full", True), (1, "delta", False), (3, "full", True), (4, "delta", True), (5, "delta", True)]
    assert "rank 1: the bookkeeping after the previous snapshot failed" in (records[1].error or "")
    assert "injected: bookkeeping after the outcome" in caplog.text
    rebuilt = rebuild_accepted(bucket, records)
    for m in records:
        if m.ok:
            assert {k: t.digest() for k, t in rebuilt[m.identity].items()} == expected[m.step], m.step


@pytest.mark.parametrize("field, values, message", [
    ("kind", ["delta", "full"], "disagree on the snapshot kind"),
    ("parent", ["step-000001-aa", "step-000000-aa"], "deltas have different parents"),
    ("identity", ["step-000002-aa", "step-000003-aa"], "ranks staged different steps"),
])
def test_a_snapshot_whose_ranks_disagree_is_never_committed(field: str, values: list[str], message: str) -> None:
    """Rank 0 checks every rank's report before it writes the commit marker: pieces of two kinds, two parents or
    two steps would make a snapshot that rebuilds to bytes no trainer ever held, with valid checksums."""
    job = Job(2, torch.empty(0), None, blocking_ms=0.0, skipped_before=0, t_hook=0.0)
    statuses = [RankStatus(r, "delta", "step-000002-aa", "step-000001-aa", files={f"f{r}": 10}) for r in range(2)]
    _, files, errors = summarize(job, "step-000002-aa", "delta", statuses, raw_bytes=40)
    assert errors == [] and files == {"f0": 10, "f1": 10}
    for status, value in zip(statuses, values):
        setattr(status, field, value)
    _, _, errors = summarize(job, "step-000002-aa", "delta", statuses, raw_bytes=40)
    assert len(errors) == 1 and message in errors[0], errors


def test_a_snapshot_missing_a_file_that_no_rank_reported_failing_is_never_committed(tmp_path: Path) -> None:
    """Rank 0 commits only when the ranks' reports name every file of the plan: a report without an error that
    lacks a file (a rank that skipped one) must not get a commit marker, and its folder is discarded."""
    from fsdp_hotload.retention import read_commit_marker

    n = 4096
    specs = [TensorSpec(name, (n,), "BF16") for name in ("model.layers.0.a", "model.layers.1.b")]
    chunk = WholeChunk("model.layers.0.a", (n,), "BF16", "flat", Box.flat(0, n), torch.zeros(n))
    pub = Publisher([chunk], specs, HotloadConfig(bucket_url=str(tmp_path / "bucket")))
    try:
        files = sorted(pub.plan.files)
        assert len(files) == 2
        identity = "step-000002-aa"
        for f in files:
            pub.storage.put_bytes(f"{identity}/{f}", b"x" * 10)
        job = Job(2, torch.empty(0), None, blocking_ms=0.0, skipped_before=0, t_hook=0.0)
        statuses = [RankStatus(0, "full", identity, None, files={files[0]: 10}), RankStatus(1, "full", identity)]
        outcome = pub.committer.finish(job, identity, "full", None, statuses, pub._prog)
        assert not outcome.ok and "files missing after upload" in (outcome.error or ""), outcome.error
        assert read_commit_marker(pub.storage, identity) is None
        assert pub.storage.list(identity) == []
    finally:
        pub.close()


def test_a_set_up_failing_on_one_rank_fails_construction_on_every_rank(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/setup_failure.py): rank 0's metrics file or hf_config_dir, or a rename that
    raises on rank 1. The failing rank raises its own error; the other raises at once, naming that rank and the
    error, instead of returning a callback whose first publish waits out the side group's timeout."""
    from tests.dist_util import SCRIPTS, run_torchrun

    hf, empty = tmp_path / "hf", tmp_path / "empty"
    hf.mkdir()
    empty.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    run_torchrun(str(SCRIPTS / "setup_failure.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--hf-dir", str(hf),
                                                        "--empty-dir", str(empty), "--out", str(tmp_path)])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    failing = {"metrics": 0, "hf_config_dir": 0, "rename": 1}
    own = {"metrics": ("IsADirectoryError", "metrics_path"), "hf_config_dir": ("FileNotFoundError", "config.json"),
           "rename": ("ValueError", "raised KeyError: \"no checkpoint name")}
    for r in range(2):  # every rank: the meta device's hint, not "Cannot copy out of meta tensor" from a sample
        kind, text, took = ranks[r]["meta"]
        assert kind in ("RuntimeError", "OwnershipError") and "meta device" in text and took < 60, ranks[r]["meta"]
    for case, bad in failing.items():
        kind, text, _s = ranks[bad][case]
        assert (kind, own[case][1] in text) == (own[case][0], True), (case, ranks[bad][case])
        kind, text, took = ranks[1 - bad][case]
        assert kind in ("RuntimeError", "OwnershipError") and f"rank {bad}" in text and own[case][1] in text, \
            (case, ranks[1 - bad][case])
        assert took < 60, (case, took)  # at once: not after the side group's timeout (120 s)


def test_a_publisher_set_up_failing_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    """In-process ranks: rank 1's chunk does not match the specs, or rank 0's metrics_path is a folder. The failing
    rank raises its own error and the other a RuntimeError naming it, both at construction: nobody is left with a
    publisher whose first collective the failed rank never joins."""
    n = 64
    specs = [TensorSpec("a", (n,), "BF16"), TensorSpec("b", (n,), "BF16")]
    for case in ("chunk", "metrics"):
        data, ctrl = Meeting(2, timeout_s=20), Meeting(2, timeout_s=20)
        raised: dict[int, BaseException | None] = {0: None, 1: None}

        def make(rank: int, case: str = case, data: Meeting = data, ctrl: Meeting = ctrl) -> None:
            dtype = "F16" if case == "chunk" and rank == 1 else "BF16"
            chunk = WholeChunk("ab"[rank], (n,), dtype, "flat", Box.flat(0, n), torch.zeros(n, dtype=torch.bfloat16))
            cfg = HotloadConfig(bucket_url=str(tmp_path / case), metrics_path=str(tmp_path) if case == "metrics"
                                else None)
            try:
                Publisher([chunk], specs, cfg, comm=ThreadComm(data, rank, 2), ctrl=ThreadComm(ctrl, rank, 2)).close()
            except BaseException as exc:  # noqa: BLE001 - checked below
                raised[rank] = exc

        run_ranks(make, 2, timeout_s=60)
        bad = 1 if case == "chunk" else 0
        own, other = raised[bad], raised[1 - bad]
        assert isinstance(own, ValueError if case == "chunk" else IsADirectoryError), (case, own)
        assert isinstance(other, RuntimeError) and f"rank {bad} failed to set up" in str(other), (case, other)
        assert str(own) in str(other), (case, other)


@pytest.mark.parametrize("case", ["codec", "plan"])
def test_ranks_whose_settings_or_plan_differ_fail_at_construction(tmp_path: Path, case: str) -> None:
    """Settings read per node (``HOTLOAD_*``) can differ: a rank with another codec had its pieces written under
    the owner's codec name, a delta committed that no reader could decode. And a plan that fails on one rank only
    (here: rank 1 given a tensor twice) left the other waiting for the side group's timeout. Both now fail every
    rank at construction, naming the rank and what differs."""
    n = 64
    specs = [TensorSpec("a", (n,), "BF16"), TensorSpec("b", (n,), "BF16")]
    data, ctrl = Meeting(2, timeout_s=20), Meeting(2, timeout_s=20)
    raised: dict[int, BaseException | None] = {0: None, 1: None}

    def make(rank: int) -> None:
        chunk = WholeChunk("ab"[rank], (n,), "BF16", "flat", Box.flat(0, n), torch.zeros(n, dtype=torch.bfloat16))
        codec = "arc_sparse_v1" if case == "codec" and rank == 1 else "arc_v2"
        mine = specs + specs[:1] if case == "plan" and rank == 1 else specs
        try:
            Publisher([chunk], mine, HotloadConfig(bucket_url=str(tmp_path / "bucket"), codec=codec),
                      comm=ThreadComm(data, rank, 2), ctrl=ThreadComm(ctrl, rank, 2)).close()
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised[rank] = exc

    t0 = time.monotonic()
    run_ranks(make, 2, timeout_s=60)
    assert time.monotonic() - t0 < 15  # not after a collective's timeout
    assert all(raised.values()), raised
    if case == "codec":
        for exc in raised.values():
            assert isinstance(exc, RuntimeError) and "rank 1 failed to set up: its settings differ from rank 0's: " \
                "codec (rank 1: 'arc_sparse_v1', rank 0: 'arc_v2')" in str(exc), exc
    else:
        assert not isinstance(raised[1], RuntimeError) and "rank 1 failed to set up" in str(raised[0]), raised
    assert not (tmp_path / "bucket").exists() or not any((tmp_path / "bucket").iterdir())


class _LateTimeoutComm(ThreadComm):
    """Rank 1's side group times out receiving step ``at``'s outcome after rank 0 sent it, as gloo does when
    the root's send completed and the receiver's wait had already run out: rank 0 goes on, rank 1 is broken."""

    def __init__(self, *args: Any, fail_step_outcome: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail = fail_step_outcome

    def broadcast(self, obj: Any) -> Any:
        value = super().broadcast(obj)
        if self.fail and self.rank == 1 and value is not None:
            self.fail = False
            raise TimeoutError("injected: the side group's collective timed out")
        return value


@pytest.mark.parametrize("policy", ["skip", "wait"])
def test_close_after_a_side_group_timeout_on_one_rank_never_waits_on_the_other(tmp_path: Path, policy: str) -> None:
    """After a collective fails on rank 1 only, rank 1 stops publishing and skipped the vote on the newest step at
    close, while rank 0, whose side group was fine, voted and waited for it until the trainer group's timeout
    (over an hour by default). Both must close at once, and publish nothing more. (With the wait policy rank 0
    breaks too at its next snapshot, which rank 1 no longer joins: it closes right after the failed outcome.)"""
    import time

    bucket = str(tmp_path / "bucket")
    names, n = ["a", "b"], 1024
    tensors = [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    specs = [TensorSpec(name, (n,), "BF16") for name in names]
    cfg = HotloadConfig(bucket_url=bucket, busy_policy=policy, full_every=100)
    data, ctrl = Meeting(2, timeout_s=3.0), Meeting(2, timeout_s=3.0)
    pubs: list[Any] = [None, None]
    took: dict[int, float] = {}
    raised: dict[int, list[str]] = {0: [], 1: []}

    def make(rank: int) -> None:
        chunk = WholeChunk(names[rank], (n,), "BF16", "flat", Box.flat(0, n), tensors[rank])
        pubs[rank] = Publisher([chunk], specs, cfg, comm=_LateTimeoutComm(data, rank, 2, fail_step_outcome=True),
                               ctrl=ThreadComm(ctrl, rank, 2))

    def train(rank: int) -> None:
        pub = pubs[rank]
        for step in range(3 if policy == "skip" else 1):
            tensors[rank].fill_(step)
            try:
                pub.publish(step)
            except PublishError as exc:
                raised[rank].append(str(exc))
            pub.wait()
        t0 = time.monotonic()
        try:
            pub.close()
        except BaseException as exc:  # noqa: BLE001 - checked below
            raised[rank].append(f"close: {exc!r}")
        took[rank] = time.monotonic() - t0

    for target in (make, train):
        run_ranks(target, 2, timeout_s=60)
    assert pubs[1].stopped is not None and pubs[0].stopped is None
    assert raised[0] == [] and len(raised[1]) == 1 and "injected" in raised[1][0], raised  # raised once, on rank 1
    assert max(took.values()) < 2.0, took
    assert [m.step for m in pubs[0].metrics.records] == [0]


def test_a_rank_whose_encode_failed_sends_nothing_and_nobody_writes(tmp_path: Path) -> None:
    """Rank 1's encode fails on step 1: it used to send empty piece lists, which the owners took for a rank with
    nothing for them, so they assembled and uploaded files that could never be committed (a full snapshot's, all
    of them) and reported unrelated "chunks cover ..." errors. Now nobody writes, the error names rank 1's encode,
    and the next publish is full and bit-exact."""
    import fsspec
    from safetensors.torch import load_file

    from fsdp_hotload.engine import PublishError
    from fsdp_hotload.storage import Storage

    bucket = str(tmp_path / "bucket")
    names, n = ["model.layers.0.a", "model.layers.1.b"], 4096
    tensors = [torch.zeros(n), torch.zeros(n)]
    specs = [TensorSpec(name, (n,), "BF16") for name in names]
    cfg = HotloadConfig(bucket_url=bucket, busy_policy="wait", max_file_bytes=n * 2, full_every=1)  # a file each
    data, ctrl = Meeting(2), Meeting(2)
    pubs: list[Any] = [None, None]
    writes: list[str] = []

    class Recording:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
            if "w" in mode and "step-000001-" in str(path):
                writes.append(str(path))
            return self.inner.open(path, mode, *args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    def make(rank: int) -> None:
        chunk = WholeChunk(names[rank], (n,), "BF16", "flat", Box.flat(0, n), tensors[rank])
        pubs[rank] = Publisher([chunk], specs, cfg, storage=Storage(bucket, fs=Recording(fsspec.filesystem("file"))),
                               comm=ThreadComm(data, rank, 2), ctrl=ThreadComm(ctrl, rank, 2))
    run_ranks(make, 2)
    assert sorted(pubs[0].owners.values()) == [0, 1]  # each rank writes a file of its own
    encode = pubs[1]._encode

    def failing(buf: Any, kind: str, *args: Any) -> Any:
        if pubs[1].latest_step == 1:
            raise MemoryError("injected: encode failed")
        return encode(buf, kind, *args)

    pubs[1]._encode = failing
    raised: dict[int, list[int]] = {0: [], 1: []}

    def train(rank: int) -> None:
        for step in range(3):
            tensors[rank].fill_(step + 1.5 * rank)
            try:
                pubs[rank].publish(step)
            except PublishError:
                raised[rank].append(step)
            pubs[rank].wait()
        pubs[rank].close()

    run_ranks(train, 2)
    records = pubs[0].metrics.records
    assert [(m.step, m.kind, m.ok) for m in records] == [(0, "full", True), (1, "full", False), (2, "full", True)]
    assert "rank 1: encode failed" in (records[1].error or "") and "chunks cover" not in (records[1].error or "")
    assert writes == [], writes
    folder = Path(bucket) / records[2].identity
    got = {k: v for f in folder.glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    assert {k: v.view(torch.int16).numpy().tobytes() for k, v in got.items()} == {
        name: t.bfloat16().view(torch.int16).numpy().tobytes() for name, t in zip(names, tensors)}


def test_a_callback_dropped_without_close_frees_its_side_groups(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/dropped_callback.py): three callbacks dropped without close(), then one
    closed. Each dropped one left its gloo groups, and their sockets, for the life of the process; once that was
    fixed, they were destroyed before its engine's threads were told to stop (finalizers run newest first)."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "dropped_callback.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out",
                                                           str(tmp_path)])
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["collected"] == [True] * 3, got
        assert len(set(got["sockets"])) == 1, got  # as many open sockets after each as before the first
        # every group a drop destroyed (at least the two sides of each), after the engine's threads were told
        assert len(got["stopped_first"]) >= 6 and all(got["stopped_first"]), got


def test_a_rank_closing_on_an_exception_does_not_leave_the_others_waiting_in_the_vote(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/vote_after_peer_error.py): rank 1 leaves ``with cb:`` on an exception and
    waits at a barrier; rank 0 closes cleanly, with step 3 left to publish. Rank 0 waited in close()'s vote for a
    rank that never votes, until the side group's timeout (30 s here, over an hour by default), and then raised;
    now rank 1 says it will not vote, rank 0 stops waiting at once, and publishes nothing more."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "vote_after_peer_error.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out",
                                                                str(tmp_path)])
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[1]["error"] == "OSError: injected: this rank's checkpoint write failed", got[1]
    assert got[0]["error"] is None and got[0]["s"] < 20, got[0]  # not the vote's failure at the group's timeout
    assert [0, True] in got[0]["published"] and 3 not in [step for step, _ in got[0]["published"]], got[0]
    said = [w for w in got[0]["warnings"] if "step 3 is not published at close" in w]
    assert len(said) == 1 and "rank 1 closes on an exception" in said[0], got[0]["warnings"]


def test_a_collective_broken_by_a_rank_closing_on_an_exception_is_said_to_be_so(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/peer_raised_mid_publish.py): rank 1 leaves ``with cb:`` on an exception
    before step 3's publish; rank 0 publishes step 3 (wait policy) and closes. Its close() raised gloo's "Connection
    reset by peer ... typically caused by a remote worker hanging"; now it names the cause, rank 1's note."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "peer_raised_mid_publish.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out",
                                                                  str(tmp_path)])
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[1]["error"] == "RuntimeError: injected: this rank's data loader broke", got[1]
    assert got[0]["error"] is not None and "rank 1 closes on an exception" in got[0]["error"], got[0]
    assert got[0]["s"] < 20, got[0]
    committed = sorted(p.parent.name for p in (tmp_path / "bucket").glob("*/hotload.commit.json"))
    assert [c.split("-")[1] for c in committed] == ["000000", "000001", "000002"], committed


def test_a_vote_given_up_at_close_timeout_leaves_nothing_that_holds_the_process(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/vote_gave_up_exit.py): rank 0's close() gives up on the vote at its 1 s
    deadline, rank 1 closes 3 s later without voting and keeps its process alive. The vote was a gloo reduction,
    left pending: rank 0's destroy_process_group() then returned only once rank 1's process had exited (Z10
    measured 28 s), and its exit could end in SIGABRT. The vote is now taken in the job's store."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "vote_gave_up_exit.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out",
                                                            str(tmp_path)])
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[1]["rank 0 torn down while rank 1 lives"] is True, got
    assert got[0]["error"] is None and [0, True] in got[0]["published"], got[0]
    assert 3 not in [step for step, _ in got[0]["published"]], got[0]
    said = [w for w in got[0]["warnings"] if "step 3 is not published at close" in w]
    assert len(said) == 1 and "rank 0 stopped waiting for the others at close()'s deadline" in said[0], got[0]


def test_a_rank_that_exits_without_close_does_not_hold_the_others_vote(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/vote_peer_exits.py): rank 1 exits normally without close(); rank 0's close()
    waited for its vote until the side group's timeout (30 s here). Its exit now leaves the note."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "vote_peer_exits.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out",
                                                          str(tmp_path)])
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["error"] is None and got["s"] < 20, got
    said = [w for w in got["warnings"] if "step 3 is not published at close" in w]
    assert len(said) == 1 and "rank 1 exited without calling close()" in said[0], got


def test_close_after_destroy_process_group_says_what_happened(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/destroyed_first.py): close() after destroy_process_group(), with step 1
    left to publish at close. It raised "Group <...> is not registered", which named neither the cause nor the
    step lost."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "destroyed_first.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out",
                                                          str(tmp_path)])
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["error"] and got["error"].startswith("PublishError: close() ran after "
                                                        "torch.distributed.destroy_process_group()"), got
        assert "step 1 is not published" in got["error"] and got["s"] < 30, got


def test_a_tensor_publisher_on_every_rank_is_told_on_the_ranks_other_than_0(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/tensor_publisher_ranks.py): a script that builds a TensorPublisher on every
    rank published one chain per rank, which overwrite each other on a deployment, without a word."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "tensor_publisher_ranks.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out",
                                                                 str(tmp_path)])
    told = [[line for line in json.loads((tmp_path / f"rank{r}.json").read_text()) if "rank 0's" in line]
            for r in range(2)]
    assert told[0] == [] and len(told[1]) == 1 and "on rank 1 of 2 publishes its own snapshots" in told[1][0]


@pytest.mark.slow
def test_faults_on_one_rank_keep_the_ranks_in_step(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/one_rank_faults.py).

    staging: rank 1's rename raises once, while only it walks its model again (at step 4, once the ranks'
    comparisons of their copies have ended, which walk it too). publish() raised on rank 1 alone,
    which then staged one step fewer than rank 0, and every later snapshot failed ("ranks staged different
    steps"). Now that snapshot fails on both ranks, raised at the same step on both, and the next one is full.

    agreement: rank 0 pauses past collective_timeout_s before a step, and the skip policy's agreement fails. The
    failed reduction was read again at every later step, raising gloo's error each time although
    keep_training_on_error was set, and again from close(). Now it is logged once, publishing stops
    (``stopped``), training goes on, and close() returns."""
    from tests.dist_util import SCRIPTS, run_torchrun

    out = tmp_path / "result"
    run_torchrun(str(SCRIPTS / "one_rank_faults.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out", str(out)],
                 timeout=120)
    res = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    staging = [r["staging"] for r in res]
    assert staging[0]["steps"] == staging[1]["steps"], staging  # the same steps staged, the error at one step
    assert [s.split(":")[0] for s in staging[0]["steps"]] == [
        "started", "started", "started", "started", "started", "raised PublishError", "started", "started"], staging
    assert "rank 1: copying the weights of step 4 failed" in staging[1]["steps"][5], staging
    assert "no published name" in staging[1]["steps"][5], staging
    assert [(step, kind, ok) for step, kind, ok, _ in staging[0]["metrics"]] == [
        (0, "full", True), (1, "delta", True), (2, "delta", True), (3, "delta", True), (4, "delta", False),
        (6, "full", True), (7, "delta", True)], staging
    for agreement in (r["agreement"] for r in res):
        assert not [s for s in agreement["steps"] if s.startswith("raised")], agreement
        assert agreement["close"] == "ok" and agreement["stopped"], agreement


def test_closing_on_an_error_after_destroy_process_group_keeps_the_callers_error(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/destroyed_on_error.py): after destroy_process_group(), leaving a ``with``
    block on an exception raised PublishError in place of the body's exception, and close(raise_errors=False)
    raised it too. Both now return (the body's error propagates) and say at WARNING what was not published."""
    from tests.dist_util import SCRIPTS, run_torchrun

    run_torchrun(str(SCRIPTS / "destroyed_on_error.py"), 2, ["--bucket", str(tmp_path / "bucket"), "--out",
                                                             str(tmp_path)])
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["close"] == "returned" and got["with"] == "KeyError: \"the body's own error\"", got
        said = [w for w in got["warnings"] if "close() ran after torch.distributed.destroy_process_group()" in w]
        assert len(said) == 2 and all("step 1 is not published" in w for w in said), got
