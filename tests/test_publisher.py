"""The framework-free publisher end to end: real storage (local folder, moto S3), real emulator over HTTP."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from fsdp_hotload.arc import save_file
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.engine import PublishError
from fsdp_hotload.publish import TensorPublisher
from fsdp_hotload.retention import read_commit_marker
from fsdp_hotload.storage import Storage
from tests.publisher_helpers import API_KEY, config, expected_sha, hf_dir, make_model, served, train_step
from tests.s3_fixture import FaultyFileSystem, slowdown_error

@pytest.mark.parametrize("backend", ["local", "s3"])
def test_thirty_publishes_served_bit_exact(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if backend == "s3":
        s3 = request.getfixturevalue("s3_server")
        bucket, opts = s3.unique_uri("pub"), s3.storage_options
    else:
        bucket, opts = str(tmp_path / "bucket"), {}
    model = make_model()
    base = hf_dir(tmp_path)  # the base model's folder, as on the Hub: config, tokenizer and weights
    (base / "model.safetensors").write_bytes(save_file({k: RawTensor.from_any(v) for k, v in model.items()}))
    # every full snapshot must match the base model's config and tensor shapes, one layer per file
    with HotLoadEmulator(bucket, storage_options=opts, replicas=2, api_key=API_KEY, base_model=base) as emu:
        cfg = config(bucket, emu, tmp_path, storage_options=opts, full_every=10)
        with TensorPublisher(model, cfg) as pub:
            for step in range(30):
                train_step(model, step)
                assert pub.publish(step, model)
                pub.wait()
                want = expected_sha(model)
                for identity, shas in served(emu):
                    assert identity == pub.metrics[-1].identity
                    assert shas == want, f"step {step}: replica serves other bytes"
        kinds = [m.kind for m in pub.metrics]
    assert kinds == (["full"] + ["delta"] * 9) * 3
    assert all(m.ok for m in pub.metrics)
    deltas = [m for m in pub.metrics if m.kind == "delta"]
    assert all(m.bytes_written < m.raw_bytes for m in deltas)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 30 and json.loads(lines[1])["kind"] == "delta"
    storage = Storage(bucket, opts)
    info = read_commit_marker(storage, pub.metrics[1].identity)
    assert info is not None and info.kind == "delta" and info.parent_identity == pub.metrics[0].identity
    names = set(storage.list(pub.metrics[1].identity))
    assert {f"{pub.metrics[1].identity}/{n}" for n in ("config.json", "tokenizer_config.json",
                                                       "model.safetensors.index.json", "model.weight.spec.json",
                                                       "hotload.commit.json")} <= names


def test_emulator_load_failure_forces_full_and_recovers(tmp_path: Path) -> None:
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(6):
                train_step(model, step)
                if step == 2:
                    emu.fail_next_loads(1, replica=1)
                pub.publish(step, model)
                pub.wait()
                ok = pub.metrics[-1].ok
                for identity, shas in served(emu):
                    # whatever a replica serves is a complete, verified snapshot: the current one when ok
                    if ok:
                        assert shas == expected_sha(model)
        kinds = [(m.kind, m.ok) for m in pub.metrics]
    assert kinds == [("full", True), ("delta", True), ("delta", False), ("full", True), ("delta", True),
                     ("delta", True)]


def test_failed_upload_is_never_signalled_and_next_is_full(tmp_path: Path) -> None:
    bucket = str(tmp_path / "bucket")
    faulty = FaultyFileSystem(fsspec.filesystem("file"))
    storage = Storage(bucket, fs=faulty, max_attempts=2, base_backoff_s=0.001, max_backoff_s=0.002)
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100)
        pub = TensorPublisher(model, cfg, storage=storage)
        pub.publish(0, model)
        pub.wait()
        first = pub.metrics[-1].identity
        faulty.arm(2, match="model-00002")  # both attempts of one publish
        train_step(model, 1)
        pub.publish(1, model)
        pub.wait()
        failed = pub.metrics[-1]
        assert not failed.ok and "model-00002" in (failed.error or "")
        assert [i for i, _ in served(emu)] == [first]
        (dep,) = emu.state()["deployments"].values()
        assert [row["identity"] for row in dep["ledger"]] == [first]  # never signalled
        assert not storage.exists(f"{failed.identity}/hotload.commit.json")
        assert storage.list(failed.identity) == []  # the files that did upload are gone too
        with pytest.raises(PublishError, match="upload failed"):
            pub.publish(2, model)  # the stored error surfaces on the next call
        train_step(model, 2)
        pub.publish(3, model)
        pub.wait()
        pub.close()
        assert pub.metrics[-1].kind == "full" and pub.metrics[-1].ok
        assert served(emu)[0][1] == expected_sha(model)


def test_with_the_wait_policy_an_error_is_raised_by_the_publish_that_waited_for_it(tmp_path: Path) -> None:
    """The publish that waits for a slot raises the error of the snapshot that held it, instead of staging and
    raising one publish later. Ranks wait for the same snapshot, so they all raise at the same step: a rank
    that staged where another raised would pair two different steps in one snapshot."""
    bucket = str(tmp_path / "bucket")
    faulty = FaultyFileSystem(fsspec.filesystem("file"), exc_factory=lambda: PermissionError("denied"),
                              delay_s=0.1)
    storage = Storage(bucket, fs=faulty, max_attempts=1)
    model = make_model()
    pub = TensorPublisher(model, config(bucket, None, tmp_path, busy_policy="wait"), storage=storage)
    pub.publish(0, model)
    pub.wait()
    faulty.arm(1, match="model-00002")
    train_step(model, 1)
    pub.publish(1, model)  # its upload fails (slowly) in the background
    train_step(model, 2)
    with pytest.raises(PublishError, match="upload failed"):
        pub.publish(2, model)  # waits for the slot, then raises rather than staging step 2
    assert pub.engine.stager.free_slots() == 1  # the slot it waited for is given back
    pub.wait()
    assert [m.step for m in pub.metrics] == [0, 1]
    pub.publish(3, model)
    pub.close()
    assert [(m.step, m.kind, m.ok) for m in pub.metrics] == [(0, "full", True), (1, "delta", False), (3, "full", True)]


def test_exiting_without_close_says_what_was_dropped(tmp_path: Path) -> None:
    """The publisher's threads are daemons, so a script that never calls close() loses its last snapshot at
    exit: that must be said, not silent. Nor may the exit wait for it: the upload pool's workers used to be
    joined at exit, so a slow bucket or an unreachable fleet held the process for minutes."""
    script = f"""
import sys, fsspec, torch
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.publish import TensorPublisher
from fsdp_hotload.storage import Storage
from tests.s3_fixture import FaultyFileSystem
model = {{"w": torch.randn(64, 64)}}
storage = Storage(sys.argv[1], fs=FaultyFileSystem(fsspec.filesystem("file"), delay_s=float(sys.argv[3])))
pub = TensorPublisher(model, HotloadConfig(bucket_url=sys.argv[1]), storage=storage)
pub.publish(0, model)
if sys.argv[2] == "close":
    pub.close()
if sys.argv[2] == "blocked":  # close() waits on a write that does not return; the process ends anyway
    import threading, time
    threading.Thread(target=pub.close, daemon=True).start()
    time.sleep(1)
"""
    cases = (("exit", 3600), ("close", 1), ("blocked", 3600))  # an hour's write must not hold the exit
    procs = {how: subprocess.Popen([sys.executable, "-c", script, str(tmp_path / how), how, str(delay_s)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for how, delay_s in cases}  # side by side: each spends most of its time importing torch
    for how, proc in procs.items():
        try:
            _, stderr = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 0, stderr
        warned = "1 snapshot(s) still publishing on rank 0 and close() never called" in stderr
        assert warned == (how == "exit"), stderr
        blocked = "1 snapshot(s) still publishing on rank 0 while close() waits for them" in stderr
        assert blocked == (how == "blocked"), stderr


def test_exit_waits_for_the_codec_warm_up(tmp_path: Path) -> None:
    """A script that ends while the codec's kernels are still loading must wait for them: a daemon thread inside
    torch or numba native code at interpreter shutdown aborted the process (status 134, "terminate called
    without an active exception") in about one exit in six. The warm-up here takes 1 s and leaves a mark."""
    mark = tmp_path / "warmed"
    script = f"""
import sys, time, torch
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from fsdp_hotload.arc import codecs
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.publish import TensorPublisher
def slow_warm_up(self):
    time.sleep(1.0)
    open({str(mark)!r}, "w").close()
codecs.ArcV2.warm_up = slow_warm_up
TensorPublisher({{"w": torch.randn(8)}}, HotloadConfig(bucket_url={str(tmp_path / "bucket")!r}))
"""
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert mark.exists()


def test_throttling_is_retried_and_counted(tmp_path: Path) -> None:
    bucket = str(tmp_path / "bucket")
    faulty = FaultyFileSystem(fsspec.filesystem("file"), fail_puts=2, exc_factory=slowdown_error,
                              match="model-00001")
    storage = Storage(bucket, fs=faulty, base_backoff_s=0.001, throttle_backoff_s=0.002, max_backoff_s=0.01)
    model = make_model()
    with TensorPublisher(model, config(bucket, None, tmp_path), storage=storage) as pub:
        pub.publish(0, model)
        pub.wait()
    m = pub.metrics[-1]
    assert m.ok and m.throttled == 2 and m.retries >= 2


def test_restart_starts_with_full(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A restarted trainer's first snapshot is full, and its log says what the deployment served before it (the
    earlier run's snapshot)."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    last = ""  # the identity the deployment serves when the second run starts
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        for run in range(2):
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="fsdp_hotload"), \
                    TensorPublisher(model, config(bucket, emu, tmp_path)) as pub:
                for step in range(3):
                    train_step(model, 10 * run + step)
                    pub.publish(step, model)
                    pub.wait()
            assert [m.kind for m in pub.metrics] == ["full", "delta", "delta"]
            assert served(emu)[0][1] == expected_sha(model)
            said = [r.getMessage() for r in caplog.records if "is up (1 replica(s))" in r.getMessage()]
            before = "serving no snapshot yet" if run == 0 else f"serving {last} (another run)"
            assert said == [f"hotload: deployment accounts/acct/deployments/dep is up (1 replica(s)), {before}; "
                            f"signalling {pub.metrics[0].identity}"], said
            last = pub.metrics[-1].identity


def test_publish_without_tensors_reads_non_contiguous_tensors_again(tmp_path: Path) -> None:
    """A transposed view or a strided array cannot be flattened in place, so its chunk holds a copy made at
    construction. ``publish(step)`` and the final publish of ``close()`` must still serve the values the trainer
    holds at that step, byte for byte, not the construction ones."""
    from tests.snapshots import rebuild_accepted

    bucket = str(tmp_path / "bucket")
    base = torch.zeros(48, 32)
    arr = np.zeros((16, 24), dtype=np.float32)
    tensors: dict[str, Any] = {"model.layers.0.mlp.up_proj.weight": base.t(),  # non-contiguous torch view
                               "model.layers.0.self_attn.q_proj.weight": arr[:, ::2],  # strided numpy array
                               "model.norm.weight": torch.ones(32)}  # contiguous: read in place, as before
    assert not tensors["model.layers.0.mlp.up_proj.weight"].is_contiguous()
    expected: list[dict[str, str]] = []
    cfg = config(bucket, None, tmp_path, busy_policy="wait", full_every=3, publish_every=2)
    with TensorPublisher(tensors, cfg) as pub:
        for step in range(6):
            base.add_(float(step + 1))
            arr += np.float32(0.5)
            tensors["model.norm.weight"].mul_(1.5)
            if pub.publish(step):
                expected.append(expected_sha({k: torch.as_tensor(v) for k, v in tensors.items()}))
            pub.wait()
        assert len(expected) == 3  # steps 0, 2 and 4; step 5 is left to close()
        expected.append(expected_sha({k: torch.as_tensor(v) for k, v in tensors.items()}))
    assert [m.step for m in pub.metrics] == [0, 2, 4, 5] and all(m.ok for m in pub.metrics)
    assert "delta" in [m.kind for m in pub.metrics]
    rebuilt = rebuild_accepted(bucket, pub.metrics)
    got = [{k: t.digest() for k, t in rebuilt[m.identity].items()} for m in pub.metrics]
    assert got == expected


def test_busy_policy_skip_and_wait(tmp_path: Path) -> None:
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY, load_delay_s=0.3) as emu:
        with TensorPublisher(model, config(bucket, emu, tmp_path, busy_policy="skip")) as pub:
            started = [pub.publish(s, model) for s in range(5)]
            pub.wait()
        assert started[0] and not all(started)
        assert pub.metrics[-1].ok
        with TensorPublisher(model, config(bucket, emu, tmp_path, busy_policy="wait")) as pub:
            started = [pub.publish(s, model) for s in range(3)]
            pub.wait()
        assert all(started) and [m.ok for m in pub.metrics] == [True] * 3


def test_several_deployments_follow_one_chain(tmp_path: Path) -> None:
    """Two rollout pools read one bucket; each gets deltas against what it serves; a failure in one makes the next
    publish full for both."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, deployment_id=["pool-us", "pool-eu"], keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(5):
                train_step(model, step)
                if step == 2:
                    emu.fail_next_loads(1)
                pub.publish(step, model)
                pub.wait()
                state = emu.state()["deployments"]
                assert set(state) == {"accounts/acct/deployments/pool-us", "accounts/acct/deployments/pool-eu"}
                if pub.metrics[-1].ok:
                    for dep in state.values():
                        (rep,) = dep["replicas"]
                        assert rep["identity"] == pub.metrics[-1].identity
                        assert {k: t["digest"] for k, t in rep["tensors"].items()} == expected_sha(model)
    assert [(m.kind, m.ok) for m in pub.metrics] == [("full", True), ("delta", True), ("delta", False),
                                                    ("full", True), ("delta", True)]


def test_bookkeeping_errors_after_a_served_snapshot_keep_the_chain(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The metrics file turning unwritable, or retention meeting an unreadable marker, happen after the fleet
    serves a snapshot: they are logged, the snapshot stands, and later deltas still carry every change (the
    cache must not be handed out again as a free slot)."""
    bucket = str(tmp_path / "bucket")
    metrics = tmp_path / "metrics.jsonl"
    model = make_model()
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY) as emu:
        cfg = config(bucket, emu, tmp_path, full_every=100, keep_last=2, metrics_path=str(metrics))
        with TensorPublisher(model, cfg) as pub:
            for step in range(6):
                train_step(model, step)
                if step == 1:
                    metrics.unlink()
                    metrics.mkdir()  # appending to the metrics file now fails
                if step == 3:
                    metrics.rmdir()
                    bad = Path(bucket) / "step-000999-0badf00d"
                    bad.mkdir()
                    (bad / "hotload.commit.json").write_text("{not json")  # retention cannot read this marker
                pub.publish(step, model)
                pub.wait()
                assert served(emu)[0] == (pub.metrics[-1].identity, expected_sha(model))
    assert [(m.kind, m.ok) for m in pub.metrics] == [("full", True)] + [("delta", True)] * 5
    assert all(m.changed_fraction for m in pub.metrics[1:])
    messages = [r.getMessage() for r in caplog.records]
    assert sum("could not append the metrics" in t for t in messages) == 1  # steps 1 and 2: warned once
    assert any("retention after" in t for t in messages)


@pytest.mark.parametrize("attempts", [1, 3])
def test_storage_attempts_is_how_often_a_refused_write_is_tried(attempts: int, tmp_path: Path) -> None:
    """The retry budget was fixed at 6 tries (~6 s of a refused endpoint, less than a MinIO restart takes), so
    such an outage failed the publish and made the next one full. ``storage_attempts`` sets it."""
    from tests.dist_util import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every connection is refused
    cfg = config("s3://bkt/run", None, tmp_path, storage_attempts=attempts, busy_policy="wait",
                 storage_options={"endpoint_url": endpoint, "key": "k", "secret": "s"})
    model = make_model()
    pub = TensorPublisher(model, cfg)
    pub.publish(0, model)
    pub.wait()
    with pytest.raises(PublishError, match=f"after {attempts} attempts"):
        pub.close()
    stats = pub.engine.storage.stats  # every call failed (the files, then the cleanup), each after that many tries
    assert stats.failures >= 1 and stats.retries == (attempts - 1) * stats.failures
    assert [(m.step, m.ok) for m in pub.metrics] == [(0, False)]


def test_a_failed_copy_gives_its_slot_back(tmp_path: Path) -> None:
    """A source that raises while staging reaches the caller, and its slot is free again: with one slot and the
    wait policy, a leaked slot would block the next publish for ever."""
    model = make_model()
    cfg = config(str(tmp_path / "bucket"), None, tmp_path, busy_policy="wait", max_inflight=1)
    with TensorPublisher(model, cfg) as pub:
        pub.publish(0, model)

        def broken() -> list[torch.Tensor]:
            raise RuntimeError("parameter storage was freed")

        with pytest.raises(RuntimeError, match="storage was freed"):
            pub.engine.publish(1, broken)
        train_step(model, 2)
        assert pub.publish(2, model)
        pub.wait(timeout=30)
    assert [(m.step, m.kind, m.ok) for m in pub.metrics] == [(0, "full", True), (2, "delta", True)]


def test_lossy_casts_and_unused_dtype_globs_are_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An fp16 model under the default bf16 snapshot dtype would lose mantissa bits in silence, and a misspelt
    glob, or one listed after a broader glob that takes all its tensors (the first match wins), would leave its
    tensors in another dtype: all are said at construction. fp32 masters cast to bf16 (the expected path) and
    tensors an override keeps as trained are not (fp32 counts as masters where most tensors are fp32)."""
    tensors = {"a.weight": torch.randn(4, dtype=torch.float16), "b.weight": torch.randn(4, dtype=torch.float16),
               "kept.weight": torch.randn(4, dtype=torch.float16), "master.weight": torch.randn(4),
               "model.layers.0.e_score_correction_bias": torch.randn(4),
               **{f"master{i}.weight": torch.randn(4) for i in range(2)}}
    cfg = config(str(tmp_path / "bucket"), None, tmp_path,
                 dtype_overrides={"kept.*": "keep", "*.e_score_bias": "keep", "model.layers.*": "bfloat16",
                                  "*.e_score_correction_bias": "keep"})
    with caplog.at_level("WARNING", logger="fsdp_hotload"), TensorPublisher(tensors, cfg) as pub:
        assert pub.publish(0)
        pub.wait(timeout=30)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "dtype_overrides glob '*.e_score_bias' matches no floating tensor" in text
    assert "dtype_overrides glob '*.e_score_correction_bias' decides none of the 1 tensor(s) it matches (e.g. " \
           "'model.layers.0.e_score_correction_bias'): the earlier glob 'model.layers.*' takes them" in text
    assert "glob 'model.layers.*' decides" not in text and "glob 'kept.*' " not in text
    assert "2 float16 tensor(s) ('a.weight' and 1 more) are published as bfloat16" in text
    assert "kept.weight" not in text and "master.weight" not in text
    spec = json.loads(next((tmp_path / "bucket").glob("*/model.weight.spec.json")).read_text())["tensor_map"]
    assert {n: v["dtype"] for n, v in spec.items()} == {
        "a.weight": "bfloat16", "b.weight": "bfloat16", "kept.weight": "float16", "master.weight": "bfloat16",
        "model.layers.0.e_score_correction_bias": "bfloat16", "master0.weight": "bfloat16",
        "master1.weight": "bfloat16"}  # as the warning says


def test_steps_are_non_negative_integers_of_any_integer_type(tmp_path: Path) -> None:
    import numpy as np

    model = make_model()
    with TensorPublisher(model, config(str(tmp_path / "bucket"), None, tmp_path)) as pub:
        assert pub.publish(np.int64(0), model)
        for bad in (True, 1.5, -1, "3"):
            with pytest.raises(ValueError, match=f"non-negative integer, got {bad!r}"):
                pub.publish(bad, model)  # type: ignore[arg-type]
        pub.publish(np.int32(1), model)


def test_full_snapshot_files_carry_the_format_metadata_hf_loaders_expect(tmp_path: Path) -> None:
    """transformers before 4.48.2 reads ``metadata.get("format")`` unguarded: files without ``__metadata__``
    failed to load there. safetensors' own reader must see {"format": "pt"} and the trainer's bytes; each file's
    checksums, combined from the ranks' shares, must match its bytes."""
    from safetensors import safe_open

    from fsdp_hotload.arc.stio import CHECKSUM_KEY, load_file

    model = make_model()
    pub = TensorPublisher(model, config(str(tmp_path / "bucket"), None, tmp_path))
    pub.publish(0, model)
    pub.close()
    files = sorted((tmp_path / "bucket").glob("*/model-*.safetensors"))
    assert files
    seen = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata().keys() == {"format", CHECKSUM_KEY} and f.metadata()["format"] == "pt"
            for name in f.keys():
                want = model[name].to(torch.bfloat16) if model[name].is_floating_point() else model[name]
                assert torch.equal(f.get_tensor(name).view(torch.uint8), want.contiguous().view(torch.uint8))
                seen.add(name)
        load_file(path.read_bytes(), filename=path.name, require_checksums=True)
    assert seen == set(model)


def test_cadence_bounds_every_delta_chain() -> None:
    """max_chain_length deltas at most follow a full snapshot (and full_every publishes make one cycle); a failure
    makes the next publish full and leaves the accepted parent as it was."""
    from fsdp_hotload.engine.cadence import Cadence

    def kinds(c: Cadence, n: int) -> list[str]:
        out = []
        for i in range(n):
            k = c.next_kind()
            out.append(k)
            c.on_success(f"s{i}", k)
        return out

    assert kinds(Cadence(full_every=100, max_chain_length=2), 7) == ["full", "delta", "delta"] * 2 + ["full"]
    assert kinds(Cadence(full_every=3), 7) == ["full", "delta", "delta"] * 2 + ["full"]
    c = Cadence(full_every=100, max_chain_length=1)
    assert kinds(c, 2) == ["full", "delta"] and c.next_kind() == "full"
    c = Cadence(full_every=100)
    kinds(c, 2)
    c.on_failure()
    assert c.next_kind() == "full" and c.accepted == "s1"


@pytest.mark.parametrize("codec", ["arc_v2", "arc_sparse_v1"])
def test_diff_s_is_zero_where_no_separate_diff_runs(codec: str, tmp_path: Path) -> None:
    """On the host, arc_v2 diffs inside its one pass per chunk and a full snapshot has no diff: their ``diff_s`` in
    the metrics lines is 0, not the time of a branch that did nothing. arc_sparse_v1 diffs first, and that is timed."""
    model = make_model()
    cfg = config(str(tmp_path / "bucket"), None, tmp_path, codec=codec, full_every=3)
    with TensorPublisher(model, cfg) as pub:
        for step in range(4):
            train_step(model, step)
            assert pub.publish(step, model)
            pub.wait()
    lines = [json.loads(line) for line in Path(cfg.metrics_path).read_text().splitlines()]
    assert [r["kind"] for r in lines] == ["full", "delta", "delta", "full"]
    assert all(r["diff_s"] == 0.0 for r in lines if r["kind"] == "full"), lines
    deltas = [r["diff_s"] for r in lines if r["kind"] == "delta"]
    assert all(d == 0.0 for d in deltas) if codec == "arc_v2" else all(d > 0 for d in deltas), deltas
