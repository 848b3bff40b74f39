"""The hotload CLI through real subprocesses: exit codes, outputs, byte-exact rebuilds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

HOTLOAD = [sys.executable, "-m", "fsdp_hotload.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HOTLOAD, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture()
def snapshots(tmp_path: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    a, b = tmp_path / "step-a", tmp_path / "step-b"
    a.mkdir(), b.mkdir()
    files = {"model-00001-of-00002.safetensors": {"model.embed_tokens.weight": torch.randn(64, 32).bfloat16()},
             "model-00002-of-00002.safetensors": {"model.layers.0.mlp.w": torch.randn(96, 32).bfloat16(),
                                                  "model.layers.0.norm": torch.ones(32)}}
    weight_map = {}
    for name, tensors in files.items():
        save_file(tensors, str(a / name))
        changed = {k: v.clone() for k, v in tensors.items()}
        for v in changed.values():
            v.view(-1)[::9] += 0.05
        save_file(changed, str(b / name))
        weight_map.update({k: name for k in tensors})
    for d in (a, b):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        (d / "config.json").write_text('{"model_type": "llama"}')
    return a, b


@pytest.mark.parametrize("codec", ["arc_v2", "arc_sparse_v1"])
def test_diff_inspect_verify_apply(snapshots: tuple[Path, Path], tmp_path: Path, codec: str) -> None:
    a, b = snapshots
    d, r = tmp_path / "delta", tmp_path / "rebuilt"
    res = run("diff", a, b, d, "--codec", codec)
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(d)) == sorted([*os.listdir(b), "hotload.commit.json"])
    assert json.loads((d / "hotload.commit.json").read_text())["parent_identity"] == "step-a"
    res = run("inspect", d)
    assert res.returncode == 0 and "kind: delta  parent: step-a" in res.stdout and codec in res.stdout
    assert "warning" not in res.stderr  # the folder diff wrote is marked complete
    assert "has no hotload.commit.json" in run("inspect", a).stderr  # a folder nobody marked
    res = run("verify", a, d, "--parent-identity", "step-a")
    assert res.returncode == 0 and "all checksums match" in res.stdout, res.stdout + res.stderr
    res = run("apply", a, d, r)
    assert res.returncode == 0, res.stderr
    for name in os.listdir(b):
        assert (r / name).read_bytes() == (b / name).read_bytes(), name


def test_verify_failures_exit_1(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = snapshots
    d = tmp_path / "delta"
    assert run("diff", a, b, d).returncode == 0
    res = run("verify", a, d, "--parent-identity", "someone-else")
    assert res.returncode == 1 and "made against 'step-a'" in res.stderr
    victim = d / "model-00002-of-00002.safetensors"
    blob = bytearray(victim.read_bytes())
    blob[-2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    res = run("verify", a, d)
    assert res.returncode == 1 and "FAILED" in res.stdout and "Traceback" not in res.stderr
    assert "model-00002-of-00002.safetensors" in res.stderr


def test_usage_errors_exit_2(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = snapshots
    res = run("verify", a, tmp_path / "missing")
    assert res.returncode == 2 and "no such file" in res.stderr and "Traceback" not in res.stderr
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    res = run("inspect", junk)
    assert res.returncode == 2 and "junk.safetensors" in res.stderr
    assert run("frobnicate").returncode == 2
    assert run("diff", a).returncode == 2


def test_vendor_route(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """--vendor-module calls delta_compress_files_to_file(parent_file, new_file, out_file, compression_format)."""
    from fsdp_hotload.arc.folder import apply_paths, diff_paths
    from tests.vendor_example import fw_reference_shape as vendor

    a, b = snapshots
    d = tmp_path / "vdelta"
    vendor.CALLS.clear()
    diff_paths(str(a), str(b), str(d), vendor_module="tests.vendor_example.fw_reference_shape")
    names = sorted(n for n in os.listdir(b) if n.endswith(".safetensors"))
    assert [(os.path.basename(s), os.path.basename(t), os.path.basename(o), f) for s, t, o, f in vendor.CALLS] == [
        (n, n, n, "arc_v2") for n in names]
    assert [os.path.dirname(c[0]) for c in vendor.CALLS] == [str(a)] * len(names)
    rebuilt = apply_paths(str(a), str(d), None, expected_parent="vendor")
    assert set(rebuilt) == set(names)
    res = run("diff", a, b, tmp_path / "x", "--vendor-module", "no_such_vendor_module")
    assert res.returncode == 2 and "no_such_vendor_module" in res.stderr
