"""What ``hotload demo`` prints when things go wrong: a publish that fails, Ctrl-C, a workdir that cannot be
written, a shell with ``http_proxy`` set and a venv that is not activated. Each one line (or a row) that says what
happened, never a traceback per rank nor torchrun's banners. The demo runs as the user runs it, in a subprocess;
a full disk is a real one, made with RLIMIT_FSIZE (writes past the limit fail with EFBIG)."""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

DEMO = [sys.executable, "-m", "fsdp_hotload.cli", "demo"]


def _disk_full_at(limit: int) -> Callable[[], None]:
    """A preexec_fn: files of this process and its children cannot grow past ``limit`` bytes (EFBIG, not SIGXFSZ)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_failed_publish_ends_the_demo_with_its_cause(tmp_path: Path) -> None:
    """The full snapshot's shards (~400 KB) cannot be written, the deltas' (~25 KB) could: the first publish fails,
    the job stops at the next one, and the last line names the cause, which nothing else printed repeats (the
    library's warning for a failed publish said it too, above the table's FAILED row)."""
    proc = subprocess.run([*DEMO, "--steps", "3", "--workdir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, preexec_fn=_disk_full_at(200_000))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("demo FAILED: a publish failed: ") and "File too large" in last, last
    row = next(line for line in proc.stdout.splitlines() if line.startswith("   0 "))
    assert row.split()[1:6] == ["full", row.split()[2], "FAILED", "-", "-"] and row.endswith("NO"), row
    assert "1 publishes: 1 full, 0 delta, 1 FAILED; every replica verified bit-exact: NO" in proc.stdout
    result = json.loads((tmp_path / "demo_result.json").read_text())
    assert not result["verified"] and "File too large" in result["error"]
    assert [r["ok"] for r in result["rows"]] == [False]
    printed = (proc.stdout + proc.stderr).splitlines()
    assert (proc.stdout + proc.stderr).count(result["error"]) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line for line in printed if "File too large" in line] == [last], printed


@pytest.mark.slow
def test_the_demo_checks_its_replicas_directly_under_http_proxy(tmp_path: Path) -> None:
    """A proxy variable that points at a closed port (as a proxy would not reach the loopback emulator): the demo
    talks to its emulator directly. From a venv that is not on PATH, the closing hint names its ``hotload``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    venv_bin = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env.update(http_proxy=f"http://127.0.0.1:{closed}", HTTP_PROXY=f"http://127.0.0.1:{closed}", PATH=path)
    proc = subprocess.run([*DEMO, "--steps", "1", "--workdir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "every replica verified bit-exact: yes" in proc.stdout
    (row,) = json.loads((tmp_path / "demo_result.json").read_text())["rows"]
    hotload = os.path.join(venv_bin, "hotload")
    command = hotload if os.access(hotload, os.X_OK) else "hotload"
    want = f"try: {command} inspect {tmp_path / 'bucket' / row['identity']}"
    assert proc.stdout.rstrip().endswith(want), proc.stdout[-500:]


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C reaches the terminal's foreground process group, the launcher and torchrun alike: exit 130 and the
    launcher's line, without torchrun's SignalException traceback or its log lines about closing signals."""
    workdir = tmp_path / "work"
    proc = subprocess.Popen([*DEMO, "--steps", "400", "--workdir", str(workdir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # a group of its own
    try:
        assert proc.stdout is not None
        while " delta " not in (line := proc.stdout.readline()):  # training, and publishing
            assert line, proc.stderr.read() if proc.stderr else ""
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err and "closing signal" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == f"interrupted; snapshots so far are in {workdir / 'bucket'}", err[-3000:]


def test_a_workdir_that_cannot_be_written_is_a_usage_error(tmp_path: Path) -> None:
    """A full disk under --workdir while the demo writes its base model's config and tokenizer: one line naming
    --workdir, exit 2, as for the workdir's other set-up errors."""
    workdir = tmp_path / "w"
    proc = subprocess.run([*DEMO, "--workdir", str(workdir)], capture_output=True, text=True, timeout=120,
                          preexec_fn=_disk_full_at(100))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"hotload demo: error: --workdir {workdir} cannot be set up: [Errno 27] File too large", proc.stderr


_INTERRUPTED_IMPORT = """
import builtins, sys
real = builtins.__import__
def interrupted(name, *args, **kwargs):
    if name.startswith("torch.distributed.elastic"):
        raise KeyboardInterrupt  # Ctrl-C while the wrapper imports torchrun, before torchrun handles signals
    return real(name, *args, **kwargs)
builtins.__import__ = interrupted
from fsdp_hotload import demo_torchrun
sys.exit(demo_torchrun.main())
"""


def test_ctrl_c_while_the_demo_s_torchrun_starts_exits_130_without_a_traceback() -> None:
    """A Ctrl-C in the second or two torchrun's wrapper spends importing torch came before its handlers: a
    KeyboardInterrupt traceback, and death by SIGINT rather than exit 130."""
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
