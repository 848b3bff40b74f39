"""Ctrl-C in ``hotload diff``/``apply``/``verify``: one line saying the command did not finish (and, for a snapshot
folder OUT, that it is incomplete and should be removed), exit 130, no KeyboardInterrupt traceback.

The command is held at a known point before it is interrupted, with nothing stubbed: in file mode PARENT is a
named pipe, so the command blocks reading it once it has opened it (which the test sees as its own open of the
pipe's write end succeeding); in folder mode a ``--vendor-module`` file that announces itself and then sleeps.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

HOTLOAD = [sys.executable, "-m", "fsdp_hotload.cli"]


def _interrupt_when(proc: subprocess.Popen[str], ready: Callable[[], bool],
                    release: Callable[[], None] | None = None) -> tuple[str, str]:
    """SIGINT ``proc`` once ``ready()``; its stdout and stderr once it exits. Where it has not exited 10 s later,
    ``release()`` lets a read it is blocked in return: a read inside a native library (safetensors reads a file in
    Rust, which retries a read the signal interrupted) holds the signal until it returns, as Ctrl-C during a long read
    of a real file waits for that read."""
    deadline = time.monotonic() + 120
    try:
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the command never reached the point to interrupt"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        if release is not None:
            try:
                return proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                release()
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("cmd", ["diff", "apply", "verify"])
def test_an_interrupted_command_says_so_in_one_line(tmp_path: Path, cmd: str) -> None:
    parent = tmp_path / "parent.safetensors"
    os.mkfifo(parent)
    other = tmp_path / "other.safetensors"
    save_file({"t": torch.ones(4, 4)}, str(other))
    out = tmp_path / "out.safetensors"
    args = [cmd, str(parent), str(other)] + ([str(out)] if cmd != "verify" else [])
    proc = subprocess.Popen([*HOTLOAD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    writer: list[int] = []

    def reading() -> bool:  # the write end opens (without blocking) only once the command has the read end open
        try:
            writer.append(os.open(parent, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as exc:
            if exc.errno != errno.ENXIO:
                raise
        return bool(writer)

    def release() -> None:  # the pipe's end: the read returns, and the pending interrupt is taken
        while writer:
            os.close(writer.pop())

    try:
        _, err = _interrupt_when(proc, reading, release)
    finally:
        release()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines() == [f"interrupted: {cmd} did not finish"], err
    assert not out.exists()  # a file OUT is written through a temp file: nothing half-written under its name


def test_an_interrupted_folder_diff_names_the_incomplete_out_folder(tmp_path: Path) -> None:
    parent, new = tmp_path / "step-000000-aaaa", tmp_path / "step-000001-aaaa"
    for folder, value in ((parent, 0.0), (new, 1.0)):
        folder.mkdir()
        save_file({"t": torch.full((4, 4), value)}, str(folder / "model.safetensors"))
    started = tmp_path / "vendor-started"
    vendor = tmp_path / "slow_vendor.py"  # a vendor encoder that takes its time: the interrupt comes mid-encode
    vendor.write_text("import pathlib, time\n\n\n"
                      "def delta_compress_files_to_file(src, dst, diff_file, compression_format='arc_v2'):\n"
                      f"    pathlib.Path({str(started)!r}).write_text('encoding')\n"
                      "    time.sleep(300)\n")
    out = tmp_path / "step-000001-bbbb"
    proc = subprocess.Popen([*HOTLOAD, "diff", str(parent), str(new), str(out), "--vendor-module", str(vendor)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = _interrupt_when(proc, started.exists)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"interrupted: diff did not finish; OUT {out} is incomplete (it has no "
                                            "hotload.commit.json): remove it before running again"), err
    assert out.is_dir() and not (out / "hotload.commit.json").exists()
