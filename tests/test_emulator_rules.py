"""The emulator checks full snapshots against the base model as the service does (protocol §6.2)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fsdp_hotload.arc import RawTensor, save_file
from fsdp_hotload.emulator import BaseModelSpec, HotLoadEmulator, run_emulator_cli
from fsdp_hotload.fireworks import HotLoadClient, HotLoadError
from tests.emulator_fixture import CONFIG, EMULATOR_API_KEY, digest_map, shard_of, tiny_model, write_full_snapshot

DEP = "accounts/acct/deployments/dep"


def client_for(emu: HotLoadEmulator) -> HotLoadClient:
    return HotLoadClient(emu.url, account_id="acct", model_id="m", deployment_id="dep", api_key=EMULATOR_API_KEY,
                         poll_interval_s=0.02, retry_budget_s=5)


def base_folder(path: Path, tensors: dict[str, RawTensor], *, sharded: bool = False) -> Path:
    """A Hugging Face model folder: config.json plus the weights in one file, or sharded with an index."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    if not sharded:
        (path / "model.safetensors").write_bytes(save_file(tensors))
        return path
    files: dict[str, dict[str, RawTensor]] = {}
    for name, t in tensors.items():
        files.setdefault(shard_of(name), {})[name] = t
    for fname, part in files.items():
        (path / fname).write_bytes(save_file(part))
    index = {"metadata": {}, "weight_map": {n: shard_of(n) for n in tensors}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def served(emu: HotLoadEmulator) -> tuple[str | None, dict[str, str]]:
    (rep,) = emu.state()["deployments"][DEP]["replicas"]
    return rep["identity"], {k: t["digest"] for k, t in rep["tensors"].items()}


def expect_load_error(emu: HotLoadEmulator, bucket: Path, identity: str, tensors: dict[str, RawTensor],
                      match: str, **kw: Any) -> None:
    client = client_for(emu)
    write_full_snapshot(bucket, identity, tensors, **kw)
    client.signal(identity)
    with pytest.raises(HotLoadError, match=match):
        client.wait_ready(identity, timeout_s=30)


@pytest.mark.parametrize("sharded", [False, True])
def test_full_snapshots_must_cover_the_base_model(tmp_path: Path, sharded: bool) -> None:
    bucket = tmp_path / "bucket"
    good = tiny_model(1)
    base = base_folder(tmp_path / "base", tiny_model(0), sharded=sharded)
    assert BaseModelSpec.from_folder(base).shapes == {n: t.shape for n, t in good.items()}
    with HotLoadEmulator(str(bucket), replicas=1, api_key=EMULATOR_API_KEY, base_model=str(base)) as emu:
        client = client_for(emu)
        write_full_snapshot(bucket, "step-1", good)
        client.signal("step-1")
        client.wait_ready("step-1", timeout_s=30)
        assert served(emu) == ("step-1", digest_map(good))

        missing = {n: t for n, t in good.items() if n != "model.norm.weight"}
        expect_load_error(emu, bucket, "step-2", missing, r"does not cover the base model.*'model\.norm\.weight'")
        extra = dict(good, **{"lm_head.weight": good["model.embed_tokens.weight"]})
        expect_load_error(emu, bucket, "step-3", extra, r"base model does not have.*'lm_head\.weight'")
        bits = np.zeros(8 * 9, dtype=np.uint16).view(np.uint8)
        reshaped = dict(good, **{"model.layers.1.self_attn.q_proj.weight": RawTensor("BF16", (8, 9), bits)})
        expect_load_error(emu, bucket, "step-4", reshaped,
                          r"'model\.layers\.1\.self_attn\.q_proj\.weight' has shape \[8, 9\], the base model's is "
                          r"\[8, 8\]")
        write_full_snapshot(bucket, "step-5", good)
        (bucket / "step-5" / "config.json").write_text(json.dumps(dict(CONFIG, hidden_size=16)))
        client.signal("step-5")
        with pytest.raises(HotLoadError, match="Config value mismatch for hidden_size"):
            client.wait_ready("step-5", timeout_s=30)
        assert served(emu) == ("step-1", digest_map(good)), "a refused snapshot must leave the weights alone"


def test_full_snapshot_needs_one_layer_per_file(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    model = tiny_model(0)
    with HotLoadEmulator(str(bucket), replicas=1, api_key=EMULATOR_API_KEY) as emu:
        expect_load_error(emu, bucket, "step-1", model, r"mixes layers.*one layer's tensors",
                          file_of=lambda n: "model-00001.safetensors" if ".layers." in n else shard_of(n))
        expect_load_error(emu, bucket, "step-2", model, "mixes layers",
                          file_of=lambda n: "model-00001.safetensors" if n != "model.embed_tokens.weight"
                          else "model-00000.safetensors")
        client = client_for(emu)
        write_full_snapshot(bucket, "step-3", model)  # head and tail together, one file per layer: accepted
        client.signal("step-3")
        client.wait_ready("step-3", timeout_s=30)
        assert served(emu) == ("step-3", digest_map(model))


def test_base_model_folder_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="config.json"):
        BaseModelSpec.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert BaseModelSpec.from_folder(tmp_path) == BaseModelSpec(CONFIG, None)  # config only: coverage not checked
    (tmp_path / "model-00001.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ValueError, match="model-00001.safetensors"):
        BaseModelSpec.from_folder(tmp_path)
    t = tiny_model(0)
    (tmp_path / "model-00001.safetensors").write_bytes(save_file(t))
    (tmp_path / "model-00002.safetensors").write_bytes(save_file({"model.norm.weight": t["model.norm.weight"]}))
    with pytest.raises(ValueError, match="'model.norm.weight' appears in more than one"):
        BaseModelSpec.from_folder(tmp_path)
    with pytest.raises(ValueError, match="not both"):
        HotLoadEmulator(str(tmp_path), base_model=str(tmp_path), base_config=CONFIG)
    assert run_emulator_cli(["--bucket", str(tmp_path), "--base-model", str(tmp_path / "nope")]) == 2
    assert "--base-model" in capsys.readouterr().err
    (tmp_path / "model-00002.safetensors").unlink()
    (tmp_path / "model-00001.safetensors").write_bytes((1 << 62).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="model-00001.safetensors"):  # was MemoryError: read(2**62) up front
        BaseModelSpec.from_folder(tmp_path)


@pytest.mark.parametrize("with_base", [False, True])
def test_a_quantization_config_needs_quantized_tensors(tmp_path: Path, with_base: bool) -> None:
    """The service rejects a snapshot whose config.json has a quantization_config while its spec lists no
    quantized tensor (a trainer's bf16 weights under an fp8 base's config)."""
    qconf = {**CONFIG, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    bucket = tmp_path / "bucket"
    with HotLoadEmulator(str(bucket), replicas=1, api_key=EMULATOR_API_KEY,
                         base_config=qconf if with_base else None) as emu:
        folder = write_full_snapshot(bucket, "step-000001-aaaaaaaa", tiny_model())  # every tensor bf16
        (folder / "config.json").write_text(json.dumps(qconf))
        client = client_for(emu)
        client.signal("step-000001-aaaaaaaa")
        with pytest.raises(HotLoadError, match="has a quantization_config, but model.weight.spec.json lists no "
                                               "quantized tensor"):
            client.wait_ready("step-000001-aaaaaaaa", timeout_s=30)


def test_a_snapshot_with_the_lora_marker_is_never_loaded_as_full_weights(tmp_path: Path) -> None:
    """``adapter_config.json`` makes the service treat a snapshot folder as a LoRA adapter (§2.2, §6.4): a full
    signal for it never becomes the deployment's weights, and a delta signal for it is refused (§10; the SDK
    notes that delta metadata on a LoRA snapshot crashes the serving container). A publisher that carried the
    file by mistake must fail here as on a deployment, not be served."""
    from tests.emulator_fixture import perturb, write_delta_snapshot

    marker = json.dumps({"peft_type": "LORA", "base_model_name_or_path": "m", "r": 8})
    bucket = tmp_path / "bucket"
    with HotLoadEmulator(str(bucket), replicas=1, api_key=EMULATOR_API_KEY) as emu:
        client = client_for(emu)
        m1 = tiny_model(0)
        write_full_snapshot(bucket, "step-1", m1)
        client.signal("step-1")
        client.wait_ready("step-1", timeout_s=30)

        m2 = perturb(m1, seed=2)
        (write_full_snapshot(bucket, "step-2", m2) / "adapter_config.json").write_text(marker)
        client.signal("step-2")
        with pytest.raises(HotLoadError, match="adapter_config.json"):
            client.wait_ready("step-2", timeout_s=30)
        assert served(emu) == ("step-1", digest_map(m1))

        (write_delta_snapshot(bucket, "step-3", "step-1", m1, m2) / "adapter_config.json").write_text(marker)
        with pytest.raises(HotLoadError, match="adapter_config.json") as info:
            client.signal("step-3", previous_identity="step-1")
        assert info.value.status_code == 400
        assert served(emu) == ("step-1", digest_map(m1))


@pytest.mark.parametrize("quantized", ["snapshot", "base"])
def test_a_quantization_config_may_differ_from_the_base_models(tmp_path: Path, quantized: str) -> None:
    """Protocol §6.2 allows a quantization_config on a quantized snapshot: an fp8 snapshot of a bf16 base was
    refused as 'Extra snapshot model config options'. A bf16 upload of an fp8 base (config without the key) is
    refused as 'Extra base model config options' unless the signal names the key in extra_fields_ignore (§2.4,
    which §6.2 does not waive; the emulator let it pass, so a publisher that forgot to name it went unseen)."""
    qconf = {**CONFIG, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    bucket = tmp_path / "bucket"
    tensors = tiny_model(0)
    if quantized == "snapshot":
        name = next(n for n, t in tensors.items() if len(t.shape) == 2)
        t = tensors[name]
        tensors[name] = RawTensor("F8_E4M3", t.shape, np.arange(int(np.prod(t.shape)), dtype=np.uint8))
    with HotLoadEmulator(str(bucket), replicas=1, api_key=EMULATOR_API_KEY,
                         base_config=CONFIG if quantized == "snapshot" else qconf) as emu:
        client = client_for(emu)
        if quantized == "base":
            folder = write_full_snapshot(bucket, "step-0", tensors)
            (folder / "config.json").write_text(json.dumps(CONFIG))
            client.signal("step-0")
            with pytest.raises(HotLoadError, match="Extra base model config options: quantization_config"):
                client.wait_ready("step-0", timeout_s=30)
        folder = write_full_snapshot(bucket, "step-1", tensors)
        (folder / "config.json").write_text(json.dumps(qconf if quantized == "snapshot" else CONFIG))
        client.signal("step-1", validation=None if quantized == "snapshot" else {
            "extra_fields_ignore": ["quantization_config"]})
        client.wait_ready("step-1", timeout_s=30)
        assert served(emu) == ("step-1", digest_map(tensors))
