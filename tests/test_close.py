"""close() at the end of training: the newest step reaches the fleet even when the cadence or a busy publisher
skipped it, bit for bit, and never from weights that may be changing or half updated; close gives up on a hung
write or a slow load at its timeout, and a publisher dropped without close still ends its threads and frees what
it holds. close() on several ranks, and their vote on the newest step, are in test_close_ranks.py."""
from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.engine.publisher import Publisher
from fsdp_hotload.layout import TensorSpec
from fsdp_hotload.publish import TensorPublisher, WholeChunk
from tests.snapshots import rebuild_accepted
from tests.publisher_helpers import API_KEY, config, expected_sha, make_model, served, train_step


def assert_fleet_serves(emu: HotLoadEmulator, identity: str, shas: dict[str, str]) -> None:
    for served_identity, served_shas in served(emu):
        assert served_identity == identity
        assert served_shas == shas, "a replica serves other bytes than the trainer's"


@pytest.mark.parametrize("on_close", [True, False])
def test_close_publishes_the_newest_step_left_between_publish_every_steps(tmp_path: Path, on_close: bool) -> None:
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, publish_every=3, busy_policy="wait", publish_on_close=on_close)
        with TensorPublisher(model, cfg) as pub:
            for step in range(8):
                train_step(model, step)
                pub.publish(step, model)  # the construction tensors: close can read them again
                if step == 6:
                    at_six = expected_sha(model)
        steps = [m.step for m in pub.metrics]
        assert all(m.ok for m in pub.metrics)
        if on_close:
            assert steps == [0, 3, 6, 7] and pub.metrics[-1].kind == "delta"
            assert_fleet_serves(emu, pub.metrics[-1].identity, expected_sha(model))
        else:
            assert steps == [0, 3, 6]
            assert_fleet_serves(emu, pub.metrics[-1].identity, at_six)


def test_close_publishes_a_step_the_busy_publisher_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY, load_delay_s=0.3) as emu:
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"):
            with TensorPublisher(model, config(bucket, emu, tmp_path, busy_policy="skip")) as pub:
                started = []
                for step in range(4):
                    train_step(model, step)
                    started.append(pub.publish(step, model))
        assert started[0] and not started[-1], started  # step 3 came while step 0 was still loading
        assert "close() waits for 1 snapshot(s) in flight" in caplog.text
        assert "publishing step 3 at close (the newest published before it: step 0)" in caplog.text
        assert pub.metrics[-1].step == 3 and pub.metrics[-1].skipped_before >= 1
        assert all(m.ok for m in pub.metrics)
        assert_fleet_serves(emu, pub.metrics[-1].identity, expected_sha(model))


@pytest.mark.parametrize("how", ["with", "finally"])
def test_closing_on_an_exception_publishes_nothing_more(tmp_path: Path, how: str) -> None:
    """The weights may be half updated when an exception leaves the ``with`` block, or while one propagates
    through a ``finally`` that calls close()."""
    model = make_model()
    cfg = config(str(tmp_path / "bucket"), None, tmp_path, publish_every=3, busy_policy="wait")

    def train(pub: TensorPublisher) -> None:
        for step in range(5):
            train_step(model, step)
            pub.publish(step, model)
        raise RuntimeError("loss diverged")

    with pytest.raises(RuntimeError, match="diverged"):
        if how == "with":
            with TensorPublisher(model, cfg) as pub:
                train(pub)
        else:
            pub = TensorPublisher(model, cfg)
            try:
                train(pub)
            finally:
                pub.close()
    assert pub.engine.closed and [m.step for m in pub.metrics] == [0, 3]


@pytest.mark.parametrize("kind", ["TensorPublisher", "HotloadCallback"])
def test_a_with_block_that_ends_cleanly_inside_an_except_clause_publishes_its_newest_step(
        tmp_path: Path, kind: str) -> None:
    """close() read sys.exc_info(), which inside an except clause names the exception being handled: a clean
    exit of the with block there ("retry with a smaller batch") was taken for a failure, the newest step was left
    out, and with several ranks this rank skipped the vote the others waited on."""
    from fsdp_hotload import HotloadCallback

    model = make_model()
    module = torch.nn.Linear(8, 8)
    cfg = config(str(tmp_path / "bucket"), None, tmp_path, publish_every=3, busy_policy="wait")
    try:
        raise MemoryError("out of memory: retrying with a smaller batch")
    except MemoryError:
        with (TensorPublisher(model, cfg) if kind == "TensorPublisher" else HotloadCallback(module, cfg)) as pub:
            for step in range(5):
                if isinstance(pub, TensorPublisher):
                    train_step(model, step)
                    pub.publish(step, model)
                else:
                    with torch.no_grad():
                        module.weight.add_(0.01)
                    pub.step(step)
    assert [m.step for m in pub.metrics] == [0, 3, 4] and all(m.ok for m in pub.metrics)


def test_a_view_at_the_same_address_is_not_taken_for_the_construction_tensor(tmp_path: Path) -> None:
    """A row and a column of one matrix start at the same address: publish() must copy the row it was given."""
    bucket = str(tmp_path / "bucket")
    w = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    pub = TensorPublisher({"w": w[:, 0]}, config(bucket, None, tmp_path, snapshot_dtype="float32"))
    pub.publish(0, {"w": w[0, :]})
    pub.close()
    rebuilt = rebuild_accepted(bucket, pub.metrics)[pub.metrics[0].identity]
    assert rebuilt["w"].digest() == RawTensor.from_any(w[0, :].contiguous()).digest()


def test_close_calls_the_function_publish_was_given(tmp_path: Path) -> None:
    """A function passed as the sources is called again at close, never replaced by the chunks' own tensors."""
    bucket = str(tmp_path / "bucket")
    n = 1024
    placeholder, live = torch.zeros(n), torch.zeros(n)
    cfg = config(bucket, None, tmp_path, snapshot_dtype="float32", publish_every=2, busy_policy="wait")
    chunk = WholeChunk("w", (n,), "F32", "flat", Box.flat(0, n), placeholder)
    pub = Publisher([chunk], [TensorSpec("w", (n,), "F32")], cfg)
    for step in range(4):
        live.fill_(step + 1)
        pub.publish(step, lambda: [live])
    pub.close()
    records = pub.metrics.records
    assert [m.step for m in records] == [0, 2, 3]
    rebuilt = rebuild_accepted(bucket, records)[records[-1].identity]
    assert rebuilt["w"].digest() == RawTensor.from_any(live).digest()


def test_tensors_given_to_publish_must_be_given_to_close(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A gathered copy passed to publish() may be freed or reused once it returns: close() publishes the newest
    step only from tensors it is given, and says why when it is not."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, publish_every=2, busy_policy="wait")
        pub = TensorPublisher(model, cfg)
        for step in range(4):
            train_step(model, step)
            pub.publish(step, {k: v.clone() for k, v in model.items()})
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            pub.close()
        assert [m.step for m in pub.metrics] == [0, 2]
        assert "step 3 is not published at close: publish() was given its tensors" in caplog.text

        pub = TensorPublisher(model, cfg)
        for step in range(4, 8):
            train_step(model, step)
            pub.publish(step, {k: v.clone() for k, v in model.items()})
        pub.close({k: v.clone() for k, v in model.items()})
        assert [m.step for m in pub.metrics] == [4, 6, 7] and all(m.ok for m in pub.metrics)
        assert_fleet_serves(emu, pub.metrics[-1].identity, expected_sha(model))


def test_close_from_another_thread_publishes_nothing_more(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The training thread may still be changing the weights."""
    model = make_model()
    pub = TensorPublisher(model, config(str(tmp_path / "bucket"), None, tmp_path, publish_every=3, busy_policy="wait"))
    for step in range(5):
        train_step(model, step)
        pub.publish(step, model)
    closer = threading.Thread(target=pub.close)
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        closer.start()
        closer.join(60)
    assert pub.engine.closed and [m.step for m in pub.metrics] == [0, 3]
    assert "another thread than the training steps" in caplog.text


def test_close_adds_nothing_when_the_newest_step_was_published(tmp_path: Path) -> None:
    model = make_model()
    pub = TensorPublisher(model, config(str(tmp_path / "bucket"), None, tmp_path, busy_policy="wait"))
    for step in range(3):
        train_step(model, step)
        pub.publish(step, model)
    pub.close()
    assert [m.step for m in pub.metrics] == [0, 1, 2]


class _FailFirstWeightWrite:
    """A filesystem whose first weight-file write is refused (not retried: max_attempts=1)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.failed = inner, False

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if "w" in mode and "safetensors" in str(path) and "index" not in str(path) and not self.failed:
            self.failed = True
            raise PermissionError(13, "injected", str(path))
        return self.inner.open(path, mode, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_close_publishes_the_step_whose_publish_raised_the_stored_error(tmp_path: Path) -> None:
    """In one process the stored error was raised before the step was recorded, so a last training step that
    raised it was never published at close, with no warning (with several ranks it was)."""
    import fsspec

    from fsdp_hotload.engine import PublishError
    from fsdp_hotload.storage import Storage

    bucket = str(tmp_path / "bucket")
    w = torch.zeros(4096)
    model = {"model.layers.0.w": w}
    storage = Storage(bucket, fs=_FailFirstWeightWrite(fsspec.filesystem("file")), max_attempts=1)
    pub = TensorPublisher(model, HotloadConfig(bucket_url=bucket), storage=storage)
    w.add_(1)
    pub.publish(0, model)
    pub.wait()
    w.add_(1)
    with pytest.raises(PublishError, match="injected"):
        pub.publish(1, model)  # the last training step
    pub.close()
    assert [(m.step, m.kind, m.ok) for m in pub.metrics] == [(0, "full", False), (1, "full", True)]
    from safetensors.torch import load_file

    (file,) = (tmp_path / "bucket" / pub.metrics[-1].identity).glob("model-*.safetensors")
    assert torch.equal(load_file(file)["model.layers.0.w"].view(torch.int16), w.bfloat16().view(torch.int16))


class _HangingWeightWrites:
    """A filesystem whose weight-file writes hang once ``armed``, until ``release`` is set (a stuck NFS mount)."""

    def __init__(self, inner: Any, hangs: Any = None) -> None:
        self.inner, self.armed = inner, False
        self.stuck, self.release = threading.Event(), threading.Event()
        # which written paths hang: by default the weight files
        self.hangs = hangs or (lambda path: "safetensors" in path and "index" not in path)

    def open(self, path: str, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if self.armed and "w" in mode and self.hangs(str(path)):
            self.stuck.set()
            self.release.wait(60)
        return self.inner.open(path, mode, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("how", ["config", "argument", "exception"])
def test_close_gives_up_on_a_hung_write_after_its_timeout(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          how: str) -> None:
    """close() without a deadline waited for a hung local write for ever; with one it raises, says where the
    snapshot was stuck, and the snapshot is never committed, even when the write returns later."""
    import time

    import fsspec

    from fsdp_hotload.engine import PublishError
    from fsdp_hotload.storage import Storage

    bucket = str(tmp_path / "bucket")
    fs = _HangingWeightWrites(fsspec.filesystem("file"))
    model = make_model()
    timeout = 0.5
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, close_timeout_s=3600 if how == "argument" else timeout,
                     progress_log_s=0.1)
        pub = TensorPublisher(model, cfg, storage=Storage(bucket, fs=fs))
        pub.publish(0, model)
        pub.wait()
        first = expected_sha(model)
        train_step(model, 1)
        fs.armed = True
        assert pub.publish(1, model)
        assert fs.stuck.wait(10)
        t0 = time.monotonic()
        gave_up = (r"close\(\) gave up after 0\.5 s \(close_timeout_s\) with 1 snapshot\(s\) still publishing on rank "
                   r"0: \S+ \(delta snapshot of step 1\) still publishing after [\d.]+ s: uploading for")
        with caplog.at_level(logging.ERROR, logger="fsdp_hotload"):
            if how == "exception":  # leaving a with block on an error: bounded too, and the error is the caller's
                with pytest.raises(RuntimeError, match="the trainer's own error"), pub:
                    raise RuntimeError("the trainer's own error")
            else:
                with pytest.raises(PublishError, match=gave_up):
                    pub.close(**({} if how == "config" else {"timeout": timeout}))
        took = time.monotonic() - t0
        assert timeout <= took < timeout + 5, took
        assert pub.engine.closed and pub.engine.abandoned
        assert re.search(gave_up, caplog.text), caplog.text
        reported = pub.engine._progress.lines
        assert reported > 0  # the stuck snapshot was reported while close() waited
        time.sleep(0.5)
        assert pub.engine._progress.lines == reported  # not after close() gave up on it
        pub.close()  # closed: a second call returns at once
        fs.release.set()  # the stuck write returns: the snapshot it belonged to is dropped, not committed
        assert pub.engine._thread is not None
        pub.engine._thread.join(30)
        assert not pub.engine._thread.is_alive()
        assert not [t.name for t in threading.enumerate() if t.name.startswith(("hotload-upload", "hotload-encode"))]
        assert [(m.step, m.ok) for m in pub.metrics] == [(0, True), (1, False)]
        assert "close() gave up on it" in (pub.metrics[-1].error or "")
        assert_fleet_serves(emu, pub.metrics[0].identity, first)
        assert sorted(p.name for p in Path(bucket).iterdir() if not p.name.startswith(".")) == [
            pub.metrics[0].identity]


def test_giving_up_on_a_slow_load_ends_the_readiness_wait(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """close(timeout=) on a snapshot whose load is slow returned, but left the publisher thread polling the
    deployment for up to ready_timeout_s (and holding its buffers and helper threads): now the wait is cancelled
    and the thread ends at once. The snapshot had been signalled: the fleet may still load it."""
    import time

    from fsdp_hotload.engine import PublishError

    bucket = str(tmp_path / "bucket")
    model = make_model()
    before = set(threading.enumerate())  # other tests' daemon threads may still be winding down
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        pub = TensorPublisher(model, config(bucket, emu, tmp_path, ready_timeout_s=120))
        pub.publish(0, model)
        pub.wait()
        emu.set_load_delay(60)
        train_step(model, 1)
        assert pub.publish(1, model)
        deadline = time.monotonic() + 20
        while pub.engine._prog.step != 1 or "signalling" not in pub.engine._prog.describe(time.perf_counter()):
            assert time.monotonic() < deadline, "the snapshot was never signalled"
            time.sleep(0.02)
        with caplog.at_level(logging.ERROR, logger="fsdp_hotload"):
            with pytest.raises(PublishError, match="still publishing .*signalling"):
                pub.close(timeout=0.3)
        t0 = time.monotonic()
        assert pub.engine._thread is not None
        pub.engine._thread.join(10)
        assert not pub.engine._thread.is_alive(), "the publisher thread still waits for the deployment"
        assert time.monotonic() - t0 < 5
        assert [(m.step, m.ok) for m in pub.metrics] == [(0, True), (1, False)]
        assert "cancelled" in (pub.metrics[-1].error or "")
        left = set(threading.enumerate()) - before
        assert not [t.name for t in left if t.name.startswith(("hotload-signal", "hotload-upload"))]


@pytest.mark.parametrize("kind", ["tensors", "callback"])
def test_a_publisher_dropped_without_close_is_collected_and_its_threads_end(tmp_path: Path, kind: str) -> None:
    """A notebook or a sweep that makes a publisher per run and forgets close(): each one used to keep its staging
    buffer, cache and about a dozen threads until the process exited, since its thread held it. Now the thread
    holds it only while publishing: dropped, it is collected, and its threads end."""
    import gc
    import time
    import weakref

    from fsdp_hotload import HotloadCallback

    before = {t.ident for t in threading.enumerate()}
    with HotLoadEmulator(str(tmp_path / "bucket"), replicas=1, api_key=API_KEY) as emu:
        cfg = config(str(tmp_path / "bucket"), emu, tmp_path, progress_log_s=0.05, busy_policy="wait")
        if kind == "tensors":
            model = make_model()
            pub: Any = TensorPublisher(model, cfg)
            for step in range(2):
                train_step(model, step)
                pub.publish(step, model)
                pub.wait()
        else:
            net = torch.nn.Linear(8, 4)
            pub = HotloadCallback(net, cfg)
            for step in range(2):
                with torch.no_grad():
                    net.weight.add_(0.1)
                pub.step(step)
                pub.wait()
        assert [m.ok for m in pub.metrics] == [True, True]
        engine = weakref.ref(pub.engine)
        del pub
        gc.collect()
        assert engine() is None, gc.get_referrers(engine())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("hotload")
                    and not t.name.startswith("hotload-emulator")]
            if not left:
                break
            time.sleep(0.05)
        assert not left, left


def test_a_publisher_dropped_with_snapshots_queued_publishes_them_first(tmp_path: Path) -> None:
    """publish() said each of these snapshots started. Its thread held the publisher only while it handled one, so
    a publisher dropped with a snapshot still queued behind the running one was collected in between, and that
    snapshot never reached the bucket, without a word (the exit warning no longer saw the publisher either)."""
    import gc
    import time

    from fsdp_hotload.retention import list_committed
    from fsdp_hotload.storage import Storage

    bucket = str(tmp_path / "bucket")
    model = make_model()
    cfg = config(bucket, None, tmp_path, busy_policy="wait", max_inflight=2)

    def train() -> None:  # forgets close(): the publisher is dropped on return
        pub = TensorPublisher(model, cfg)
        for step in range(3):
            train_step(model, step)
            assert pub.publish(step, model)

    before = {t.ident for t in threading.enumerate()}
    train()
    gc.collect()
    deadline = time.monotonic() + 30
    while (left := [t.name for t in threading.enumerate() if t.ident not in before
                    and t.name.startswith("hotload-publisher")]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left  # then collected all the same: its thread ended
    assert [c.identity.split("-")[1] for c in list_committed(Storage(bucket))] == ["000000", "000001", "000002"]


@pytest.mark.parametrize("kind", ["tensors", "callback"])
def test_close_frees_the_staging_slots_and_the_cache(tmp_path: Path, kind: str) -> None:
    """A closed publisher kept its staging slots and cache (twice the rank's shard, device memory on a GPU
    trainer) for as long as anything held it: a ``with`` block's name, a trainer attribute, or ``cb`` while a new
    callback is built after a resharding, when both callbacks' buffers were held at once."""
    import gc
    import weakref

    from fsdp_hotload import HotloadCallback

    cfg = config(str(tmp_path / "bucket"), None, tmp_path, busy_policy="wait", max_inflight=2)
    if kind == "tensors":
        model = make_model()
        pub: Any = TensorPublisher(model, cfg)
        for step in range(3):
            train_step(model, step)
            pub.publish(step, model)
    else:
        net = torch.nn.Linear(64, 32)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        pub = HotloadCallback(net, cfg)
        pub.attach(opt)  # the background copy of a CPU trainer: its last job stays the one to fence
        for _ in range(3):
            net(torch.randn(4, 64)).sum().backward()
            opt.step()
    pub.wait()
    stager = pub.engine.stager
    assert stager.cache is not None and stager.free_slots() == 2
    buffers = [weakref.ref(b) for b in (*stager._free, stager.cache)]
    pub.close()
    gc.collect()
    assert [r() is None for r in buffers] == [True] * 3, "a closed publisher still holds its buffers"
    assert [m.ok for m in pub.metrics] == [True] * 3
    with pytest.raises(RuntimeError, match="closed"):
        pub.engine.publish(3)


def test_a_watchdogs_close_gives_up_on_time_while_the_trainer_waits_for_a_slot(tmp_path: Path) -> None:
    """With the wait policy a trainer whose snapshot is stuck (a hung write) waits in publish() for the slot; a
    watchdog's close(timeout=) then waited for that publish, for as long as the write hung, instead of giving up
    after its timeout. It must give up on time, and the trainer's publish must stop waiting and raise."""
    import time

    import fsspec

    from fsdp_hotload.engine import PublishError
    from fsdp_hotload.storage import Storage

    bucket = str(tmp_path / "bucket")
    fs = _HangingWeightWrites(fsspec.filesystem("file"))
    model = make_model()
    pub = TensorPublisher(model, config(bucket, None, tmp_path, busy_policy="wait"), storage=Storage(bucket, fs=fs))
    pub.publish(0, model)
    pub.wait()
    fs.armed = True
    assert pub.publish(1, model)
    assert fs.stuck.wait(10)
    trainer_error: list[BaseException] = []

    def train() -> None:
        try:
            pub.publish(2, model)  # waits for step 1's slot
        except BaseException as exc:  # noqa: BLE001 - checked below
            trainer_error.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    time.sleep(0.2)
    unstick = threading.Timer(20, fs.release.set)  # the write returns at last (only a failing run gets here)
    unstick.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(PublishError, match="gave up after 0.5 s"):
            pub.close(timeout=0.5)
        assert time.monotonic() - t0 < 5, "close() waited for the trainer's publish, past its timeout"
        trainer.join(5)
        assert not trainer.is_alive(), "the trainer still waits for a slot of a closed publisher"
        assert len(trainer_error) == 1 and "closed" in str(trainer_error[0]), trainer_error
        assert pub.engine.closed and pub.engine.abandoned
    finally:
        fs.release.set()
        unstick.cancel()
        trainer.join(30)
    assert pub.engine._thread is not None
    pub.engine._thread.join(30)
    assert not pub.engine._thread.is_alive()
    assert [(m.step, m.ok) for m in pub.metrics] == [(0, True), (1, False)]


@pytest.mark.parametrize("close", [True, False], ids=["close-gave-up", "no-close"])
def test_a_process_ending_while_the_commit_write_hangs_exits(close: bool) -> None:
    """dist_scripts/exit_during_commit.py: the commit's small files were written on a ThreadPoolExecutor, whose
    workers the interpreter joins at exit, so a trainer whose write hung (a stuck mount, a store that never
    answers) never exited, after close() gave up or without close(), and before the exit warning was shown.
    Daemon workers let it exit; the snapshot is dropped."""
    import subprocess
    import sys

    from tests.dist_util import SCRIPTS

    args = [sys.executable, str(SCRIPTS / "exit_during_commit.py"), *([] if close else ["--no-close"])]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process did not exit: {exc.stdout!r} {exc.stderr!r}")
    assert done.returncode == 0 and "returning from main" in done.stdout, (done.stdout, done.stderr)
    if close:
        assert "close raised PublishError" in done.stdout and "close() gave up after 1 s" in done.stderr
    else:
        assert "exiting with 1 snapshot(s) still publishing on rank 0 and close() never called" in done.stderr


def test_close_without_raising_says_why_a_stored_error_was_not_raised(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """close(raise_errors=False) with no exception on its way out logged the stored error as "not raised: closing
    on another error", which sent the reader looking for an error that was never there."""
    import fsspec

    from fsdp_hotload.storage import Storage

    bucket = str(tmp_path / "bucket")
    w = torch.zeros(4096)
    model = {"model.layers.0.w": w}
    storage = Storage(bucket, fs=_FailFirstWeightWrite(fsspec.filesystem("file")), max_attempts=1)
    pub = TensorPublisher(model, HotloadConfig(bucket_url=bucket), storage=storage)
    pub.publish(0, model)
    pub.wait()
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        pub.close(raise_errors=False)
    assert "a publish failed before close (not raised: close(raise_errors=False)): " in caplog.text
    assert "injected" in caplog.text and "closing on another error" not in caplog.text
