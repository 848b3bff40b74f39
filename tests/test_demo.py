"""The README's first command, shortened: the demo job runs, and every replica verifies every publish."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = [sys.executable, "-m", "fsdp_hotload.cli", "demo"]


@pytest.mark.slow
def test_demo_publishes_and_verifies(tmp_path: Path) -> None:
    # A previous run's results in the same --workdir are replaced, never appended to.
    (tmp_path / ".hotload-demo").write_text("made by hotload demo")
    (tmp_path / "metrics.jsonl").write_text('{"stale": true}\n' * 3)
    (tmp_path / "demo_result.json").write_text('{"verified": true, "rows": []}')
    # as from an activated venv (its bin/ first on PATH): the closing hint says plain "hotload"
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    proc = subprocess.run([*DEMO, "--steps", "7", "--full-every", "3", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "demo_result.json").read_text())
    assert result["verified"]
    assert [r["kind"] for r in result["rows"]] == ["full", "delta", "delta"] * 2 + ["full"]
    assert all(r["verified"] for r in result["rows"])
    assert "every replica verified bit-exact: yes" in proc.stdout
    # what was sent is every file of every snapshot folder, as is the baseline of 7 full snapshots
    bucket = tmp_path / "bucket"
    folders = {r["identity"]: sum(f.stat().st_size for f in (bucket / r["identity"]).rglob("*") if f.is_file())
               for r in result["rows"]}
    assert [r["folder"] for r in result["rows"]] == list(folders.values())
    assert all(r["folder"] > r["bytes"] for r in result["rows"])  # config, tokenizer, index and marker files too
    full = [r["folder"] for r in result["rows"] if r["kind"] == "full"]
    sent, weights = sum(folders.values()), sum(r["bytes"] for r in result["rows"])
    assert f"sent {sent / 1e6:.2f} MB ({weights / 1e6:.2f} MB of weight files, the rest config, tokenizer, index " \
           f"and marker files) vs {7 * sum(full) / len(full) / 1e6:.2f} MB for a full snapshot every step" \
        in proc.stdout
    last = result["rows"][-1]["identity"]
    assert proc.stdout.rstrip().endswith(f"try: hotload inspect {bucket / last}"), proc.stdout[-500:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 7 and all(m["ok"] for m in metrics)


@pytest.mark.parametrize("args, flag", [
    (["--codec", "foo"], "--codec"),
    (["--full-every", "0"], "--full-every"),
    (["--nproc", "0"], "--nproc"),
    (["--steps", "0"], "--steps"),
])
def test_bad_options_fail_before_the_job_starts(tmp_path: Path, args: list[str], flag: str) -> None:
    """Checked by the launcher: one usage line, no torchrun, nothing written (--steps 0 would verify nothing)."""
    workdir = tmp_path / "work"
    proc = subprocess.run([*DEMO, *args, "--workdir", str(workdir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"hotload demo: error: argument {flag}:")
    assert not workdir.exists() and "verified" not in proc.stdout


def test_help_describes_every_option() -> None:
    proc = subprocess.run([*DEMO, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "``" not in proc.stdout
    for text in ("(default: 30)", "(default: 10)", "(default: 2)", "(default: arc_v2)"):
        assert text in proc.stdout, text


def test_a_workdir_the_demo_did_not_make_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each run empties ``<workdir>/bucket``: a folder of the user's there is refused, not deleted, and a file
    given as the workdir, or a folder that cannot be made or written, is a usage error, not a traceback."""
    (tmp_path / "bucket" / "precious").mkdir(parents=True)
    (tmp_path / "bucket" / "precious" / "data.txt").write_text("keep me")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "made").mkdir()
    (tmp_path / "made" / ".hotload-demo").write_text("x")  # a demo's folder whose bucket/ is now a file
    (tmp_path / "made" / "bucket").write_text("x")
    for workdir, says in ((tmp_path, "that no demo made"), (tmp_path / "afile", "is not a folder"),
                          (tmp_path / "afile" / "sub", "cannot be set up"),
                          (tmp_path / "made", "cannot be set up")):
        assert says in _refused(workdir, capsys)
    assert (tmp_path / "bucket" / "precious" / "data.txt").read_text() == "keep me"


def test_result_files_of_a_workdir_the_demo_did_not_make_are_left_alone(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A user's own metrics.jsonl in --workdir is refused, not deleted (the demo replaces only its own results)."""
    (tmp_path / "metrics.jsonl").write_text('{"mine": true}\n')
    assert "that no demo made" in _refused(tmp_path, capsys)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"mine": true}\n'
    assert not (tmp_path / ".hotload-demo").exists()


def _refused(workdir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """The last line of the usage error (exit 2) the demo's launcher gives for ``workdir``, run in this process
    (the refusals come before anything starts)."""
    from fsdp_hotload.demo import run_demo_cli

    with pytest.raises(SystemExit) as info:
        run_demo_cli(["--steps", "1", "--workdir", str(workdir)])
    assert info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_an_interrupt_sent_to_the_launcher_stops_every_rank(tmp_path: Path) -> None:
    """subprocess.call answered Ctrl-C by SIGKILLing torchrun, which starts its ranks in sessions of their own:
    an interrupt that reached the launcher only (kill -INT, a supervisor) left both ranks training for minutes,
    retrying an emulator that was gone. torchrun now gets the interrupt and stops them."""
    import os
    import signal
    import time

    workdir = tmp_path / "work"
    proc = subprocess.Popen([*DEMO, "--steps", "400", "--workdir", str(workdir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # nothing else gets it

    def ranks() -> list[str]:
        ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
        return [line for line in ps if "fsdp_hotload.demo --job" in line and str(workdir) in line]

    try:
        assert proc.stdout is not None
        while " delta " not in (line := proc.stdout.readline()):  # training, and publishing
            assert line, proc.stderr.read() if proc.stderr else ""
        assert ranks()
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and f"interrupted; snapshots so far are in {workdir / 'bucket'}" in err, err[-2000:]
    deadline = time.monotonic() + 10
    while ranks() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ranks(), ranks()
