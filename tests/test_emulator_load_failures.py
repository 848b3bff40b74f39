"""What fails an emulator load and keeps the old weights served: a corrupted delta or full snapshot, files that
change after the signal, a full snapshot that reshapes or relabels a served tensor, a delta made against other
base bytes or whose file names another parent, a missing file, and a weight spec that does not cover the index."""
from __future__ import annotations

import json

import pytest

from fsdp_hotload.arc.stio import CHECKSUM_KEY, build_header, parse_header
from fsdp_hotload.emulator import HotLoadEmulator
from fsdp_hotload.fireworks import HotLoadError
from tests.emulator_fixture import (  # the emulator fixture comes from tests/conftest.py
    digest_map,
    perturb,
    tiny_model,
    write_delta_snapshot,
    write_full_snapshot,
)
from tests.test_emulator import client_for, load_full, served, settle


def test_corrupted_delta_keeps_old_weights(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    folder = write_delta_snapshot(emulator.bucket, "step-2", "step-1", m1, perturb(m1, seed=1))
    victim = folder / "model-00001.safetensors"
    blob = bytearray(victim.read_bytes())
    blob[-3] ^= 0x40
    victim.write_bytes(bytes(blob))
    client.signal("step-2", previous_identity="step-1")
    with pytest.raises(HotLoadError, match="failed to load") as info:
        client.wait_ready("step-2", timeout_s=30)
    assert "stage='error'" in str(info.value)
    per_replica = settle(emulator, "step-2")
    assert all(p["stage"] == "error" and "model-00001.safetensors" in p["error"] for p in per_replica)
    assert served(emulator) == [("step-1", digest_map(m1))] * 2
    st = client.status()
    assert all(r.current_snapshot_identity == "step-1" and r.readiness and r.target == "step-2"
               for r in st.replicas)


@pytest.mark.parametrize("damage", ["data bit", "checksums dropped"])
def test_a_corrupted_full_snapshot_keeps_old_weights(emulator: HotLoadEmulator, damage: str) -> None:
    """A full snapshot's file carried no checksum, so a bit flipped in storage or transit was served without an
    error, and blamed on the next delta (whose Adler-32 then failed against the damaged parent)."""
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    folder = write_full_snapshot(emulator.bucket, "step-2", perturb(m1, seed=1))
    victim = folder / "model-00001.safetensors"
    blob = victim.read_bytes()
    header = parse_header(blob)
    if damage == "data bit":
        blob = blob[:-3] + bytes([blob[-3] ^ 0x08]) + blob[-2:]
        said = "differs from the file's checksum"
    else:  # a header without them (a damaged key name reads the same): refused, not read as unchecked
        meta = {k: v for k, v in header.metadata.items() if k != CHECKSUM_KEY}
        blob = build_header([(e.name, e.dtype, e.shape, e.nbytes) for e in header.entries.values()], meta) + \
            blob[header.data_start:]
        said = f"has no '{CHECKSUM_KEY}'"
    victim.write_bytes(blob)
    client.signal("step-2")
    with pytest.raises(HotLoadError, match="failed to load"):
        client.wait_ready("step-2", timeout_s=30)
    per_replica = settle(emulator, "step-2")
    assert all(p["stage"] == "error" and said in p["error"] for p in per_replica), per_replica
    assert served(emulator) == [("step-1", digest_map(m1))] * 2


def test_files_written_after_the_signal_fail_the_load(emulator: HotLoadEmulator) -> None:
    """Replicas read a snapshot after the signal (here load_delay_s later), so a publisher that signalled before
    every file was durable was served the files that appeared meanwhile: the rule "signal only once every file
    is durable" had no oracle. The folder is now listed at the signal and again after the read."""
    client = client_for(emulator)
    m1 = tiny_model(1)
    emulator.set_load_delay(600)  # held until the files are written, however late this thread runs
    client.signal("step-1")  # nothing uploaded yet
    write_full_snapshot(emulator.bucket, "step-1", m1)
    emulator.set_load_delay(0)
    with pytest.raises(HotLoadError, match="changed after it was signalled"):
        client.wait_ready("step-1", timeout_s=30)
    assert [p["stage"] for p in settle(emulator, "step-1")] == ["error", "error"]
    assert served(emulator) == [(None, {})] * 2
    emulator.set_load_delay(0)
    load_full(emulator, client, "step-2", seed=1)
    m2 = tiny_model(1)
    m3 = perturb(m2, seed=2)
    folder = write_delta_snapshot(emulator.bucket, "step-3", "step-2", m2, m3)
    victim = folder / "model-00001.safetensors"
    good = victim.read_bytes()
    victim.write_bytes(b"not yet")  # a shard still being written when the signal goes out
    emulator.set_load_delay(600)
    client.signal("step-3", previous_identity="step-2")
    victim.write_bytes(good)  # complete before any replica reads it
    emulator.set_load_delay(0)
    with pytest.raises(HotLoadError, match="model-00001.safetensors"):
        client.wait_ready("step-3", timeout_s=30)
    assert all("changed after it was signalled" in p["error"] for p in settle(emulator, "step-3"))
    assert served(emulator) == [("step-2", digest_map(m2))] * 2


def test_a_full_snapshot_must_keep_the_served_names_and_shapes_and_its_labels_are_checked(
        emulator: HotLoadEmulator) -> None:
    """Without a base model (the tests' default) a full snapshot was checked against its own spec only, so one
    that reshaped a tensor replaced the served one; and the served digests covered the bytes alone, so the same
    bytes labelled F16 compared equal to the trainer's BF16. The snapshot served now stands in for the base, and
    a digest covers dtype and shape too."""
    import numpy as np

    from fsdp_hotload.arc.dtypes import RawTensor

    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    reshaped = dict(m1)
    norm = m1["model.norm.weight"]
    reshaped["model.norm.weight"] = RawTensor("F32", (4,), norm.data)  # the same 16 bytes
    write_full_snapshot(emulator.bucket, "step-2", reshaped)
    client.signal("step-2")
    with pytest.raises(HotLoadError, match=r"model.norm.weight.*has shape \[4\], the snapshot this replica serves"):
        client.wait_ready("step-2", timeout_s=30)
    assert served(emulator) == [("step-1", digest_map(m1))] * 2
    relabelled = {**m1, "model.norm.weight": RawTensor("F16", norm.shape, norm.data)}
    write_full_snapshot(emulator.bucket, "step-3", relabelled)
    client.signal("step-3")
    client.wait_ready("step-3", timeout_s=30)  # same names and shapes: served, and told apart by its digests
    assert served(emulator) == [("step-3", digest_map(relabelled))] * 2
    assert digest_map(relabelled) != digest_map(m1) and norm.sha256() == relabelled["model.norm.weight"].sha256()
    assert RawTensor("BF16", (2, 4), norm.data).digest() != RawTensor("BF16", (4, 2), np.array(norm.data)).digest()


def test_delta_from_wrong_base_bytes_fails_the_checksum(emulator: HotLoadEmulator) -> None:
    """The trainer's cache diverged from what the deployment loaded: the delta decodes, Adler-32 catches it."""
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    wrong_base = perturb(m1, seed=7, fraction=0.05)
    write_delta_snapshot(emulator.bucket, "step-2", "step-1", wrong_base, perturb(wrong_base, seed=1))
    client.signal("step-2", previous_identity="step-1")
    with pytest.raises(HotLoadError, match="ChecksumError"):
        client.wait_ready("step-2", timeout_s=30)
    assert [p["stage"] for p in settle(emulator, "step-2")] == ["error", "error"]
    assert served(emulator) == [("step-1", digest_map(m1))] * 2


def test_missing_file_is_a_load_error(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    folder = write_full_snapshot(emulator.bucket, "step-2", perturb(m1, seed=1))
    (folder / "model-00002.safetensors").unlink()
    client.signal("step-2")
    with pytest.raises(HotLoadError, match="model-00002.safetensors"):
        client.wait_ready("step-2", timeout_s=30)
    assert [p["stage"] for p in settle(emulator, "step-2")] == ["error", "error"]
    assert served(emulator) == [("step-1", digest_map(m1))] * 2


def test_spec_must_cover_the_index(emulator: HotLoadEmulator) -> None:
    client = client_for(emulator)
    folder = write_full_snapshot(emulator.bucket, "step-1", tiny_model(0))
    spec = json.loads((folder / "model.weight.spec.json").read_text())
    spec["tensor_map"]["model.norm.weight"]["shape"] = [9]
    (folder / "model.weight.spec.json").write_text(json.dumps(spec))
    client.signal("step-1")
    with pytest.raises(HotLoadError, match="weight spec says"):
        client.wait_ready("step-1", timeout_s=30)
    del spec["tensor_map"]["model.norm.weight"]
    folder2 = write_full_snapshot(emulator.bucket, "step-2", tiny_model(0))
    (folder2 / "model.weight.spec.json").write_text(json.dumps(spec))
    client.signal("step-2")
    with pytest.raises(HotLoadError, match="tensor_map lacks 1 tensor"):
        client.wait_ready("step-2", timeout_s=30)


def test_a_delta_whose_file_names_another_parent_than_the_signal_is_refused(emulator: HotLoadEmulator) -> None:
    """The delta file's own header names its parent; the emulator must check it against the signal, not rely on the
    checksum: here the bytes would rebuild exactly, only the recorded parent is wrong (a publisher that wrote the
    wrong parent identity into its files must fail here, as on the real service)."""
    client = client_for(emulator)
    m1 = load_full(emulator, client, "step-1")
    m2 = perturb(m1, seed=1)
    write_delta_snapshot(emulator.bucket, "step-2", "step-0", m1, m2)  # bytes against step-1, header says step-0
    client.signal("step-2", previous_identity="step-1")
    with pytest.raises(HotLoadError, match="delta was made against 'step-0'"):
        client.wait_ready("step-2", timeout_s=30)
    assert [p["stage"] for p in settle(emulator, "step-2")] == ["error", "error"]
    assert served(emulator) == [("step-1", digest_map(m1))] * 2
