"""carry_base_tensors: base tensors the trainer does not hold (DeepSeek-V3's MTP layer) ride along in every snapshot,
served bit for bit as the base checkpoint stores them, beside the trained tensors."""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fsdp_hotload.arc import save_file
from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.engine.carry import find_carried
from fsdp_hotload.engine.publisher import Publisher
from fsdp_hotload.layout import TensorSpec
from fsdp_hotload.publish import TensorPublisher, WholeChunk
from tests.publisher_helpers import API_KEY, config, expected_sha, hf_dir, make_model, served, train_step
from tests.thread_comm import Meeting, ThreadComm, run_ranks


def extra_tensors() -> dict[str, RawTensor]:
    """What the base checkpoint holds beyond the trainer's model: an MTP layer of mixed dtypes, as stored."""
    g = np.random.default_rng(7)
    return {
        "model.layers.2.eh_proj.weight": RawTensor.from_any(torch.randn(64, 128).bfloat16()),
        "model.layers.2.enorm.weight": RawTensor.from_any(torch.from_numpy(g.standard_normal(64).astype(np.float32))),
        "model.layers.2.mlp.gate.e_score_correction_bias": RawTensor.from_any(torch.arange(8, dtype=torch.float32)),
        "model.layers.2.mlp.experts.0.down_proj.weight": RawTensor(
            "F8_E4M3", (64, 32), g.integers(0, 255, 64 * 32, dtype=np.uint8)),
        "model.layers.2.empty": RawTensor.from_any(torch.empty(0, 4, dtype=torch.bfloat16)),
    }


def write_base(folder: Path, model: dict[str, torch.Tensor], *, sharded: bool) -> dict[str, str]:
    """The base checkpoint: the model's tensors (bf16, as they are served) plus :func:`extra_tensors`; returns the
    digests of the extra ones, the bytes the fleet must serve for them."""
    own = {k: RawTensor.from_any(v.bfloat16() if v.is_floating_point() else v) for k, v in model.items()}
    extra = extra_tensors()
    if sharded:
        (folder / "model-00001-of-00002.safetensors").write_bytes(save_file(own))
        (folder / "model-00002-of-00002.safetensors").write_bytes(save_file(extra))
        weight_map = {**dict.fromkeys(own, "model-00001-of-00002.safetensors"),
                      **dict.fromkeys(extra, "model-00002-of-00002.safetensors")}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        (folder / "model.safetensors").write_bytes(save_file({**own, **extra}))
    return {k: t.digest() for k, t in extra.items()}


@pytest.mark.parametrize("codec,sharded", [("arc_v2", True), ("arc_sparse_v1", False)])
def test_carried_base_tensors_are_served_bit_exact_through_fulls_and_deltas(tmp_path: Path, codec: str,
                                                                             sharded: bool) -> None:
    bucket = str(tmp_path / "bucket")
    model = make_model()
    base = hf_dir(tmp_path)
    carried = write_base(base, model, sharded=sharded)
    # the emulator checks every full snapshot against the base model's tensors, as the service does
    with HotLoadEmulator(bucket, replicas=2, api_key=API_KEY, base_model=base,
                         compression_formats=("arc_v2", "arc_sparse_v1")) as emu:
        cfg = config(bucket, emu, tmp_path, full_every=4, codec=codec, carry_base_tensors=["model.layers.2.*"])
        with TensorPublisher(model, cfg) as pub:
            assert sorted(t.name for t in pub.engine.carried) == sorted(carried)
            for step in range(9):
                train_step(model, step)
                assert pub.publish(step, model)
                pub.wait()
                assert pub.metrics[-1].ok, pub.metrics[-1]
                for identity, shas in served(emu):
                    assert identity == pub.metrics[-1].identity
                    assert shas == {**expected_sha(model), **carried}, f"step {step}"
        kinds = [m.kind for m in pub.metrics]
        deltas = [m for m in pub.metrics if m.kind == "delta"]
    assert kinds == ["full", "delta", "delta", "delta"] * 2 + ["full"]
    assert all(m.bytes_written < 0.5 * m.raw_bytes for m in deltas)


def test_without_carrying_the_base_model_check_refuses_every_full(tmp_path: Path) -> None:
    """The failure carrying prevents: the service refuses a full snapshot that lacks base tensors."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    base = hf_dir(tmp_path)
    write_base(base, model, sharded=True)
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY, base_model=base) as emu:
        cfg = config(bucket, emu, tmp_path, keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            pub.publish(0, model)
            pub.wait()
            assert not pub.metrics[-1].ok
            assert "model.layers.2" in (pub.metrics[-1].error or "")


def test_rank_0_writes_the_files_of_carried_tensors(tmp_path: Path) -> None:
    """Two ranks (threads with their own comms): rank 0 reads the base files, so it writes the carried tensors'
    file (their bytes never cross to another rank), while rank 1 still writes files of its own; every snapshot
    rebuilds bit for bit."""
    from tests.snapshots import rebuild_accepted

    bucket = str(tmp_path / "bucket")
    model = {k: v.bfloat16() if v.is_floating_point() else v for k, v in make_model().items()}
    base = hf_dir(tmp_path)
    carried = write_base(base, model, sharded=True)
    names = list(model)
    cfg = config(bucket, None, tmp_path, full_every=3, carry_base_tensors=["model.layers.2.*"], busy_policy="wait")
    meeting, ctrl_meeting = Meeting(2), Meeting(2)
    pubs: dict[int, Publisher] = {}
    barrier = threading.Barrier(2)

    def rank(r: int) -> None:
        mine = names[r::2]  # each rank holds whole tensors of its own: enough to route both ways
        chunks = [WholeChunk(n, tuple(model[n].shape), RawTensor.from_any(model[n]).dtype, "flat",
                             Box.flat(0, model[n].numel()), model[n].reshape(-1)) for n in mine]
        specs = [TensorSpec(n, tuple(model[n].shape), RawTensor.from_any(model[n]).dtype) for n in names]
        pub = Publisher(chunks, specs, cfg, comm=ThreadComm(meeting, r, 2), ctrl=ThreadComm(ctrl_meeting, r, 2))
        pubs[r] = pub
        for step in range(5):
            if r == 0:
                train_step(model, step)
            barrier.wait(timeout=60)  # trained before any rank copies its tensors
            pub.publish(step, [model[n].reshape(-1) for n in mine])
            pub.wait()
            barrier.wait(timeout=60)
        pub.close()

    run_ranks(rank, 2)
    p0 = pubs[0]
    carried_file = p0.plan.file_of("model.layers.2.eh_proj.weight")
    assert p0.owners[carried_file] == 0 and 1 in p0.owners.values()
    assert pubs[1].owners == p0.owners
    assert [m.kind for m in p0.metrics.records] == ["full", "delta", "delta", "full", "delta"]
    assert all(m.ok for m in p0.metrics.records)
    rebuilt = rebuild_accepted(bucket, p0.metrics.records)
    for m in p0.metrics.records:
        got = {k: t.digest() for k, t in rebuilt[m.identity].items()}
        assert {k: got[k] for k in carried} == carried


def test_find_carried_names_what_is_wrong(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    base = hf_dir(tmp_path)
    write_base(base, model, sharded=True)
    published = {k: "BF16" for k in model}
    found = find_carried(str(base), ["model.layers.2.e*", "model.layers.0.*"], published)  # layer 0 is published
    assert [t.name for t in found] == ["model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight",
                                       "model.layers.2.empty"]
    with pytest.raises(ValueError, match=r"carry_base_tensors: 'model.layer.2.\*' matches no tensor .*"
                                         r"base tensors not published: 'model.layers.2"):
        find_carried(str(base), ["model.layer.2.*"], published)
    caplog.set_level(logging.INFO, logger="fsdp_hotload")
    assert find_carried(str(base), ["model.norm.*"], published) == []
    assert "nothing to carry" in caplog.text
    caplog.clear()
    find_carried(str(base), ["*experts*"], published)  # no quantization_config: a warning only
    assert "are F8_E4M3 as the checkpoint stores them" in caplog.text
    config = base / "config.json"
    config.write_text(json.dumps({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ValueError, match=r"carry_base_tensors: 1 carried tensor\(s\) are quantized \(e.g. "
                                         r"'model.layers.2.mlp.experts.0.down_proj.weight': F8_E4M3\).* has a "
                                         r"quantization_config"):
        find_carried(str(base), ["*experts*"], published)
    # a trainer that publishes quantized tensors itself keeps the config for its own: carrying changes nothing
    assert len(find_carried(str(base), ["*experts*"], {**published, "x.weight": "F8_E4M3"})) == 1

    shard = base / "model-00002-of-00002.safetensors"
    good = shard.read_bytes()
    shard.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 123\n")
    with pytest.raises(ValueError, match="Git LFS pointer"):
        find_carried(str(base), ["model.layers.2.*"], published)
    shard.write_bytes(good[:-3])
    with pytest.raises(ValueError, match="cannot be read as a whole safetensors file"):
        find_carried(str(base), ["model.layers.2.*"], published)
    shard.unlink()
    with pytest.raises(ValueError, match="cannot read"):
        find_carried(str(base), ["model.layers.2.*"], published)
    index = base / "model.safetensors.index.json"
    good_index = index.read_text()
    for outside in ("../elsewhere/model-00002-of-00002.safetensors", str(tmp_path / "x.safetensors")):
        weight_map = {**json.loads(good_index)["weight_map"], "model.layers.2.enorm.weight": outside}
        index.write_text(json.dumps({"weight_map": weight_map}))  # its bytes would be read and uploaded
        with pytest.raises(ValueError, match=r"maps tensors to .*, a file outside"):
            find_carried(str(base), ["model.layers.2.*"], published)
    (base / "model.safetensors.index.json").unlink()
    with pytest.raises(ValueError, match="holds no base weights"):
        find_carried(str(base), ["model.layers.2.*"], published)


def test_carried_tensors_are_read_when_their_file_is_written_and_leave_nothing_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full snapshot reads each carried tensor straight into its file's buffer as that is assembled, and closes
    the base file: mapping them kept a descriptor per tensor (DeepSeek-V3's MTP layer: ~800, past the usual limit
    of 1024), and a file truncated under a full was a SIGBUS. A changed file fails the full before anything is
    written. A relative hf_config_dir survives a chdir."""
    from fsdp_hotload.arc.codecs import get_codec
    from fsdp_hotload.engine.carry import Carrier

    base = tmp_path / "hf"
    base.mkdir()
    many = {f"mtp.{i}.weight": RawTensor.from_any(torch.full((3, 5), float(i))) for i in range(300)}
    (base / "model.safetensors").write_bytes(save_file(many))
    monkeypatch.chdir(tmp_path)
    found = find_carried("hf", ["mtp.*"], {})
    monkeypatch.chdir("/")
    carrier = Carrier(found, get_codec("arc_v2"))
    before = len(os.listdir("/proc/self/fd"))
    pieces = list(carrier.pieces("full"))
    assert all(callable(p[4]) for p in pieces)  # nothing read yet
    datas = [np.full(t.nbytes, 0xEE, dtype=np.uint8) for t in found]  # their places in a file
    for p, out in zip(pieces, datas):
        p[4](out)
    assert len(os.listdir("/proc/self/fd")) == before
    assert [bytes(d) for d in datas] == [bytes(t.data) for t in many.values()]
    data = (base / "model.safetensors").read_bytes()
    (base / "model.safetensors").write_bytes(data[: len(data) // 2])  # rewritten in place, shorter
    with pytest.raises(RuntimeError, match="carry_base_tensors: .*model.safetensors changed since the publisher"):
        pieces[-1][4](datas[-1])  # rewritten between the encode and the file's assembly
    with pytest.raises(RuntimeError, match="carry_base_tensors: .*model.safetensors changed since the publisher"):
        next(carrier.pieces("full"))  # the next full fails at its encode, before any rank writes a file


def test_a_base_file_replaced_while_training_fails_the_next_full(tmp_path: Path) -> None:
    """Deltas refer to what the last full carried; a full that read a replaced file would carry other bytes than
    the base model's, so it fails instead, naming the file, and what replicas serve stays whole."""
    bucket = str(tmp_path / "bucket")
    model = make_model()
    base = hf_dir(tmp_path)
    carried = write_base(base, model, sharded=True)
    with HotLoadEmulator(bucket, replicas=1, api_key=API_KEY, base_model=base) as emu:
        cfg = config(bucket, emu, tmp_path, full_every=2, carry_base_tensors=["model.layers.2.*"],
                     keep_training_on_error=True)
        with TensorPublisher(model, cfg) as pub:
            for step in range(2):
                train_step(model, step)
                pub.publish(step, model)
                pub.wait()
            shard = base / "model-00002-of-00002.safetensors"
            data = shard.read_bytes()
            os.unlink(shard)
            shard.write_bytes(data)  # the same bytes, another file: a re-download
            os.utime(shard, ns=(1, 1))
            train_step(model, 2)
            pub.publish(2, model)
            pub.wait()
            last = pub.metrics[-1]
            assert last.kind == "full" and not last.ok
            assert "changed since the publisher started" in (last.error or "") and shard.name in (last.error or "")
            ((identity, shas),) = served(emu)
            assert identity == pub.metrics[1].identity and shas != {} and all(shas[k] == v for k, v in carried.items())


def test_config_refuses_carrying_without_a_base_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="carry_base_tensors is set, so hf_config_dir must be set"):
        HotloadConfig(bucket_url="/tmp/b", carry_base_tensors=["mtp.*"])
    with pytest.raises(ValidationError, match="carry_base_tensors has an empty glob"):
        HotloadConfig(bucket_url="/tmp/b", hf_config_dir="/tmp", carry_base_tensors=[" "])
    env = {"HOTLOAD_BUCKET_URL": "/tmp/b", "HOTLOAD_HF_CONFIG_DIR": "/tmp",
           "HOTLOAD_CARRY_BASE_TENSORS": '["model.layers.61.*"]'}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert HotloadConfig.from_env().carry_base_tensors == ["model.layers.61.*"]


def test_find_carried_refuses_a_hotload_delta_snapshot_as_the_base(tmp_path: Path) -> None:
    """hf_config_dir at a snapshot of an earlier run (resuming from what the fleet serves) that is a delta: its
    files hold XOR+zstd payloads as U8 entries. Carried as they are, they were served as a U8 tensor of another
    shape (the payload bytes) under the base tensor's name, on any deployment that does not check shapes."""
    from fsdp_hotload.arc.container import encode_delta_file

    model = make_model()
    base = hf_dir(tmp_path)
    write_base(base, model, sharded=True)
    published = {k: "BF16" for k in model}
    shard = base / "model-00002-of-00002.safetensors"
    extra = extra_tensors()
    changed = {k: RawTensor(t.dtype, t.shape, t.data.copy()) for k, t in extra.items()}
    changed["model.layers.2.enorm.weight"].data[:4] ^= 1
    shard.write_bytes(encode_delta_file(extra, changed, parent_identity="step-000010-ab12cd34"))
    with pytest.raises(ValueError, match=r"carry_base_tensors: .*model-00002-of-00002.safetensors is a hotload delta "
                                         r"\(made against 'step-000010-ab12cd34'\), not the base model's weights"):
        find_carried(str(base), ["model.layers.2.*"], published)
