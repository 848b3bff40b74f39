"""Edges of the publisher's bookkeeping: timeouts no lock accepts, a cold kernel cache at close(), and the counts a
snapshot published at close reports. Real local-folder bucket; the bytes each case publishes are read back and
compared with the trainer's. The helpers here are shared with test_publisher_threads.py."""
from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.engine.exits import deadline_after
from fsdp_hotload.publish import TensorPublisher
from tests.snapshots import rebuild_accepted
from tests.publisher_helpers import hf_dir


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g), "model.norm.weight": torch.ones(32)}


def _config(tmp_path: Path, **kw: object) -> HotloadConfig:
    return HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(hf_dir(tmp_path)), **kw)


def _bf16_bytes(model: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.bfloat16().view(torch.int16).numpy().tobytes() for k, v in model.items()}


def _assert_bucket_serves(bucket: str, pub: TensorPublisher, model: dict[str, torch.Tensor]) -> None:
    """The newest accepted snapshot, rebuilt from the bucket as the fleet would, holds the trainer's bytes."""
    got = rebuild_accepted(bucket, pub.metrics)[pub.metrics[-1].identity]
    assert {k: bytes(v.data) for k, v in got.items()} == _bf16_bytes(model)


@pytest.mark.parametrize("timeout", [math.inf, 1e12])
def test_close_and_wait_take_a_timeout_beyond_what_a_lock_accepts(tmp_path: Path, timeout: float) -> None:
    """``close(timeout=math.inf)`` raised OverflowError from the lock and left the publisher open."""
    bucket = str(tmp_path / "bucket")
    model = _model()
    pub = TensorPublisher(model, _config(tmp_path))
    pub.publish(0)
    pub.wait(timeout)
    pub.close(timeout=timeout)
    assert pub.engine.closed and not pub.engine._thread.is_alive()
    assert [(m.step, m.ok) for m in pub.metrics] == [(0, True)]
    _assert_bucket_serves(bucket, pub, model)
    with pytest.raises(ValueError, match="NaN"):
        deadline_after(math.nan)


def test_close_keeps_its_timeout_while_the_kernels_still_compile(tmp_path: Path) -> None:
    """A cold numba cache compiles for seconds on a background thread; close() joined it with no limit, past
    ``close_timeout_s``."""
    pub = TensorPublisher(_model(), _config(tmp_path))
    release = threading.Event()
    compiling = threading.Thread(target=release.wait, args=(60,), daemon=True)  # stands in for the compile
    compiling.start()
    pub.engine._warm_up = compiling
    t0 = time.monotonic()
    try:
        pub.close(timeout=0.5)
        took = time.monotonic() - t0
    finally:
        release.set()
    assert pub.engine.closed
    assert took < 30, f"close(timeout=0.5) took {took:.1f} s waiting for the compile"


def test_a_step_published_at_close_is_not_counted_as_skipped(tmp_path: Path) -> None:
    """The newest step, skipped while busy and then published at close, counted itself in ``skipped_before``."""
    from fsdp_hotload.emulator import HotLoadEmulator

    bucket = str(tmp_path / "bucket")
    model = _model()
    with HotLoadEmulator(bucket, replicas=1, api_key="k", load_delay_s=0.4) as emu:
        cfg = HotloadConfig(bucket_url=bucket, hotload_api_url=emu.url, api_key="k", account_id="a",
                            model_id="m", deployment_id="d", poll_interval_s=0.02, busy_policy="skip",
                            hf_config_dir=str(hf_dir(tmp_path)))
        started = []
        with TensorPublisher(model, cfg) as pub:
            for step in range(4):
                model["model.norm.weight"].add_(0.25)
                started.append(pub.publish(step))
    assert started == [True, False, False, False]
    assert [(m.step, m.ok, m.skipped_before) for m in pub.metrics] == [(0, True, 0), (3, True, 2)]
    _assert_bucket_serves(bucket, pub, model)


def test_a_failed_readiness_wait_reports_its_time(tmp_path: Path) -> None:
    """A snapshot whose load failed on a replica was recorded with ``signal_s`` and ``ready_s`` 0: minutes of a
    readiness timeout showed only in ``total_s``. The next publish is full and served bit-exact."""
    from fsdp_hotload.emulator import HotLoadEmulator

    bucket = str(tmp_path / "bucket")
    model = _model()
    with HotLoadEmulator(bucket, replicas=2, api_key="k") as emu:
        emu.fail_next_loads(1, replica=1)
        cfg = _config(tmp_path, hotload_api_url=emu.url, api_key="k", account_id="a", model_id="m",
                      deployment_id="d", poll_interval_s=0.02, busy_policy="wait", keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(2):
                model["model.norm.weight"].add_(0.25)
                pub.publish(step)
                pub.wait()
    (failed, ok) = pub.metrics
    assert not failed.ok and failed.signal_s > 0 and failed.ready_s == 0.0, failed
    assert failed.total_s >= failed.signal_s
    assert ok.ok and ok.kind == "full"
    _assert_bucket_serves(bucket, pub, model)


def test_close_says_so_when_the_newest_step_failed_and_training_went_on(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """With ``keep_training_on_error`` the last step's failed publish was only one warning among many: close()
    now says which step the fleet ends on. The step is not published again (its identity may be in the fleet)."""
    from fsdp_hotload.emulator import HotLoadEmulator

    bucket = str(tmp_path / "bucket")
    model = _model()
    with HotLoadEmulator(bucket, replicas=2, api_key="k") as emu:
        cfg = _config(tmp_path, hotload_api_url=emu.url, api_key="k", account_id="a", model_id="m",
                      deployment_id="d", poll_interval_s=0.02, busy_policy="wait", keep_training_on_error=True)
        with caplog.at_level("WARNING", logger="fsdp_hotload"):
            with TensorPublisher(model, cfg) as pub:
                pub.publish(0)
                pub.wait()
                served = _bf16_bytes(model)
                emu.fail_next_loads(1, replica=1)
                model["model.norm.weight"].add_(0.25)
                pub.publish(1)
    assert [(m.step, m.ok) for m in pub.metrics] == [(0, True), (1, False)]
    assert "the newest step 1 failed to publish (keep_training_on_error); the fleet ends on step 0" in caplog.text
    got = rebuild_accepted(bucket, pub.metrics)[pub.metrics[0].identity]
    assert {k: bytes(v.data) for k, v in got.items()} == served


def test_a_commit_stuck_past_closes_deadline_is_never_committed(tmp_path: Path) -> None:
    """close() gave up while the small files were being written; when the write returned, the commit marker was
    still written (the give-up was read once, before), so a snapshot dropped by close() appeared in the bucket."""
    import fsspec

    from fsdp_hotload.engine import PublishError
    from fsdp_hotload.retention import read_commit_marker
    from fsdp_hotload.storage import Storage

    bucket = str(tmp_path / "bucket")
    from tests.test_close import _HangingWeightWrites

    # a write stuck after every weight file was uploaded, while the snapshot's small files are written
    fs = _HangingWeightWrites(fsspec.filesystem("file"), hangs=lambda path: "spec.json" in path)
    model = _model()
    storage = Storage(bucket, fs=fs)
    pub = TensorPublisher(model, _config(tmp_path, busy_policy="wait"), storage=storage)
    pub.publish(0)
    pub.wait()
    fs.armed = True
    model["model.norm.weight"].add_(0.25)
    assert pub.publish(1)
    assert fs.stuck.wait(10)
    with pytest.raises(PublishError, match="close\\(\\) gave up"):
        pub.close(timeout=0.3)
    fs.release.set()
    pub.engine._thread.join(30)
    assert not pub.engine._thread.is_alive()
    assert [(m.step, m.ok) for m in pub.metrics] == [(0, True), (1, False)]
    assert "close() gave up on it" in (pub.metrics[-1].error or "")
    assert read_commit_marker(storage, pub.metrics[-1].identity) is None
    assert sorted(p.name for p in Path(bucket).iterdir() if not p.name.startswith(".")) == [pub.metrics[0].identity]


def test_metrics_fields_hold_the_values_they_name(tmp_path: Path) -> None:
    """Each field against what it names, measured independently: weight bytes on disk, elements changed by the
    trainer, steps the trainer went on while a snapshot loaded, the emulator's load delay."""
    import os

    from fsdp_hotload.emulator import HotLoadEmulator

    bucket = str(tmp_path / "bucket")
    model = _model()
    elements = sum(t.numel() for t in model.values())
    with HotLoadEmulator(bucket, replicas=1, api_key="k", load_delay_s=0.4) as emu:
        cfg = _config(tmp_path, hotload_api_url=emu.url, api_key="k", account_id="a", model_id="m",
                      deployment_id="d", poll_interval_s=0.02, busy_policy="skip", publish_on_close=False)
        with TensorPublisher(model, cfg) as pub:
            assert pub.publish(0)
            for step in (1, 2, 3):  # while step 0 loads: skipped, and the trainer is 3 steps ahead when it is served
                assert not pub.publish(step)
            pub.wait()
            w = model["model.layers.0.mlp.up_proj.weight"].view(-1)
            w[torch.tensor([0, 5, 99, 100, 1000, 2000, 2047])] += 1.0  # 7 elements, each a different bf16 value
            assert pub.publish(4)
            pub.wait()
    full, delta = pub.metrics
    files = pub.engine.plan.files
    for m in (full, delta):
        on_disk = sum(os.path.getsize(Path(bucket) / m.identity / f) for f in files)
        assert m.ok and m.bytes_written == on_disk and m.files == len(files)
        assert m.raw_bytes == 2 * elements and m.ratio == m.raw_bytes / m.bytes_written
        assert m.upload_mb_s == pytest.approx(m.bytes_written / 1e6 / m.upload_s)
        assert m.ready_s >= 0.3 and m.signal_s > 0 and m.total_s >= m.ready_s + m.signal_s
    assert (full.kind, full.changed_fraction, full.staleness_steps, full.skipped_before) == ("full", None, 3, 0)
    assert (delta.kind, delta.changed_fraction, delta.staleness_steps, delta.skipped_before) == (
        "delta", 7 / elements, 0, 3)
    _assert_bucket_serves(bucket, pub, model)


@pytest.mark.parametrize("keep_last, warned", [(1, True), (2, False), (None, False)])
def test_keep_last_1_without_a_hot_load_api_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            keep_last: int | None, warned: bool) -> None:
    """With nothing to say what readers use, keep_last=1 deletes a snapshot as the next one commits, under a
    reader still downloading it."""
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        TensorPublisher(_model(), _config(tmp_path, keep_last=keep_last)).close()
    assert ("keep_last=1 without hotload_api_url" in caplog.text) is warned


def test_tensor_publisher_warns_about_names_and_dtypes_the_base_checkpoint_disagrees_with(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A state dict published as given: an ``lm_head.weight`` of its own the base does not have (the fleet refuses
    every snapshot), and a bias the base keeps in F32 (DeepSeek-V3's routing bias) published as BF16, rounded.
    Both were silent; both are named at start. The bytes are still published as asked."""
    from safetensors.torch import save_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama", "tie_word_embeddings": true}')
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
               "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(8, dtype=torch.float32)},
              str(base / "model.safetensors"))
    emb = torch.randn(8, 4)
    model = {"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone(),
             "model.layers.0.mlp.gate.e_score_correction_bias": torch.randn(8)}
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(base))
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        TensorPublisher(model, cfg).close()
    assert "'lm_head.weight'" in caplog.text
    assert ("1 tensor(s) the base checkpoint stores as a wider float are published narrower (e.g. "
            "'model.layers.0.mlp.gate.e_score_correction_bias': F32 there, BF16 published)") in caplog.text
    caplog.clear()
    keep = HotloadConfig(bucket_url=str(tmp_path / "bucket2"), hf_config_dir=str(base),
                         dtype_overrides={"*.e_score_correction_bias": "keep"})
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        TensorPublisher({k: v for k, v in model.items() if k != "lm_head.weight"}, keep).close()
    assert "narrower" not in caplog.text and "lm_head" not in caplog.text


def test_an_all_f32_base_checkpoint_published_as_bf16_is_not_warned_about(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint kept all in F32 (gpt2's) published as BF16 is the config's choice, not a tensor kept wide."""
    from safetensors.torch import save_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "gpt2"}')
    model = {"h.0.attn.c_attn.weight": torch.randn(4, 12), "h.0.ln_1.bias": torch.randn(4)}
    save_file({k: v.clone() for k, v in model.items()}, str(base / "model.safetensors"))
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        TensorPublisher(model, HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(base))).close()
    assert "narrower" not in caplog.text and "base checkpoint" not in caplog.text


def test_other_one_byte_floats_round_trip_as_trained(tmp_path: Path) -> None:
    """AMD's fp8 (the FNUZ formats) and the E8M0 block scales of MXFP8 checkpoints were unknown to the format:
    a model holding them could not publish at all. They keep their dtype, bytes for bytes, through a full
    snapshot and a delta; the safetensors header spells them as safetensors does."""
    import json

    import safetensors

    if not all(hasattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")):
        pytest.skip(f"torch {torch.__version__} lacks one of these dtypes")
    g = torch.Generator().manual_seed(7)
    raw = {n: torch.randint(0, 256, (16, 8), generator=g, dtype=torch.uint8) for n in ("a", "b", "c")}
    raw["a"][raw["a"] == 0x80] = 0  # 0x80 is the FNUZ formats' one NaN: any other byte is a number
    dtypes = {"a": torch.float8_e4m3fnuz, "b": torch.float8_e5m2fnuz, "c": torch.float8_e8m0fnu}
    names = {"a": "model.layers.0.mlp.up_proj.weight", "b": "model.layers.0.mlp.down_proj.weight",
             "c": "model.layers.0.mlp.up_proj.weight_scale"}
    model = {names[k]: raw[k].view(dtypes[k]) for k in raw}
    model["model.norm.weight"] = torch.ones(8)
    with TensorPublisher(model, _config(tmp_path, busy_policy="wait")) as pub:
        pub.publish(0, model)
        for k in raw:
            raw[k][3, 2:5] += 1  # the trainer's update, in place
        raw["a"][raw["a"] == 0x80] = 1
        pub.publish(1, model)
    assert [(m.kind, m.ok) for m in pub.metrics] == [("full", True), ("delta", True)]
    served = rebuild_accepted(tmp_path / "bucket", pub.metrics)[pub.metrics[1].identity]
    for k, name in names.items():
        assert served[name].to_torch().dtype == dtypes[k]
        assert served[name].data.tobytes() == raw[k].numpy().tobytes(), name
    headers: dict[str, dict[str, object]] = {}
    for full in (tmp_path / "bucket" / pub.metrics[0].identity).glob("model-*.safetensors"):
        with safetensors.safe_open(str(full), "np"):  # the reference reader takes each file
            blob = full.read_bytes()
        headers.update(json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")]))
    assert [headers[names[k]]["dtype"] for k in raw] == ["F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0"]


@pytest.mark.parametrize("dtype", ["float4_e2m1fn_x2", "F4"])
def test_elements_smaller_than_a_byte_are_refused_with_what_to_do(dtype: str) -> None:
    from fsdp_hotload.arc import FormatError
    from fsdp_hotload.arc.dtypes import code_from_name, itemsize

    with pytest.raises(FormatError, match="smaller than a byte.*as U8"):
        itemsize(code_from_name(dtype))


def test_a_publishs_retries_and_throttles_count_on_failure_and_at_the_commit(tmp_path: Path) -> None:
    """The one publish that failed for throttling reported no throttle and no retry: the counts were read after the
    first failed file's error was raised. And the commit marker's retries, written after the uploads' count was
    taken, counted for no publish at all. Injected at the filesystem: every attempt at one weight file is throttled,
    then one attempt at the marker."""
    import fsspec

    from fsdp_hotload.storage import Storage
    from tests.s3_fixture import FaultyFileSystem, slowdown_error

    bucket = str(tmp_path / "bucket")
    faulty = FaultyFileSystem(fsspec.filesystem("file"))
    storage = Storage(bucket, fs=faulty, max_attempts=3, base_backoff_s=0.001, max_backoff_s=0.002,
                      throttle_backoff_s=0.001)
    g = torch.Generator().manual_seed(0)
    model = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(64, 64, generator=g) for i in range(2)}
    pub = TensorPublisher(model, _config(tmp_path, keep_training_on_error=True), storage=storage)  # a file per layer
    seen = []
    for step, (fails, match) in enumerate([(3, "model-00002"), (1, "hotload.commit.json")]):
        faulty.arm(fails, exc_factory=slowdown_error, match=match)
        before = storage.stats.snapshot()
        pub.publish(step)
        pub.wait(30)
        after = storage.stats.snapshot()
        seen.append((after["throttled"] - before.get("throttled", 0), after["retries"] - before.get("retries", 0)))
    pub.close(timeout=30)
    failed, committed = pub.metrics
    assert seen == [(3, 2), (1, 1)]
    assert (failed.ok, failed.throttled, failed.retries) == (False, 3, 2) and failed.upload_s > 0
    assert (committed.ok, committed.throttled, committed.retries) == (True, 1, 1)
    _assert_bucket_serves(bucket, pub, model)


def test_a_relative_metrics_path_stays_where_it_was_when_the_directory_changes(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The bucket's path was made absolute at the start and the metrics file's was not: after a chdir the
    records went to another file, in the new directory."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    model = _model()
    cfg = HotloadConfig(bucket_url="bucket", metrics_path="metrics.jsonl", busy_policy="wait")
    with TensorPublisher(model, cfg) as pub:
        pub.publish(0, model)
        pub.wait()
        monkeypatch.chdir(tmp_path / "sub")
        model["model.norm.weight"] += 1
        pub.publish(1, model)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and not (tmp_path / "sub" / "metrics.jsonl").exists()


def test_retention_runs_beside_the_next_snapshot_and_counts_in_no_figure(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention (keep_last) ran inside the snapshot's outcome: the slot stayed taken while old snapshots were
    deleted, so the trainer skipped those steps, and staleness was read after the deletes (10 steps for a snapshot
    served 70 ms after its hook). Now it runs on a thread of its own once the fleet serves the snapshot: the next
    step stages and is served while it runs, and wait() and close() wait for it."""
    import fsdp_hotload.retention as retention
    from tests.publisher_helpers import config, make_model

    bucket = str(tmp_path / "bucket")
    model = make_model()
    pub = TensorPublisher(model, config(bucket, None, tmp_path, keep_last=2, publish_on_close=False))
    entered, release = threading.Event(), threading.Event()
    real = retention.retain_after

    def slow_retention(*args: object, **kwargs: object) -> None:
        pub.engine.latest_step += 7  # the trainer moves on while old snapshots are deleted
        entered.set()
        assert release.wait(30)
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(retention, "retain_after", slow_retention)
    try:
        assert pub.publish(0, model)
        assert entered.wait(30)
        model["model.norm.weight"].add_(1.0)
        assert pub.publish(10, model), "the step after a served snapshot was skipped while retention ran"
        deadline = time.monotonic() + 30
        while len(pub.metrics) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(pub.metrics) == 2, "the next snapshot waited for retention"
        with pytest.raises(TimeoutError, match="retention"):
            pub.wait(timeout=0.2)
    finally:
        release.set()
        pub.wait()
        pub.close()
    assert [(m.ok, m.staleness_steps) for m in pub.metrics] == [(True, 0), (True, 0)]
    assert {k: t.digest() for k, t in rebuild_accepted(bucket, pub.metrics)[pub.metrics[1].identity].items()} == \
        {k: RawTensor.from_any(v.bfloat16() if v.is_floating_point() else v).digest() for k, v in model.items()}


def test_uploads_never_wait_for_a_slow_hint_endpoint(tmp_path: Path) -> None:
    """Hints were sent on the upload workers, so each hint's round trip held back that worker's next upload. Here
    the hint endpoint (a real HTTP server in front of the emulator) answers a hint only once every file of its
    snapshot is in the bucket, or after 5 s: the uploads must all land while the hints are held, every hint is
    still delivered, after its file, and the fleet serves the trainer's bytes."""
    from fsdp_hotload.emulator import HotLoadEmulator
    from tests.http_fixture import forwarding
    from tests.publisher_helpers import API_KEY, config, expected_sha, served

    bucket = tmp_path / "bucket"
    g = torch.Generator().manual_seed(9)
    model = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(32, 16, generator=g) for i in range(6)}
    held: list[bool] = []  # per hint: whether every file of its snapshot was there when it was answered

    def hold(body: bytes) -> None:
        identity = json.loads(body)["snapshot"]["identity"]
        end = time.monotonic() + 5
        while len(list((bucket / identity).glob("*.safetensors"))) < len(model) and time.monotonic() < end:
            time.sleep(0.02)
        held.append(len(list((bucket / identity).glob("*.safetensors"))) == len(model))

    with HotLoadEmulator(str(bucket), replicas=1, api_key=API_KEY) as emu:
        with forwarding(emu.url, hold) as url:
            cfg = config(str(bucket), emu, tmp_path, hotload_api_url=url, upload_concurrency=2, busy_policy="wait")
            with TensorPublisher(model, cfg) as pub:
                for step in range(2):
                    for t in model.values():
                        t[step].add_(1.0)
                    pub.publish(step)
                    pub.wait(60)
        (dep,) = emu.state()["deployments"].values()
        assert served(emu) == [(pub.metrics[-1].identity, expected_sha(model))]
    assert [m.ok for m in pub.metrics] == [True, True]
    assert len(held) == 2 * len(model) and all(held)
    assert len(dep["hints"]) == 2 * len(model) and all(h["file_present"] for h in dep["hints"])


def test_a_failed_publish_reports_how_far_the_fleet_trails(tmp_path: Path) -> None:
    """A failed snapshot was never served, so its record's staleness is the trainer's step minus the step the
    fleet still serves (it read 0, "fresh", exactly when the fleet fell behind)."""
    from fsdp_hotload.emulator import HotLoadEmulator
    from tests.publisher_helpers import API_KEY, config, make_model, train_step

    model = make_model()
    with HotLoadEmulator(str(tmp_path / "bucket"), replicas=2, api_key=API_KEY) as emu:
        cfg = config(str(tmp_path / "bucket"), emu, tmp_path, full_every=100, keep_training_on_error=True,
                     publish_on_close=False)
        with TensorPublisher(model, cfg) as pub:
            for step in range(4):
                train_step(model, step)
                if step == 2:
                    emu.fail_next_loads(1)  # on each replica
                assert pub.publish(step, model)
                pub.wait()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["ok"], r["staleness_steps"]) for r in lines] == [
        (0, True, 0), (1, True, 0), (2, False, 1), (3, True, 0)], lines


def test_the_metrics_file_survives_a_torn_line_and_a_failing_disk(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A line cut short by a killed trainer made the next record unreadable too; a write that fails must not
    hide the publish's summary, and is warned about once, not at every publish."""
    from fsdp_hotload.engine.metrics import MetricsSink, PublishMetrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "identity": "cut sh')
    sink = MetricsSink(str(path))
    sink.record(PublishMetrics(1, "step-1", "full", ok=True, bytes_written=10))
    lines = path.read_text().splitlines()
    assert lines[0] == '{"step": 0, "identity": "cut sh' and json.loads(lines[1])["step"] == 1
    path.unlink()
    path.mkdir()  # appending now fails
    with caplog.at_level("INFO", logger="fsdp_hotload"):
        for step in (2, 3):
            sink.record(PublishMetrics(step, f"step-{step}", "delta", ok=False, error="boom", staleness_steps=2))
    text = [r.getMessage() for r in caplog.records]
    assert sum("FAILED (fleet 2 steps behind): boom" in t for t in text) == 2, text
    assert sum("could not append the metrics" in t for t in text) == 1, text
    assert [m.step for m in sink.records] == [1, 2, 3]


def test_a_publish_ended_by_a_failed_collective_still_gets_a_record(tmp_path: Path) -> None:
    """A side-group collective that fails (a dead peer, a gloo timeout) ended the publish without a metrics line,
    though its files were uploaded: the file simply stopped at the previous publish."""
    from fsdp_hotload.engine.comm import LocalComm
    from tests.publisher_helpers import make_model, train_step

    class DyingComm(LocalComm):
        statuses = 0

        def gather(self, obj: object) -> list[object] | None:
            if type(obj).__name__ == "RankStatus":
                DyingComm.statuses += 1
                if DyingComm.statuses == 2:
                    raise RuntimeError("[gloo] Connection closed by peer")
            return super().gather(obj)

    model = make_model()
    pub = TensorPublisher(model, _config(tmp_path, keep_training_on_error=True,
                                         metrics_path=str(tmp_path / "metrics.jsonl")), comm=DyingComm())
    for step in range(3):
        train_step(model, step)
        pub.publish(step, model)
        pub.wait()
    pub.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["ok"]) for r in lines] == [(0, True), (1, False)], lines
    assert "Connection closed by peer" in lines[1]["error"] and lines[1]["identity"].startswith("step-000001")
    assert lines[1]["kind"] == "delta" and lines[1]["staleness_steps"] == 1 and lines[1]["total_s"] > 0
