"""The device diff's arithmetic, run on CPU tensors: CI has no GPU, so the torch code that a CUDA trainer runs
(`_device_diff`: signed views, `nonzero`, gathers) is checked here against the host diff, element for element.
The CUDA-only parts (side stream, events, pinned copies) are in `test_gpu.py`."""
from __future__ import annotations

import numpy as np
import torch

from fsdp_hotload.arc.codecs import element_diff
from fsdp_hotload.engine.staging import Stager, _device_diff
from tests.test_gpu import chunks


def test_device_diff_arithmetic_matches_the_host_diff_on_cpu() -> None:
    cs = chunks("cpu")
    st = Stager(cs, slots=1, cache_on="device")
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    st.promote(buf)
    with torch.no_grad():
        cs[0].source[::7] += 1e-2
        cs[1].source[-1] = -cs[1].source[-1]  # sign bit only: a signed view must still see it
        cs[3].source[2] = -5
        cs[3].source[4] = 1 << 62
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    assert st.cache is not None
    changed = 0
    for s in st.slices:
        if not s.numel:
            continue
        new, old = buf[s.offset:s.offset + s.nbytes], st.cache[s.offset:s.offset + s.nbytes]
        got = _device_diff(new, old, s)
        want = element_diff(old.numpy(), new.numpy(), s.itemsize)
        assert got.n == want.n and np.array_equal(got.idx, want.idx)
        assert got.old.dtype == want.old.dtype and np.array_equal(got.old, want.old)
        assert np.array_equal(got.new, want.new)
        changed += got.changed
    assert changed == len(range(0, 257 * 33, 7)) + 1 + 2  # every 7th float, one sign flip, two int64s
