"""The hotload CLI through real subprocesses: exit codes, outputs, byte-exact rebuilds. The --vendor-module route is
in test_cli_vendor.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

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
    (a / "model.safetensors.index.json").rename(tmp_path / "index.json")  # shards only: a crashed upload
    assert "has no hotload.commit.json" in run("inspect", a).stderr
    (tmp_path / "index.json").rename(a / "model.safetensors.index.json")
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


@pytest.mark.parametrize("damage", ["tensor renamed", "tensor moved to another file"])
def test_a_damaged_index_is_refused_by_apply_and_verify(snapshots: tuple[Path, Path], tmp_path: Path,
                                                        damage: str) -> None:
    """apply and verify read the delta's index only for its file names: one bit off in it (a tensor renamed, or
    mapped to another shard) was copied into OUT under a commit marker, naming tensors OUT's shards do not hold."""
    a, b = snapshots
    d, r = tmp_path / "delta", tmp_path / "rebuilt"
    assert run("diff", a, b, d).returncode == 0
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    if damage == "tensor renamed":
        doc["weight_map"]["model.layers.0.mlp.v"] = doc["weight_map"].pop("model.layers.0.mlp.w")
    else:
        doc["weight_map"]["model.layers.0.norm"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    res = run("apply", a, d, r)
    assert res.returncode == 1 and "a damaged index" in res.stderr, res.stderr
    assert not (r / "hotload.commit.json").exists()
    res = run("verify", a, d)
    assert res.returncode == 1 and "a damaged index" in res.stderr, res.stdout + res.stderr


def test_usage_errors_exit_2(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = snapshots
    res = run("verify", a, tmp_path / "missing")
    assert res.returncode == 2 and "no such file" in res.stderr and "Traceback" not in res.stderr
    assert f"DELTA {tmp_path / 'missing'}:" in res.stderr  # which of the two paths is missing
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    res = run("inspect", junk)
    assert res.returncode == 2 and "junk.safetensors" in res.stderr
    assert run("frobnicate").returncode == 2
    assert run("diff", a).returncode == 2


def _marker(folder: Path) -> Path:
    return folder / "hotload.commit.json"


def test_empty_or_partial_folders_never_verify(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """A folder with no weight files, or a delta missing one, is never 'all checksums match' nor rebuilt."""
    a, b = snapshots
    e1, e2 = tmp_path / "e1", tmp_path / "e2"
    e1.mkdir(), e2.mkdir()
    res = run("verify", e1, e2)
    assert res.returncode == 2 and "has no weight files" in res.stderr and "all checksums match" not in res.stdout
    res = run("inspect", e1)
    assert res.returncode == 2 and "'" + str(e1) + "' has no weight files" in res.stderr, res.stdout + res.stderr
    d = tmp_path / "delta"
    assert run("diff", a, b, d).returncode == 0
    (d / "model-00002-of-00002.safetensors").unlink()
    (d / "model.safetensors.index.json").unlink()
    res = run("verify", a, d)  # the marker lists what is gone
    assert res.returncode == 1 and "all checksums match" not in res.stdout
    assert "model-00002-of-00002.safetensors is missing, but its hotload.commit.json lists it" in res.stderr
    _marker(d).unlink()  # an upload that never finished: the files say it
    res = run("verify", a, d)
    assert res.returncode == 1 and "all checksums match" not in res.stdout
    assert "weight files differ" in res.stderr and "model-00002-of-00002.safetensors" in res.stderr
    r = tmp_path / "rebuilt"
    res = run("apply", a, d, r)
    assert res.returncode == 1 and "model-00002-of-00002.safetensors" in res.stderr
    assert not _marker(r).exists()


def test_failed_apply_or_diff_leaves_no_commit_marker(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """An output folder holds a marker only if this run finished it: the input's marker is never copied, and a
    folder that already holds files (a snapshot, an earlier run's output) is refused untouched: written over, its
    marker would have listed the files left there as the new snapshot's."""
    a, b = snapshots
    d, r = tmp_path / "delta", tmp_path / "step-r"
    assert run("diff", a, b, d).returncode == 0 and _marker(d).exists()
    assert run("apply", a, d, r).returncode == 0
    assert json.loads(_marker(r).read_text())["identity"] == "step-r"
    victim = d / "model-00002-of-00002.safetensors"
    blob = bytearray(victim.read_bytes())
    blob[-2] ^= 0xFF
    victim.write_bytes(bytes(blob))
    before = {p.name: p.read_bytes() for p in r.iterdir()}
    res = run("apply", a, d, r)  # a folder an earlier run wrote and marked
    assert res.returncode == 2 and "already holds files" in res.stderr and "Traceback" not in res.stderr
    assert {p.name: p.read_bytes() for p in r.iterdir()} == before
    res = run("apply", a, d, tmp_path / "fresh")
    assert res.returncode == 1, res.stderr
    assert not _marker(tmp_path / "fresh").exists()
    # a failed run writes no index naming weight files it never wrote (the index and config come last)
    assert not (tmp_path / "fresh" / "model.safetensors.index.json").exists()
    assert any((tmp_path / "fresh").iterdir())  # the first weight file, rebuilt before the damaged second
    res = run("apply", a, d, tmp_path / "fresh")  # the retry names what left them
    assert res.returncode == 2 and "what a failed or interrupted run left" in res.stderr, res.stderr
    assert "failed or interrupted" not in run("apply", a, d, r).stderr  # a marked snapshot is no leftover
    res = run("diff", a, b, tmp_path / "d3", "--codec", "no_such_codec")
    assert res.returncode == 2 and "no_such_codec" in res.stderr and not (tmp_path / "d3").exists()
    # names the marker needs are checked before any work: nothing is written for bad usage
    res = run("apply", a, d, tmp_path / "bad name")
    assert res.returncode == 2 and "bad name" in res.stderr and not (tmp_path / "bad name").exists()
    odd_parent = tmp_path / "parent copy"
    shutil.copytree(a, odd_parent)
    res = run("diff", odd_parent, b, tmp_path / "d2")
    assert res.returncode == 2 and "--parent-identity" in res.stderr and not (tmp_path / "d2").exists()
    res = run("diff", odd_parent, b, tmp_path / "d2", "--parent-identity", "step/a")
    assert res.returncode == 2 and "--parent-identity 'step/a'" in res.stderr and not (tmp_path / "d2").exists()
    res = run("diff", odd_parent, b, tmp_path / "d2", "--parent-identity", "step-a")
    assert res.returncode == 0, res.stderr
    assert json.loads(_marker(tmp_path / "d2").read_text())["parent_identity"] == "step-a"


def test_inspect_ratio_counts_the_files_on_disk(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """The total ratio is raw tensor bytes over the weight files' sizes (what a transfer moves), not over the
    tensor payloads alone, which leave out every file's header."""
    a, b = snapshots
    d = tmp_path / "delta"
    assert run("diff", a, b, d).returncode == 0
    res = run("inspect", d)
    assert res.returncode == 0, res.stderr
    total = res.stdout.strip().splitlines()[-1]
    raw = sum(t.numel() * t.element_size() for p in b.glob("*.safetensors") for t in load_file(str(p)).values())
    on_disk = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    ratio = float(total.split("ratio ")[1].split("x")[0])
    assert ratio == pytest.approx(raw / on_disk, abs=0.051), total
    assert "in 2 weight file(s)" in total


def test_inspect_reads_headers_only_and_still_finds_a_truncated_file(tmp_path: Path) -> None:
    """inspect read every weight file whole to show its header: a model's worth of reads, and a file's worth of
    memory at a time. A file shorter than its header says is still refused, naming the file."""
    import tracemalloc

    from fsdp_hotload.arc.folder import inspect_path

    f = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, str(f))
    raw = f.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    n = 256 << 20
    header["w"] = {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}
    text = json.dumps(header).encode()
    with open(f, "wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        out.truncate(8 + len(text) + n)  # sparse: 256 MiB of zeros that take no disk
    tracemalloc.start()
    try:
        report = inspect_path(str(f))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(r.name, r.stored) for r in report.rows] == [("w", n)] and report.file_bytes == f.stat().st_size
    assert peak < 4 << 20, peak
    os.truncate(f, f.stat().st_size - 1)
    res = run("inspect", f)
    assert res.returncode == 2 and "model.safetensors" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_wrong_parent_folder_is_named(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """PARENT's folder name is its identity: when a delta recorded against another parent fails to verify, the
    error says which parent it wanted. A right PARENT in a folder of another name still verifies."""
    a, b = snapshots
    d = tmp_path / "delta"
    assert run("diff", a, b, d).returncode == 0
    for cmd in (("verify", b, d), ("apply", b, d, tmp_path / "out")):
        res = run(*cmd)
        assert res.returncode == 1, res.stderr
        assert "the delta was made against 'step-a', PARENT is 'step-b'" in res.stderr, res.stderr
    renamed = tmp_path / "step-copy"
    shutil.copytree(a, renamed)
    assert run("verify", renamed, d).returncode == 0
    assert run("verify", renamed, d, "--parent-identity", "step-a").returncode == 0
    res = run("verify", renamed, d, "--parent-identity", "step-x")
    assert res.returncode == 1 and "step-x" in res.stderr


def test_the_parent_hint_never_replaces_the_error_it_explains(tmp_path: Path) -> None:
    """The hint re-reads DELTA's headers after a failed apply: a corrupt header raised FormatError from the hint,
    which was then printed in place of apply's own error."""
    from fsdp_hotload.cli import _parent_hint

    parent = tmp_path / "step-1"
    parent.mkdir()
    corrupt = tmp_path / "model.safetensors"
    corrupt.write_bytes(b"\xff" * 64)
    assert _parent_hint(str(parent), str(corrupt), None) is None


def test_unusable_input_exits_2(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = snapshots
    first = a / "model-00001-of-00002.safetensors"
    res = run("verify", a, b / "model-00001-of-00002.safetensors")
    assert res.returncode == 2 and "both be files or both be folders" in res.stderr
    res = run("diff", first, b / "model-00002-of-00002.safetensors", tmp_path / "x.safetensors")
    assert res.returncode == 2 and "tensor sets differ" in res.stderr
    assert "model-00002-of-00002.safetensors" in res.stderr
    d = tmp_path / "delta"
    assert run("diff", a, b, d).returncode == 0
    res = run("diff", a, d, tmp_path / "d2")  # NEW is a delta folder
    assert res.returncode == 2 and "NEW is a hotload delta" in res.stderr
    assert str(d / "model-00001-of-00002.safetensors") in res.stderr
    res = run("diff", first, d / "model-00001-of-00002.safetensors", tmp_path / "x.safetensors")
    assert res.returncode == 2 and "NEW is a hotload delta (made against 'step-a')" in res.stderr
    assert "Traceback" not in res.stderr
    # the reverse: a full snapshot given as DELTA is a usage error too, for apply and verify alike
    for cmd in (["apply", a, b, tmp_path / "rebuilt"], ["verify", a, b]):
        res = run(*cmd)
        assert res.returncode == 2 and "DELTA is a full snapshot file, not a hotload delta" in res.stderr, res.stderr
    # a parent identity that no snapshot could have is refused once, by name, as diff refuses it
    for cmd in (["apply", a, d, tmp_path / "r2"], ["verify", a, d]):
        res = run(*cmd, "--parent-identity", "bad name")
        assert res.returncode == 2 and "--parent-identity" in res.stderr and res.stderr.count("\n") <= 2, res.stderr
    # what a writer killed mid-upload leaves on a local root: its temp files only, which no listing shows
    from fsdp_hotload.storage_local import TMP_PREFIX

    killed = tmp_path / "step-000009-a1b2c3d4"
    killed.mkdir()
    (killed / f"{TMP_PREFIX}model-00001-of-00002.safetensors.x1").write_bytes(b"part")
    res = run("inspect", killed)
    assert res.returncode == 2 and "holds only 1 temporary file(s) (.hotload-tmp-model-00001-of-00002" in res.stderr
    assert "upload that has not finished or was killed" in res.stderr, res.stderr
    res = run("inspect", tmp_path / "delta")
    assert res.returncode == 0 and "temporary" not in res.stderr


def test_diff_and_apply_carry_and_mark_sub_folder_files(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """A snapshot carries additional_chat_templates/; the folders diff and apply write keep it, and their commit
    markers list it, so a reader that checks the marker's files finds it vouched for."""
    a, b = snapshots
    for folder in (a, b):
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    d, r = tmp_path / "step-d", tmp_path / "step-r"
    assert run("diff", a, b, d).returncode == 0
    assert run("apply", a, d, r).returncode == 0
    for out in (d, r):
        assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools }}"
        files = json.loads((out / "hotload.commit.json").read_text())["files"]
        assert files["additional_chat_templates/tool_use.jinja"] == {"size": 11}, sorted(files)


def run_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with its stdout a pipe nobody reads any more, as in ``hotload inspect SNAP | head -1``."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([*HOTLOAD, *map(str, args)], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    finally:
        os.close(write)


def test_output_cut_short_by_its_reader_is_not_an_error(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """``| head`` closing the pipe made inspect print 'error: [Errno 32] Broken pipe' and exit 2 (bad usage);
    verify's exit status must still say whether the delta verified."""
    a, b = snapshots
    d = tmp_path / "delta"
    assert run("diff", a, b, d).returncode == 0
    for args, code in (((("inspect", d)), 0), (("verify", a, d), 0), (("verify", a, d, "--parent-identity", "x"), 1)):
        res = run_into_closed_pipe(*args)
        assert res.returncode == code and "Broken pipe" not in res.stderr, (args, res.returncode, res.stderr)
        assert "Traceback" not in res.stderr and "Exception ignored" not in res.stderr, res.stderr


def test_weight_files_are_those_the_index_names_and_every_other_file_is_carried(tmp_path: Path) -> None:
    """The other files were picked by suffix: a weight file the index names ``weights-1.bin`` was replaced by a
    copy of the input's (apply wrote the delta's bytes, and said every checksum was verified; diff wrote NEW's full
    file), and a ``*.safetensors`` file the index does not name (Mistral's ``consolidated.safetensors``, a draft
    model in a sub-folder) was left out of both, under a commit marker that called the folder complete."""
    torch.manual_seed(1)
    weights = {"weights-1.bin": {"w": torch.randn(64, 8).bfloat16()},
               "model-00002-of-00002.safetensors": {"v": torch.randn(32).bfloat16()}}
    extra = {"consolidated.safetensors": {"c": torch.ones(4)}, "mtp/draft.safetensors": {"d": torch.ones(4)}}
    for name, bump in (("step-a", 0.0), ("step-b", 0.5)):
        folder = tmp_path / name
        (folder / "mtp").mkdir(parents=True)
        for file, tensors in weights.items():
            save_file({k: v + bump for k, v in tensors.items()}, str(folder / file))
        for file, tensors in extra.items():
            save_file(tensors, str(folder / file))
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: file for file, tensors in weights.items() for k in tensors}}))
    a, b, d, r = (tmp_path / n for n in ("step-a", "step-b", "delta", "step-c"))
    res = run("diff", a, b, d)
    assert res.returncode == 0, res.stderr
    for file in weights:
        assert (d / file).read_bytes() != (b / file).read_bytes()  # a delta, not NEW's file
    res = run("apply", a, d, r)
    assert res.returncode == 0, res.stderr
    for file in [*weights, *extra]:  # rebuilt or carried, byte for byte
        assert (r / file).read_bytes() == (b / file).read_bytes(), file
    marker = json.loads((r / "hotload.commit.json").read_text())
    assert {"consolidated.safetensors", "mtp/draft.safetensors", "weights-1.bin"} <= set(marker["files"])


def test_out_inside_an_input_folder_and_parent_given_as_dot(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    """OUT inside NEW was taken: NEW gained OUT's folder, and OUT a copy of itself under its own commit marker. And
    PARENT given as "." made the default parent identity ".", which no identity may be."""
    a, b = snapshots
    before = sorted(os.listdir(b))
    res = run("diff", a, b, b / "delta")
    assert res.returncode == 2 and "inside the input folder" in res.stderr and sorted(os.listdir(b)) == before
    res = subprocess.run([*HOTLOAD, "diff", ".", str(b), str(tmp_path / "delta")], cwd=a, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "delta" / "hotload.commit.json").read_text())["parent_identity"] == "step-a"
    assert run("verify", a, tmp_path / "delta", "--parent-identity", "step-a").returncode == 0


def test_commit_marker_comes_after_every_file_it_lists_is_durable(snapshots: tuple[Path, Path], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """write_commit_marker may be called only once the files it vouches for are durable: diff and apply wrote
    their weight files, configs and index without any fsync, then a synced marker over them, so a power loss
    could leave a marker listing files whose data never reached the disk. And a failed write of a rebuilt file
    leaves no ``.tmp`` beside it."""
    from fsdp_hotload import cli

    a, b = snapshots
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for args, out in ((("diff", a, b, tmp_path / "step-d"), tmp_path / "step-d"),
                      (("apply", a, tmp_path / "step-d", tmp_path / "step-r"), tmp_path / "step-r")):
        synced.clear()
        assert cli.main([str(x) for x in args]) == 0
        marker_at = max(i for i, p in enumerate(synced) if p.endswith(".hotload-tmp-hotload.commit.json") or
                        ".hotload-tmp-hotload.commit.json." in p)
        before = set(synced[:marker_at])
        listed = json.loads((out / "hotload.commit.json").read_text())["files"]
        assert listed and all(os.path.realpath(out / name) in before for name in listed), (sorted(listed), before)
        assert os.path.realpath(out) in before

    import fsdp_hotload.arc.folder as folder

    def full_disk(f: Any, *args: Any, **kw: Any) -> None:
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(folder, "write_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        folder.apply_paths(str(a), str(tmp_path / "step-d"), str(tmp_path / "step-x"))
    assert os.listdir(tmp_path / "step-x") == []


def test_apply_holds_one_weight_file_at_a_time(snapshots: tuple[Path, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """apply_paths kept every rebuilt file's tensors until it returned, which the CLI ignores: rebuilding a
    snapshot folder took the whole model's size in memory (6 shards of 256 MiB: 2.2 GB peak, against 0.9 GB for
    one), where one file's worth is enough."""
    import gc
    import weakref

    import fsdp_hotload.arc.folder as folder

    a, b = snapshots
    d = tmp_path / "step-d"
    folder.diff_paths(str(a), str(b), str(d))
    alive: list[weakref.ref] = []
    real = folder.apply_delta_file

    def apply_delta_file(*args: Any, **kw: Any) -> Any:
        gc.collect()
        assert not [r for r in alive if r() is not None], "an earlier file's rebuilt tensors are still held"
        got = real(*args, **kw)
        alive.extend(weakref.ref(t.data) for t in got.values())
        return got

    monkeypatch.setattr(folder, "apply_delta_file", apply_delta_file)
    assert folder.apply_paths(str(a), str(d), str(tmp_path / "step-r")) == {}
    for name in os.listdir(b):
        assert (tmp_path / "step-r" / name).read_bytes() == (b / name).read_bytes(), name
    alive.clear()
    monkeypatch.setattr(folder, "apply_delta_file", real)
    kept = folder.apply_paths(str(a), str(d), None)  # verify only: the tensors are the answer
    assert sorted(kept) == sorted(n for n in os.listdir(b) if n.endswith(".safetensors"))


def test_main_returns_usage_codes_for_every_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``main()`` returns a code for a bad option or ``--help`` of ``emulate`` and ``demo`` too, as it does for
    diff/apply/verify/inspect: a Python caller (a launcher, a test) gets 2 or 0, not a SystemExit."""
    from fsdp_hotload import cli

    assert cli.main(["emulate", "--bucket", str(tmp_path), "--replicas", "0"]) == 2
    assert cli.main(["demo", "--no-such-flag"]) == 2
    assert cli.main(["emulate", "--help"]) == 0
    assert cli.main(["inspect", "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "argument --replicas" in err and "--no-such-flag" in err
    assert cli.main(["apply", str(tmp_path / "p"), str(tmp_path / "d"), str(tmp_path / "o")]) == 2
    assert f"PARENT {tmp_path / 'p'}: no such file or folder" in capsys.readouterr().err
    assert cli.main(["diff", "", str(tmp_path / "n"), str(tmp_path / "o")]) == 2  # an unset shell variable
    assert "error: PARENT is empty: give a file or folder" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hello world, this is a text file")
    assert cli.main(["inspect", str(tmp_path / "notes.txt")]) != 0
    assert "not a safetensors file, or one cut short" in capsys.readouterr().err


def test_a_folder_that_lost_a_file_its_commit_marker_lists_is_refused(snapshots: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """The checksums cover the tensors only: a delta folder whose tokenizer was lost and whose config was cut short
    was rebuilt, and the rebuild marked complete. Every command now checks the files an input's marker lists."""
    a, b = snapshots
    d = tmp_path / "step-d"
    assert run("diff", a, b, d).returncode == 0
    (d / "extra.json").write_text('{"carried": true}')  # not listed by the marker: not checked
    listed = json.loads(_marker(d).read_text())["files"]
    config = next(n for n in listed if n.endswith("config.json"))
    (d / config).write_text("{}")
    for args in (("apply", a, d, tmp_path / "step-r"), ("verify", a, d), ("inspect", d)):
        res = run(*args)
        assert res.returncode == 1, res.stderr
        assert f"{config} holds 2 bytes, but its hotload.commit.json lists it at {listed[config]['size']} bytes: " \
               "the snapshot is damaged" in res.stderr, res.stderr
    assert not (tmp_path / "step-r").exists()


def test_remote_urls_and_a_file_for_a_folder_are_named_as_such(snapshots: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = snapshots
    res = run("verify", "s3://bucket/run/step-1", b)
    assert res.returncode == 2 and "reads local files and folders only" in res.stderr, res.stderr
    res = run("diff", a, b, "s3://bucket/run/step-2")
    assert res.returncode == 2 and "writes local files and folders only" in res.stderr, res.stderr
    (tmp_path / "out").write_text("")
    res = run("diff", a, b, tmp_path / "out")
    assert res.returncode == 2 and "is a file, but the inputs are folders" in res.stderr, res.stderr
    res = subprocess.run([sys.executable, "-m", "fsdp_hotload", "inspect", a], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "full" in res.stdout, res.stderr
