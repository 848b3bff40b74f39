"""Shared fixtures: a moto S3 server on loopback and the hot-load emulator."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.emulator_fixture import emulator  # noqa: E402,F401
from tests.s3_fixture import s3_server  # noqa: E402,F401
