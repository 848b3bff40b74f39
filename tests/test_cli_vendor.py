"""The hotload CLI's --vendor-module route through real subprocesses: the module's calls and the parent it records,
its output checked before a folder is called a delta, a layout of its own kept and reported as not rebuilt, and a
module that fails leaving OUT as it was."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from safetensors import safe_open
from safetensors.torch import load_file

from fsdp_hotload.arc.errors import VendorOutputError
from tests import test_cli
from tests.test_cli import HOTLOAD, run

snapshots = test_cli.snapshots  # the two-snapshot fixture: pytest finds it under this name here too


def test_vendor_route(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """--vendor-module calls delta_compress_files_to_file(parent_file, new_file, out_file, compression_format)."""
    from fsdp_hotload.arc.folder import apply_paths, diff_paths
    from tests.vendor_example import fw_reference_shape as vendor

    a, b = snapshots
    d = tmp_path / "vdelta"
    vendor.CALLS.clear()
    # The module records a parent of its own choosing: one other than the marker's is refused, naming it.
    with pytest.raises(ValueError, match="records the parent 'vendor', not 'step-a'.*--parent-identity vendor"):
        diff_paths(str(a), str(b), str(tmp_path / "named"), vendor_module="tests.vendor_example.fw_reference_shape")
    vendor.CALLS.clear()
    diff_paths(str(a), str(b), str(d), parent_identity="vendor",
               vendor_module="tests.vendor_example.fw_reference_shape")
    names = sorted(n for n in os.listdir(b) if n.endswith(".safetensors"))
    assert [(os.path.basename(s), os.path.basename(t), os.path.basename(o), f) for s, t, o, f in vendor.CALLS] == [
        (n, n, n, "arc_v2") for n in names]
    assert [os.path.dirname(c[0]) for c in vendor.CALLS] == [str(a)] * len(names)
    rebuilt = apply_paths(str(a), str(d), None, expected_parent="vendor")
    assert set(rebuilt) == set(names)
    res = run("diff", a, b, tmp_path / "x", "--vendor-module", "no_such_vendor_module")
    assert res.returncode == 2 and "no_such_vendor_module" in res.stderr
    # --codec reaches the module (it used to get arc_v2 whatever was asked)
    vendor.CALLS.clear()
    diff_paths(str(a), str(b), str(tmp_path / "sparse"), codec="arc_sparse_v1", parent_identity="vendor",
               vendor_module="tests.vendor_example.fw_reference_shape")
    assert {c[3] for c in vendor.CALLS} == {"arc_sparse_v1"}
    # what the module writes is checked before the folder is called a delta: a copy of NEW is not one, nor are bytes
    # that are no safetensors file, and neither is left in the folder
    try:
        for mode, match in [("copy", "wrote a copy of .* not a delta"), ("garbage", "no safetensors file.*header"),
                            ("unchanged", "does not rebuild .* differs")]:
            vendor.MODE[0] = mode
            with pytest.raises(VendorOutputError, match=match):
                diff_paths(str(a), str(b), str(tmp_path / mode), parent_identity="vendor",
                           vendor_module="tests.vendor_example.fw_reference_shape")
            assert not [n for n in os.listdir(tmp_path / mode) if n.endswith(".safetensors")]
    finally:
        vendor.MODE[0] = "delta"
    # from the CLI, a module whose output fails its check is a failed verification (1), not bad usage (2)
    res = subprocess.run([*HOTLOAD, "diff", str(a), str(b), str(tmp_path / "cli"), "--parent-identity", "vendor",
                          "--vendor-module", "tests.vendor_example.fw_reference_shape"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "FW_REFERENCE_SHAPE_MODE": "unchanged"})
    assert res.returncode == 1 and "does not rebuild" in res.stderr, res.stderr


def test_vendor_route_takes_a_layout_our_decoder_cannot_read(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """Fireworks' reference module writes its own layout, which is the point of the route: every such file was
    refused as 'not a delta file' (exit 2), so the route only worked with modules writing ours. Now the files stay,
    checked as safetensors files, and the CLI says they were not rebuilt."""
    a, b = snapshots
    out = tmp_path / "fw-delta"
    env = {**os.environ, "FW_REFERENCE_SHAPE_MODE": "foreign"}
    res = subprocess.run([*HOTLOAD, "diff", str(a), str(b), str(out), "--vendor-module",
                          "tests.vendor_example.fw_reference_shape"], capture_output=True, text=True, timeout=120,
                         env=env)
    names = sorted(n for n in os.listdir(b) if n.endswith(".safetensors"))
    assert res.returncode == 0, res.stderr
    assert f"warning: {len(names)} file(s) the vendor module wrote" in res.stderr and "not rebuilt" in res.stderr
    assert (out / "hotload.commit.json").exists()
    for n in names:  # what the module wrote, as it wrote it: each tensor's XOR against the parent, zstd-compressed
        parent, new = load_file(str(a / n)), load_file(str(b / n))
        with safe_open(str(out / n), "np") as f:
            assert f.metadata()["format"] == "vendor-delta" and sorted(f.keys()) == sorted(new)
            for t in f.keys():
                xor = np.frombuffer(zstandard.ZstdDecompressor().decompress(f.get_tensor(t).tobytes()), np.uint8)
                rebuilt = xor ^ parent[t].contiguous().view(torch.uint8).reshape(-1).numpy()
                assert rebuilt.tobytes() == new[t].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes(), t
    from fsdp_hotload.arc.folder import diff_paths

    unverified: list[str] = []  # our own layout from the same module is rebuilt, and so not listed
    diff_paths(str(a), str(b), str(tmp_path / "ours"), parent_identity="vendor",
               vendor_module="tests.vendor_example.fw_reference_shape", unverified=unverified)
    assert unverified == []


def test_a_vendor_module_that_fails_leaves_out_as_it_was_and_says_so_in_one_line(
        snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """A module that raised printed a traceback, and its output was removed: in file mode that was the OUT file
    the user had there before the run. And a module given as a .py file's path was a TypeError traceback."""
    a, b = snapshots
    name = "model-00001-of-00002.safetensors"
    out = tmp_path / "notes.safetensors"
    out.write_bytes(b"the user's own file")
    module = str(Path(__file__).parent / "vendor_example" / "fw_reference_shape.py")
    res = subprocess.run([*HOTLOAD, "diff", str(a / name), str(b / name), str(out), "--vendor-module", module],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "FW_REFERENCE_SHAPE_MODE":
                                                                             "raise"})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "failed: RuntimeError: vendor encoder crashed" in res.stderr and module in res.stderr
    assert out.read_bytes() == b"the user's own file"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".hotload-tmp-")]
    res = run("diff", a / name, b / name, out, "--vendor-module", module, "--parent-identity", "vendor")
    assert res.returncode == 0, res.stderr  # the module by its file's path
    assert run("verify", a / name, out, "--parent-identity", "vendor").returncode == 0
    res = run("diff", a / name, b / name, out, "--vendor-module", str(tmp_path / "missing.py"))
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr
