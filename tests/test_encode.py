"""Encoding a staged slot on several threads: the same bytes as on one, every payload decodes to the staged bytes,
the Adler-32 shares match the new bytes, a failing chunk fails the encode only after every thread let go of the
buffers, and a publisher with encode threads round-trips bit for bit."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fsdp_hotload.arc.adler import chunk_parts
from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.codecs import ArcV2, ElementDiff, get_codec
from fsdp_hotload.arc.dtypes import numel
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.engine.encode import ChunkEncoder, Encoded, auto_workers
from fsdp_hotload.engine.staging import Stager
from fsdp_hotload.publish import TensorPublisher, WholeChunk
from tests.snapshots import rebuild_accepted
from tests.publisher_helpers import expected_sha, hf_dir, make_model, train_step


def _chunks() -> list[WholeChunk]:
    """Chunks as a sharded trainer has them: row and column boxes of 2-D tensors, a flat piece, an empty one,
    bf16 and int64, sizes from 0 to ~100 KB."""
    g = torch.Generator().manual_seed(3)
    specs: list[tuple[str, tuple[int, ...], str, Box, torch.dtype]] = [
        ("emb", (300, 96), "shape", Box((100, 0), (200, 96)), torch.bfloat16),
        ("col", (64, 80), "shape", Box((0, 30), (64, 50)), torch.bfloat16),
        ("flat", (4097,), "flat", Box.flat(1000, 3097), torch.bfloat16),
        ("empty", (7,), "flat", Box.flat(7, 0), torch.bfloat16),
        ("ids", (9, 5), "shape", Box((2, 0), (7, 5)), torch.int64),
    ]
    out = []
    for name, shape, space, box, dtype in specs:
        n = box.numel
        t = (torch.randn(n, generator=g) * 0.02).to(dtype) if dtype.is_floating_point else torch.arange(n) * 3
        out.append(WholeChunk(name, shape, "BF16" if dtype.is_floating_point else "I64", space, box, t))
    return out


def _space(c: WholeChunk) -> tuple[int, ...]:
    return (numel(c.shape),) if c.space == "flat" else tuple(c.shape)


def _staged(seed: int) -> tuple[list[WholeChunk], Stager, torch.Tensor, Encoded]:
    """A stager whose cache holds the chunks' bytes, then a new slot staged after an RL-like update."""
    cs = _chunks()
    st = Stager(cs, slots=1)
    first = st.acquire(wait=False)
    assert first is not None
    st.wait_event(st.stage(first))
    full = ChunkEncoder(cs, st, get_codec("arc_v2")).encode(first, "full", [(0, 0)] * len(cs))
    st.promote(first)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in cs:
            if c.source.is_floating_point():
                mask = torch.rand(c.source.shape, generator=g) < 0.05
                c.source.add_(mask * torch.randn(c.source.shape, generator=g).to(c.source.dtype) * 1e-2)
        cs[-1].source[3] = -1
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    return cs, st, buf, full


def _bytes(e: Encoded) -> list[tuple[bytes, tuple[int, int], int]]:
    return [(bytes(p), parts, changed) for p, parts, changed in zip(e.payloads, e.parts, e.changed)]


class DiffFirstArcV2:
    """The real ``arc_v2`` codec without its one-pass host method, so the encoder takes the path a GPU rank takes
    (the stager's diff first, then ``encode`` of each chunk's changes) on CPU buffers."""

    def __init__(self) -> None:
        self.codec = ArcV2()
        self.name = self.codec.name

    def encode(self, diff: ElementDiff) -> bytes:
        return self.codec.encode(diff)

    def decode(self, payload: bytes, parent: np.ndarray, itemsize: int, out: np.ndarray) -> None:
        self.codec.decode(payload, parent, itemsize, out)


@pytest.mark.parametrize("codec", ["arc_v2", "arc_v2 diff first", "arc_sparse_v1"])
def test_threads_write_the_bytes_one_thread_writes_and_they_decode_to_the_staged_bytes(codec: str) -> None:
    cs, st, buf, full = _staged(seed=1)
    assert st.cache is not None
    parts = full.parts
    impl: Any = DiffFirstArcV2() if codec == "arc_v2 diff first" else get_codec(codec)
    outs = {}
    for workers in (1, 3):
        enc = ChunkEncoder(cs, st, impl, workers=workers)
        outs[workers] = [enc.encode(buf, kind, parts) for kind in ("delta", "full")]
        enc.close()
    assert [_bytes(run) for run in outs[3]] == [_bytes(run) for run in outs[1]]
    delta, new_full = outs[3]
    assert sum(delta.changed) > 0
    for c, s, d, f in zip(cs, st.slices, _bytes(delta), _bytes(new_full)):
        old = st.cache[s.offset:s.offset + s.nbytes].numpy()
        new = buf[s.offset:s.offset + s.nbytes].numpy()
        out = np.empty_like(new)
        impl.decode(d[0], old, s.itemsize, out)
        assert out.tobytes() == new.tobytes() == f[0], c.name
        want = chunk_parts(new, c.box, _space(c), s.itemsize, s.itemsize * numel(c.shape))
        assert d[1] == f[1] == want, c.name  # shares updated from the changes alone equal a full pass
        assert d[2] == int(np.count_nonzero(old.view(f"u{s.itemsize}") != new.view(f"u{s.itemsize}")))


class FailingArcV2(DiffFirstArcV2):
    """Fails one chunk's encode after the others started; records when each encode ended."""

    def __init__(self, bad_bytes: int) -> None:
        super().__init__()
        self.bad_bytes = bad_bytes
        self.ended: list[float] = []
        self.lock = threading.Lock()

    def encode(self, diff: ElementDiff) -> bytes:
        if diff.n * diff.itemsize == self.bad_bytes:
            raise RuntimeError("injected encode failure")
        time.sleep(0.2)
        with self.lock:
            self.ended.append(time.monotonic())
        return super().encode(diff)


def test_a_failing_chunk_fails_the_encode_after_every_thread_let_go_of_the_buffers() -> None:
    cs, st, buf, full = _staged(seed=2)
    codec = FailingArcV2(bad_bytes=st.slices[0].nbytes)  # the largest chunk: submitted, and failing, first
    enc = ChunkEncoder(cs, st, codec, workers=2)
    with pytest.raises(RuntimeError, match="injected encode failure"):
        enc.encode(buf, "delta", full.parts)
    raised = time.monotonic()
    assert len(codec.ended) == len(cs) - 1 and max(codec.ended) <= raised
    enc.close()


def test_automatic_thread_count() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert auto_workers(cpu, cpu_count=64, local_ranks=1) == 1  # a CPU trainer's cores train
    assert auto_workers(gpu, cpu_count=16, local_ranks=1) == 4
    assert auto_workers(gpu, cpu_count=96, local_ranks=8) == 4
    assert auto_workers(gpu, cpu_count=48, local_ranks=8) == 3
    assert auto_workers(gpu, cpu_count=8, local_ranks=8) == 1
    with pytest.raises(ValueError, match="encode workers"):
        ChunkEncoder([], Stager([], slots=1), get_codec("arc_v2"), workers=0)
    with pytest.raises(ValueError, match="encode_workers"):
        HotloadConfig(bucket_url="/tmp/b", encode_workers=0)


def test_a_publisher_with_encode_threads_round_trips_bit_exact(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    bucket = tmp_path / "bucket"
    cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf_dir(tmp_path)), full_every=4, encode_workers=3)
    states = []
    with caplog.at_level(logging.INFO, logger="fsdp_hotload"), TensorPublisher(model, cfg) as pub:
        assert pub.engine.encoder.workers == 3
        for step in range(8):
            train_step(model, step)
            assert pub.publish(step, model)
            pub.wait()
            states.append(expected_sha(model))
    assert [m.kind for m in pub.metrics] == (["full"] + ["delta"] * 3) * 2
    assert caplog.text.count("3 encode thread(s) per rank") == 1  # said once, at the first delta
    rebuilt = rebuild_accepted(bucket, pub.metrics)
    for m, want in zip(pub.metrics, states):
        assert {k: t.digest() for k, t in rebuilt[m.identity].items()} == want
