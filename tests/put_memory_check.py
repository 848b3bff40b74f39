"""The child process both small-put memory tests run (S3 and gs://): four 16 MiB views put at once through
``Storage.put_bytes`` in a process of their own, and how far its resident memory rose above the buffers (the
kernel's high-water mark, reset just before the puts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import json, sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    import numpy as np
    from fsdp_hotload.storage import Storage

    def kib(field):
        return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines()
                    if l.startswith(field + ":"))

    uri, options, no_final_cr = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
    st = Storage(uri, options)
    st.exists("warm-up")
    arrays = [np.random.default_rng(i).integers(0, 256, 16 * 2**20, dtype=np.uint8) for i in range(4)]
    for a in arrays if no_final_cr else ():
        a[-1] = a[-1] if a[-1] != 0x0D else 0
    views = [memoryview(a) for a in arrays]
    Path("/proc/self/clear_refs").write_text("5")
    rss0 = kib("VmRSS")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: st.put_bytes(f"f{i}.bin", views[i]), range(4)))
    print((kib("VmHWM") - rss0) / 1024)
""")


def view_puts_peak_mib(uri: str, options: dict[str, Any], *, env: dict[str, str] | None = None,
                       no_final_cr: bool = False) -> float:
    """MiB the child's resident memory rose by while it put ``f0.bin`` .. ``f3.bin`` (16 MiB each, the views of
    ``np.random.default_rng(i)``'s bytes; with ``no_final_cr`` a last byte of 0x0d made 0) under ``uri``."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the peak resident memory cannot be reset here (/proc/self/clear_refs)")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, uri, json.dumps(options), "1" if no_final_cr else "0"],
                          capture_output=True, text=True, timeout=180, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(proc.stdout.split()[-1])
