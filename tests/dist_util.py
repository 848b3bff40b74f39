"""Launch a script under torchrun on CPU (gloo) from a test, with the full output in any failure.

Example::

    run_torchrun(str(SCRIPTS / "check_chunks.py"), nproc=2, args=["--quick"])
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",  # N ranks on a 2-core CI machine: no thread oversubscription
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        GLOO_SOCKET_IFNAME="lo",  # gloo stays on loopback whatever the host name resolves to
        TORCH_CPP_LOG_LEVEL="ERROR",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_torchrun(script: str, nproc: int, args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` local ranks; raise RuntimeError with all output unless every rank exits 0.

    Rendezvous is what ``--standalone`` sets up (a single-node c10d store), but on 127.0.0.1 and an explicit
    free port rather than ``localhost:0``, so nothing depends on how the host name resolves; a port taken
    between choosing and binding is retried once. The whole process group is killed on timeout.
    """
    last: subprocess.CompletedProcess | None = None
    for _attempt in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", uuid.uuid4().hex,
            "--max-restarts", "0", "--monitor-interval", "0.1",
            script, *args,
        ]
        proc = subprocess.Popen(
            cmd, cwd=str(REPO), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            raise RuntimeError(
                f"torchrun {Path(script).name} x{nproc} timed out after {timeout:.0f}s; output:\n{out}"
            ) from None
        last = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
        if proc.returncode == 0:
            return last
        if "Address already in use" not in out and "EADDRINUSE" not in out:
            break
    assert last is not None
    raise RuntimeError(
        f"torchrun {Path(script).name} x{nproc} {' '.join(args)} exited with {last.returncode}; output:\n"
        f"{last.stdout}"
    )


def finish() -> None:
    """End a torchrun script after its last barrier without C++ teardown (gloo can abort in static destructors
    after every check passed, which would fail a run for nothing)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def start_rank() -> tuple[str, Path, int]:
    """A torchrun script's common start: its ``--bucket`` and ``--out`` arguments, the gloo process group, and
    this rank (each script writes its findings to ``--out``/rank<r>.json)."""
    import argparse

    import torch.distributed as dist

    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    return args.bucket, Path(args.out), dist.get_rank()


class WarningLines(logging.Handler):
    """The messages of hotload's warnings (and worse) logged in this process, for a script to write out.

    Example::

        said = WarningLines.attach()
        ...
        Path(out, "rank0.json").write_text(json.dumps(said.lines))
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    @classmethod
    def attach(cls, logger: str = "fsdp_hotload") -> "WarningLines":
        handler = cls()
        logging.getLogger(logger).addHandler(handler)
        return handler
