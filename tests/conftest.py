"""Shared fixtures: a moto S3 server and a GCS emulator on loopback, and the hot-load emulator."""
from __future__ import annotations

import os
import signal

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Before any import of gcsfs: its default filesystem asks a bucket's layout over gRPC, which the GCS emulator does not
# serve, and waits up to 60 s for that on every call.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from tests.emulator_fixture import emulator  # noqa: E402,F401
from tests.gcs_fixture import gcs_server  # noqa: E402,F401
from tests.s3_fixture import s3_server  # noqa: E402,F401


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background of a non-interactive shell (``make test &``) inherits SIGINT ignored, and
    so does every process it starts: the tests that interrupt a process (Ctrl-C of the CLI, the demo, a write)
    would time out. Python's own handler is reset to the default in each child at exec."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
