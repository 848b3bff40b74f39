"""The machine line every benchmark prints and records next to its figures (RESULTS.md rule)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import numba
import numpy as np
import torch
import zstandard


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
            f"numba {numba.__version__}, numpy {np.__version__}, zstandard {zstandard.__version__} "
            f"(libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))}); arc_v2 encoder {_arc_encoder()}")


def _arc_encoder() -> str:
    from fsdp_hotload.arc.codecs import ArcV2

    return ArcV2().encoder_info
