"""Progress reports of long publishes: real publisher, real emulator over HTTP, real (slowed) storage; and a
replica's load error quoted in a progress line without the API key (the Signaller against a real HTTP server)."""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import fsspec
import pytest

from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.engine.progress import ProgressLog
from fsdp_hotload.engine.signal import Signaller
from fsdp_hotload.fireworks import HotLoadClient
from fsdp_hotload.publish import TensorPublisher
from fsdp_hotload.storage import Storage
from tests.http_fixture import serve
from tests.s3_fixture import FaultyFileSystem
from tests.publisher_helpers import API_KEY, config, expected_sha, make_model, served, train_step

REPORT = "still publishing after"


def reports(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if REPORT in r.getMessage()]


def test_a_slow_load_reports_each_deployments_replicas_and_the_trainers_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fsdp_hotload")
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY, load_delay_s=1.5) as emu:
        cfg = config(bucket, emu, tmp_path, progress_log_s=0.4)
        with TensorPublisher(model, cfg) as pub:
            assert pub.publish(0, model)
            time.sleep(0.8)
            train_step(model, 1)
            assert not pub.publish(1, model)  # busy: the skip policy moves on, and the report says how far
            pub.wait()
            identity = pub.metrics[-1].identity
            n = len(reports(caplog))
            time.sleep(0.9)
            assert len(reports(caplog)) == n, "a finished publish is still reported"
            assert pub.metrics[-1].ok and [i for i, _ in served(emu)] == [identity] * 2
        # close() published the skipped step 1: the fleet ends on the final weights
        assert served(emu)[0][1] == expected_sha(model)
    lines = reports(caplog)
    # This publish's own lines: those of the one close() starts name this identity too (as what replicas serve).
    waiting = [s for s in lines if s.startswith(f"hotload: {identity} ") and "waiting until every replica" in s]
    assert waiting, lines
    assert re.search(r"full snapshot of step 0\) still publishing after \d+(\.\d)? s", waiting[0])  # 12 s past 10 s
    assert re.search(r"/dep: 0/2 replicas serve it \(replica 0: current=None .*target='"
                     + identity, waiting[0]), waiting[0]
    assert re.search(r"this rank wrote (\d+)/\1 files, [\d.]+ KB in \d+(\.\d)? s", waiting[0]), waiting[0]
    assert any("the trainer is at step 1" in s for s in waiting), waiting
    # once a second, never more often than the interval: the 1.5 s load gives a handful, not dozens
    assert 2 <= len(waiting) <= 6, lines


def test_a_slow_upload_reports_the_files_and_bytes_written(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    caplog.set_level(logging.INFO, logger="fsdp_hotload")
    bucket = str(tmp_path / "bucket")
    slow = FaultyFileSystem(fsspec.filesystem("file"), delay_s=0.3)
    storage = Storage(bucket, fs=slow)
    model = make_model()
    cfg = config(bucket, None, tmp_path, progress_log_s=0.25, upload_concurrency=1)
    with TensorPublisher(model, cfg, storage=storage) as pub:
        assert pub.publish(0, model)
        pub.wait()
        files = len(pub.engine.plan.files)
    assert files >= 3 and pub.metrics[-1].ok
    uploads = [s for s in reports(caplog) if ": uploading for " in s]
    assert uploads, reports(caplog)
    counts = [re.search(r"this rank wrote (\d+)/(\d+) files, (\d+(?:\.\d)?) (B|KB|MB)", s) for s in uploads]
    assert all(c is not None and int(c.group(2)) == files for c in counts), uploads
    done = [int(c.group(1)) for c in counts if c is not None]
    assert done == sorted(done) and done[0] < files, uploads  # reported while under way, counting up
    assert any(int(c.group(1)) > 0 and float(c.group(3)) > 0 for c in counts if c is not None), uploads


def test_short_publishes_and_a_disabled_report_log_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    caplog.set_level(logging.INFO, logger="fsdp_hotload")
    model = make_model()
    for interval in (30.0, None):
        bucket = str(tmp_path / f"bucket-{interval}")
        slow = FaultyFileSystem(fsspec.filesystem("file"), delay_s=0.2 if interval is None else 0.0)
        cfg = config(bucket, None, tmp_path, progress_log_s=interval, upload_concurrency=1)
        with TensorPublisher(model, cfg, storage=Storage(bucket, fs=slow)) as pub:
            for step in range(3):
                train_step(model, step)
                pub.publish(step, model)
                pub.wait()
            assert pub.engine._progress.interval_s == interval  # None stays None: no default interval behind it
        assert all(m.ok for m in pub.metrics)
    assert reports(caplog) == []


def test_a_failing_report_is_logged_and_the_reports_go_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="fsdp_hotload")
    calls = []

    def trainer_step() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return 7

    rep = ProgressLog(0.1, trainer_step=trainer_step)
    p = rep.begin("step-000005-abcd0123", "delta", 5, time.perf_counter())
    p.stage("uploading", files=2)
    p.file_written(3_500_000)
    time.sleep(0.45)
    rep.end()
    rep.close()
    assert any("could not report" in r.getMessage() and r.exc_info for r in caplog.records)
    lines = reports(caplog)
    assert lines and rep.lines == len(lines)
    assert "this rank wrote 1/2 files, 3.5 MB" in lines[0] and "the trainer is at step 7" in lines[0], lines


def test_a_publish_that_ends_while_its_report_is_being_made_is_not_reported(caplog: pytest.LogCaptureFixture
                                                                             ) -> None:
    """The report thread took the publish under the lock, then read the trainer's step and logged outside it: a
    publish that ended in between was still reported, after end() (and the publisher's wait()) had returned."""
    caplog.set_level(logging.INFO, logger="fsdp_hotload")
    reading, go_on = threading.Event(), threading.Event()

    def trainer_step() -> int:
        reading.set()
        go_on.wait(10)
        return 7

    rep = ProgressLog(0.1, trainer_step=trainer_step)
    rep.begin("step-000001-abcd0123", "delta", 1, time.perf_counter())
    assert reading.wait(10)  # a report is being made
    rep.end()
    go_on.set()
    time.sleep(0.3)
    rep.close()
    assert reports(caplog) == [] and rep.lines == 0


def test_the_interval_is_validated_by_name() -> None:
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="progress_log_s"):
            HotloadConfig(bucket_url="/tmp/b", progress_log_s=bad)
    assert HotloadConfig(bucket_url="/tmp/b").progress_log_s == 30.0


def test_progress_lines_do_not_quote_the_api_key_from_a_replicas_error() -> None:
    """A replica's load error is the server's own text, and may quote a request, header and all. The client's
    errors were redacted, but the progress line took the text as it came."""
    from fsdp_hotload.engine.progress import PublishProgress

    key = "fw-secret-0123456789"
    polls: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self._reply({"status": "ok"})

        def do_GET(self) -> None:  # noqa: N802
            polls.append(1)
            stale = {"current_snapshot_identity": "s0", "readiness": True, "loading_state": {
                "stage": "error", "target_snapshot_identity": "old",
                "error": f"fetch refused: Authorization: Bearer {key}"}}
            ready = {"current_snapshot_identity": "s1", "readiness": True, "loading_state": {"stage": "done"}}
            self._reply({"replicas": [stale if len(polls) <= 3 else ready]})

        def _reply(self, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    progress = PublishProgress("s1", "full", step=1, t0=time.perf_counter())
    lines: list[str] = []

    def on_poll(deployment: str, status: Any, redact: Any) -> None:
        progress.polled(deployment, status, redact)
        lines.append(progress.describe(time.perf_counter()))

    with serve(Handler) as url:
        client = HotLoadClient(url, account_id="a", model_id="m", deployment_id="d", api_key=key,
                               poll_interval_s=0.02)
        sig = Signaller([client], ready_timeout_s=10)
        try:
            sig.signal_and_wait("s1", None, on_poll=on_poll)
        finally:
            sig.close()
    stale_lines = [s for s in lines if "fetch refused" in s]
    assert stale_lines, lines  # the replica's error is still told, without the key
    assert all(key not in s and "<redacted>" in s for s in stale_lines), stale_lines
