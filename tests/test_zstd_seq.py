"""The arc_v2 sequence encoder: zero-run sequences entropy-coded by libzstd, stitched into one zstd frame.

Every frame is decoded by python-zstandard (its own bundled libzstd, one-shot and streaming) and compared byte for
byte with the XOR it was built from.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_hotload.arc import seq_delta, zstd_seq
from fsdp_hotload.arc.codecs import ArcV2
from fsdp_hotload.arc.dense import run_tables
from fsdp_hotload.arc.errors import FormatError
from fsdp_hotload.arc.kernels import zero_run_sequences, zero_run_table

ROOT = Path(__file__).resolve().parents[1]
ENC = zstd_seq.sequence_encoder()
needs_libzstd = pytest.mark.skipif(ENC is None, reason=f"sequence encoder unavailable: {zstd_seq.encoder_status()}")


def _sparse_bytes(rng: np.random.Generator, n: int, density: float) -> np.ndarray:
    x = np.zeros(n, dtype=np.uint8)
    hits = rng.random(n) < density
    x[hits] = rng.integers(1, 256, size=int(hits.sum()), dtype=np.uint8)
    return x


def _split(x: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    edges = sorted({0, x.size, *(c % (x.size + 1) for c in cuts)})
    return [x[a:b] for a, b in zip(edges, edges[1:])]


def _decode_both_ways(frame: bytes, n: int) -> bytes:
    params = zstandard.get_frame_parameters(frame)
    assert params.content_size == n and not params.has_checksum
    one_shot = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(n, 1))
    streamed = zstandard.ZstdDecompressor().stream_reader(frame).read(n + 1)
    assert one_shot == streamed
    return one_shot


def _replay(x: np.ndarray, seqs: np.ndarray, k: int) -> bytes:
    """Rebuild a block from its sequences the way a zstd decoder would (literals, then an offset-1 copy)."""
    out = bytearray()
    pos = 0
    for off, lit, match, _ in seqs[:k]:
        assert off == 1 and lit >= 1
        out += x[pos:pos + lit].tobytes()
        for _ in range(match):
            out.append(out[-1])
        pos += lit + match
    return bytes(out + x[pos:].tobytes())


@given(n=st.integers(0, 3000), density=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]), min_run=st.integers(3, 9),
       seed=st.integers(0, 2**31))
@settings(max_examples=150, deadline=None)
def test_zero_run_sequences_replay_to_the_block(n: int, density: float, min_run: int, seed: int) -> None:
    x = _sparse_bytes(np.random.default_rng(seed), n, density)
    seqs = np.zeros((n // (min_run + 1) + 2, 4), dtype=np.uint32)
    k = zero_run_sequences(x, x[:n // 8 * 8].view(np.uint64), seqs, min_run, zero_run_table(min_run))
    assert _replay(x, seqs, k) == x.tobytes()
    assert all(m >= min_run for m in seqs[:k, 2])
    # every zero run longer than min_run became one match: no run that long is left in the literals
    lits = np.ones(n, dtype=bool)
    pos = 0
    for _, lit, match, _ in seqs[:k]:
        pos += int(lit)
        lits[pos:pos + int(match)] = False
        pos += int(match)
    zero_lit = np.flatnonzero(~lits | (x != 0))  # positions that break a literal zero run
    gaps = np.diff(np.concatenate([[-1], zero_lit, [n]])) - 1
    assert gaps.max(initial=0) <= min_run


@needs_libzstd
@given(n=st.integers(0, 3 * zstd_seq.MAX_BLOCK + 50), density=st.sampled_from([0.0, 0.003, 0.03, 0.3, 1.0]),
       cuts=st.lists(st.integers(0, 1 << 20), max_size=4), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_frame_decodes_to_the_xor(n: int, density: float, cuts: list[int], seed: int) -> None:
    """Any block split (unaligned, larger than a zstd block, empty chunk) gives one frame of the exact bytes."""
    x = _sparse_bytes(np.random.default_rng(seed), n, density)
    frame = ENC.encode([b.data for b in _split(x, cuts)], n)  # type: ignore[union-attr]
    assert _decode_both_ways(frame, n) == x.tobytes()


@needs_libzstd
def test_rl_like_xor_is_smaller_than_the_stream_encoder() -> None:
    """bf16 steps at RL learning rates: the sequence frame decodes to the same bytes and is smaller."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(1 << 20) * 0.02).astype(np.float32)
    step = np.sign(rng.standard_normal(w.size)).astype(np.float32) * 6e-7

    def bf16(v: np.ndarray) -> np.ndarray:
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)

    old, new = bf16(w), bf16(w + step)
    x = old ^ new
    assert 0.005 < np.count_nonzero(x.view(np.uint16)) / w.size < 0.05
    seq = ArcV2(encoder="sequences").encode_xor_blocks([x.data], x.size)
    stream = ArcV2(encoder="stream").encode_xor_blocks([x.data], x.size)
    assert _decode_both_ways(seq, x.size) == _decode_both_ways(stream, x.size) == x.tobytes()
    assert len(seq) < 0.85 * len(stream)


@needs_libzstd
def test_split_blocks_fall_back_to_raw_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """If libzstd ever answers one block with several, that block is stored raw and the frame stays exact."""
    calls = []
    real = seq_delta._single_block

    def every_other(frame: np.ndarray, end: int) -> int:
        calls.append(end)
        return -1 if len(calls) % 2 else real(frame, end)  # -1: several blocks

    monkeypatch.setattr(seq_delta, "_single_block", every_other)
    x = _sparse_bytes(np.random.default_rng(3), 5 * zstd_seq.MAX_BLOCK + 7, 0.02)
    frame = ENC.encode([x.data], x.size)  # type: ignore[union-attr]
    assert len(calls) == 6
    assert _decode_both_ways(frame, x.size) == x.tobytes()


@needs_libzstd
def test_threads_encode_concurrently() -> None:
    rng = np.random.default_rng(5)
    xs = [_sparse_bytes(rng, 2 * zstd_seq.MAX_BLOCK + 99 * i, 0.01 * (i + 1)) for i in range(6)]
    frames: dict[int, bytes] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                frames[i] = ENC.encode([xs[i].data], xs[i].size)  # type: ignore[union-attr]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, x in enumerate(xs):
        assert _decode_both_ways(frames[i], x.size) == x.tobytes()


@needs_libzstd
@given(n_items=st.integers(0, (3 * zstd_seq.MAX_BLOCK + 50) // 8), itemsize=st.sampled_from([1, 2, 4, 8]),
       density=st.sampled_from([0.0, 0.003, 0.03, 0.3, 1.0]), shift=st.integers(0, 7), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_one_call_writes_the_block_paths_frame(n_items: int, itemsize: int, density: float, shift: int,
                                               seed: int) -> None:
    """The compiled per-chunk call gives the block path's frame byte for byte, its changed count and Adler-32
    share delta, for any element size and for chunks that start off an 8-byte boundary."""
    assert zstd_seq.one_call_status() == (True, "one call per chunk")  # also makes libzstd visible to numba
    rng = np.random.default_rng(seed)
    n = n_items * itemsize
    room = np.zeros(2 * (n + 8), dtype=np.uint8)
    parent = room[shift:shift + n]
    parent[:] = rng.integers(0, 256, size=n, dtype=np.uint8)
    new = room[n + 8 + (7 - shift):n + 8 + (7 - shift) + n]
    new[:] = parent ^ _sparse_bytes(rng, n, density)
    runs = [(3 * i, min(5, n_items - i)) for i in range(0, n_items, 5)]  # runs spread over a larger tensor
    tables = run_tables(runs, itemsize)
    total = (3 * n_items + 5) * itemsize
    block = zstd_seq.SequenceEncoder(ENC.lib, one_call=False).encode_delta(  # type: ignore[union-attr]
        parent, new, itemsize, tables, total)
    one = zstd_seq.SequenceEncoder(ENC.lib, one_call=True).encode_delta(  # type: ignore[union-attr]
        parent, new, itemsize, tables, total)
    assert one == block
    assert _decode_both_ways(one[0], n) == (parent ^ new).tobytes()
    assert one[1] == int(np.count_nonzero((parent ^ new).reshape(-1, itemsize).any(axis=1))) if n else one[1] == 0
    # the share delta from its definition: a byte at tensor position g changing by d adds d to A, (total - g) * d to B
    g = np.concatenate([np.arange(off * itemsize, (off + c) * itemsize) for off, c in runs] or [np.zeros(0, int)])
    d = new.astype(np.int64) - parent.astype(np.int64)
    assert one[2] == (int(d.sum()) % 65521, int(((total - g) * d).sum()) % 65521)


@needs_libzstd
@given(n_items=st.integers(0, (3 * zstd_seq.MAX_BLOCK + 50) // 8), itemsize=st.sampled_from([1, 2, 4, 8]),
       density=st.sampled_from([0.0, 0.003, 0.03, 0.3, 1.0]), seed=st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_sparse_call_writes_the_block_paths_frame(n_items: int, itemsize: int, density: float, seed: int) -> None:
    """The device diff's one-call encoder (positions and old/new values in, no chunk-sized XOR) gives the block
    path's frame byte for byte, for every element size, and ArcV2.encode of an ElementDiff uses it."""
    from fsdp_hotload.arc.codecs import ElementDiff
    from fsdp_hotload.arc.dtypes import UINT_BY_SIZE

    assert zstd_seq.one_call_status() == (True, "one call per chunk")
    rng = np.random.default_rng(seed)
    u = UINT_BY_SIZE[itemsize]
    old = rng.integers(0, 256, size=n_items * itemsize, dtype=np.uint8).view(u)
    new = (old.view(np.uint8) ^ _sparse_bytes(rng, n_items * itemsize, density)).view(u)
    idx = np.flatnonzero(old != new).astype(np.int64)
    xor = (old ^ new).view(np.uint8)
    block = zstd_seq.SequenceEncoder(ENC.lib, one_call=False)  # type: ignore[union-attr]
    want = block.encode([xor.data], xor.size)
    assert block.encode_sparse(idx, old[idx], new[idx], xor.size, itemsize) is None  # block path: caller's job
    one = zstd_seq.SequenceEncoder(ENC.lib, one_call=True)  # type: ignore[union-attr]
    assert one.encode_sparse(idx, old[idx], new[idx], xor.size, itemsize) == want
    assert ArcV2(encoder="sequences").encode(ElementDiff(n_items, itemsize, idx, old[idx], new[idx])) == want
    assert _decode_both_ways(want, xor.size) == xor.tobytes()


@needs_libzstd
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("gap", range(zstd_seq.MIN_RUN - 1, zstd_seq.MIN_RUN + 4))
def test_zero_runs_near_the_threshold_give_the_same_frame_on_every_path(itemsize: int, gap: int) -> None:
    """Zero runs of about ``MIN_RUN`` bytes at a chunk's start, between changes (inside a word and across words),
    at each block's end and start, and at the chunk's end: the sparse call, which finds its zero runs from the
    changed positions, and the dense one-call path write the block path's frame byte for byte."""
    assert zstd_seq.one_call_status() == (True, "one call per chunk")
    block_len = zstd_seq.MAX_BLOCK
    n = (2 * block_len + 8 * gap + 40) // itemsize * itemsize
    xor = np.zeros(n, dtype=np.uint8)
    marks = [gap, 2 * gap + 1]  # a leading run of gap bytes, then a run of gap bytes between two changes
    for q in range(8):  # runs of gap to gap + 2 bytes, starting at different offsets within a word
        marks.append(marks[-1] + gap + 1 + q % 3)
    for end in (block_len, 2 * block_len):  # gap zero bytes before a block's end, and gap after the next block's start
        marks += [end - 1 - gap, end + gap]
    marks.append(n - 1 - gap)  # a trailing run of gap bytes
    xor[[m for m in marks if 0 <= m < n]] = 0xA5
    rng = np.random.default_rng(gap)
    old = rng.integers(0, 256, size=n, dtype=np.uint8)
    new = old ^ xor
    u = np.dtype(f"<u{itemsize}")
    idx = np.flatnonzero((xor.view(u) != 0)).astype(np.int64)
    want = zstd_seq.SequenceEncoder(ENC.lib, one_call=False).encode([xor.data], n)  # type: ignore[union-attr]
    one = zstd_seq.SequenceEncoder(ENC.lib, one_call=True)  # type: ignore[union-attr]
    assert one.encode_sparse(idx, old.view(u)[idx], new.view(u)[idx], n, itemsize) == want
    tables = run_tables([(0, n // itemsize)], itemsize)
    assert one.encode_delta(old, new, itemsize, tables, n)[0] == want
    assert _decode_both_ways(want, n) == xor.tobytes()


@needs_libzstd
def test_sparse_call_refuses_positions_out_of_order_or_range() -> None:
    """Positions come from a device; a wrong one must fail the chunk, not write outside the block."""
    one = zstd_seq.SequenceEncoder(ENC.lib, one_call=True)  # type: ignore[union-attr]
    vals = np.array([1, 2, 3], dtype=np.uint16)
    zero = np.zeros(3, dtype=np.uint16)
    assert one.encode_sparse(np.array([1, 5, 9], np.int64), zero, vals, 20, 2) is not None
    for bad in ([1, 5, 5], [5, 1, 9], [1, 5, 10], [-1, 5, 9], [1, 5, 1 << 40]):
        with pytest.raises(FormatError, match="not increasing, or fall outside"):
            one.encode_sparse(np.array(bad, np.int64), zero, vals, 20, 2)
    big = zstd_seq.MAX_BLOCK  # a position behind the block being written, after a block boundary
    with pytest.raises(FormatError, match="not increasing"):
        one.encode_sparse(np.array([big, 3, big + 1], np.int64), zero, vals, 4 * big, 2)


@needs_libzstd
def test_one_call_paths_refuse_a_chunk_of_partial_elements() -> None:
    """The block path (DenseDelta) refuses a chunk that is not whole elements; the one-call paths encoded it, and
    the changed count (or the last element's sequence) came out wrong."""
    one = zstd_seq.SequenceEncoder(ENC.lib, one_call=True)  # type: ignore[union-attr]
    old, new = np.zeros(9, np.uint8), np.ones(9, np.uint8)
    tables = run_tables([(0, 4)], 2)
    with pytest.raises(FormatError, match="not whole elements of 2 bytes"):
        one.encode_delta(old, new, 2, tables, 9)
    with pytest.raises(FormatError, match="not whole elements of 2 bytes"):
        one.encode_sparse(np.array([1], np.int64), np.zeros(1, np.uint16), np.ones(1, np.uint16), 9, 2)


@needs_libzstd
@pytest.mark.parametrize("itemsize, position", [(8, 1 << 61), (8, (1 << 61) + 1), (4, 1 << 62)])
def test_sparse_call_refuses_positions_whose_byte_offset_wraps(itemsize: int, position: int) -> None:
    """A position so large that its byte offset overflows 64 bits must not wrap into the chunk's first bytes."""
    one = zstd_seq.SequenceEncoder(ENC.lib, one_call=True)  # type: ignore[union-attr]
    u = {4: np.uint32, 8: np.uint64}[itemsize]
    with pytest.raises(FormatError, match="not increasing, or fall outside"):
        one.encode_sparse(np.array([position], np.int64), np.zeros(1, u), np.ones(1, u), 8 * itemsize, itemsize)


@pytest.mark.parametrize("path", ["stream", "sequences block by block"])
@pytest.mark.parametrize("bad", [[10], [3, 10], [-1], [5, 3], [4, 4], [1 << 40]])
def test_block_paths_refuse_positions_out_of_order_or_range(path: str, bad: list[int]) -> None:
    """ArcV2.encode without the one-call kernel (HOTLOAD_ARC_ENCODER=stream, HOTLOAD_ARC_ONE_CALL=0, no libzstd
    1.5) fails a wrong diff as the kernel does: position 10 of 10 elements would be scattered past the end of
    the block buffer, and the others dropped or misplaced in a frame that decodes to bytes never staged."""
    from fsdp_hotload.arc.codecs import ElementDiff

    codec = ArcV2(encoder="stream")
    if path != "stream":
        ENC or pytest.skip("sequence encoder unavailable")
        codec = ArcV2(encoder="sequences")
        codec._seq = zstd_seq.SequenceEncoder(ENC.lib, one_call=False)  # type: ignore[union-attr]
    n = len(bad)
    diff = ElementDiff(10, 8, np.array(bad, np.int64), np.zeros(n, np.uint64), np.full(n, 0xAB, np.uint64))
    with pytest.raises(FormatError, match="not increasing, or fall outside"):
        codec.encode(diff)



def test_single_block_reads_libzstd_frames() -> None:
    """The compiled frame check: a one-block frame gives its block's offset, several blocks -1, and a frame with a
    checksum, a reserved block type or a truncated block -2."""
    one = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(1000))
    head = 7  # magic, descriptor (single segment), 2-byte content size
    assert seq_delta._single_block(np.frombuffer(one, dtype=np.uint8), len(one)) == head
    two = bytearray(one[:head]) + b"\x08\x00\x00\x01\x01\x00\x00"  # raw block of one byte, then an empty last one
    assert seq_delta._single_block(np.frombuffer(bytes(two), dtype=np.uint8), len(two)) == -1
    checksum = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(bytes(1000))
    assert seq_delta._single_block(np.frombuffer(checksum, dtype=np.uint8), len(checksum)) == -2
    reserved = bytearray(one)
    reserved[head] |= 0x06
    assert seq_delta._single_block(np.frombuffer(bytes(reserved), dtype=np.uint8), len(reserved)) == -2
    assert seq_delta._single_block(np.frombuffer(one, dtype=np.uint8), len(one) - 1) == -2


def test_block_sizes_must_add_up() -> None:
    enc = ENC or pytest.skip("sequence encoder unavailable")
    with pytest.raises(FormatError, match="add up to 10 bytes, 11 announced"):
        enc.encode([bytes(10)], 11)


def test_encoder_choice_is_validated() -> None:
    with pytest.raises(FormatError, match="encoder 'zip'"):
        ArcV2(encoder="zip")
    assert ArcV2(encoder="stream").encoder == "stream"
    assert ArcV2().encoder == ("sequences" if ENC is not None else "stream")


def _probe(env: dict[str, str], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, text=True,
                          capture_output=True, timeout=120)


def test_missing_library_falls_back_to_the_stream_encoder() -> None:
    code = ("from fsdp_hotload.arc.codecs import ArcV2; from fsdp_hotload.arc import zstd_seq\n"
            "print(ArcV2().encoder, '|', zstd_seq.encoder_status(), '|', ArcV2().encoder_info)\n"
            "ArcV2(encoder='sequences')\n")
    r = _probe({"HOTLOAD_LIBZSTD": "/nonexistent/libzstd.so.1", "HOTLOAD_ARC_ENCODER": "auto"}, code)
    first = r.stdout.strip()
    assert first.startswith("stream | libzstd not loadable"), r.stdout + r.stderr
    assert "HOTLOAD_LIBZSTD" in first
    assert first.split(" | ")[2].startswith("stream (sequence encoder unavailable: libzstd not loadable")
    assert "arc_v2 encoder 'sequences' is unavailable: libzstd not loadable" in r.stderr
    r = _probe({"HOTLOAD_ARC_ENCODER": "stream"},
               "from fsdp_hotload.arc.codecs import ArcV2; print(ArcV2().encoder_info)")
    assert r.stdout.strip() == "stream (chosen)", r.stderr


def test_a_library_asked_for_that_does_not_load_is_a_warning(tmp_path: Path) -> None:
    """HOTLOAD_LIBZSTD names the library to use: when it does not load, the publisher still falls back to the
    stream encoder (payloads a quarter to a third larger), and says so as a warning, not at INFO, which the CLI and
    most trainers do not show."""
    code = ("import logging, sys, torch\n"
            "logging.basicConfig(level=logging.WARNING, stream=sys.stderr)\n"
            "from fsdp_hotload import HotloadConfig\nfrom fsdp_hotload.publish import TensorPublisher\n"
            f"TensorPublisher({{'w': torch.zeros(4)}}, HotloadConfig(bucket_url={str(tmp_path)!r})).close()\n")
    r = _probe({"HOTLOAD_LIBZSTD": "/nonexistent/libzstd.so.1", "HOTLOAD_ARC_ENCODER": "auto"}, code)
    assert r.returncode == 0, r.stderr
    assert "WARNING:fsdp_hotload:arc_v2 encoder: stream (sequence encoder unavailable: libzstd not loadable" \
        in r.stderr, r.stderr


@needs_libzstd
def test_one_call_can_be_turned_off() -> None:
    """Decided at the first delta, not when the encoder is built; the environment can turn it off."""
    code = ("from fsdp_hotload.arc import zstd_seq; from fsdp_hotload.arc.dense import run_tables; import numpy as np\n"
            "enc = zstd_seq.sequence_encoder(); print(enc.one_call, zstd_seq._ONE_CALL)\n"
            "x = np.zeros(64, np.uint8); enc.encode_delta(x, x, 2, run_tables([(0, 32)], 2), 64)\n"
            "print(enc.one_call, zstd_seq.one_call_status())")
    r = _probe({"HOTLOAD_ARC_ONE_CALL": "0"}, code)
    assert r.stdout.split("\n")[:2] == ["None None", "False (False, 'block by block (HOTLOAD_ARC_ONE_CALL=0)')"], \
        r.stdout + r.stderr
    r = _probe({}, code)
    assert r.stdout.split("\n")[:2] == ["None None", "True (True, 'one call per chunk')"], r.stdout + r.stderr


@needs_libzstd
def test_one_call_asked_for_directly_makes_libzstd_visible_first() -> None:
    """An encoder built with ``one_call=True`` before anything decided it still links the compiled code to
    libzstd before calling it (an unresolved symbol would be a jump to address 0)."""
    code = ("from fsdp_hotload.arc import zstd_seq; from fsdp_hotload.arc.dense import run_tables; import numpy as np\n"
            "enc = zstd_seq.SequenceEncoder(zstd_seq.sequence_encoder().lib, one_call=True)\n"
            "a = np.zeros(1 << 18, np.uint8); b = a.copy(); b[::97] = 3\n"
            "frame, changed, _ = enc.encode_delta(a, b, 2, run_tables([(0, 1 << 17)], 2), 1 << 18)\n"
            "import zstandard; assert zstandard.decompress(frame) == (a ^ b).tobytes(); print(changed)")
    r = _probe({}, code)
    assert r.returncode == 0 and r.stdout.strip() == str(len(range(0, 1 << 18, 97))), r.stdout + r.stderr


@pytest.mark.parametrize("n", [0, 1, 255, 256, 65791, 65792, 1 << 17, (1 << 17) + 1, (1 << 32) + 5])
def test_frame_header_matches_libzstd_layout(n: int) -> None:
    """Up to one window the header is byte for byte libzstd's own (single segment); beyond, it declares the
    128 KB window every block fits in."""
    header = zstd_seq.frame_header(n)
    ours = zstandard.get_frame_parameters(header + b"\x01\x00\x00")
    assert ours.content_size == n and not ours.has_checksum and ours.dict_id == 0
    if n <= 1 << 17:
        ref = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(n))
        assert ref[:len(header)] == header
    else:
        assert ours.window_size == 1 << 17


@pytest.mark.parametrize("variable, value", [("HOTLOAD_ARC_ONE_CALL", "false"), ("HOTLOAD_ARC_ONE_CALL", "off"),
                                             ("HOTLOAD_ARC_ENCODER", "zip")])
def test_a_bad_codec_switch_is_refused_naming_its_variable(monkeypatch: pytest.MonkeyPatch, variable: str,
                                                          value: str) -> None:
    """Only ``0`` turned the one-call path off, so ``false`` or ``off`` kept it on in silence; a bad encoder name
    was reported without the variable it came from. Both fail where the encoder is chosen (the publisher's
    construction), naming the variable."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(FormatError, match=variable):
        ArcV2().encoder_info


def test_kernel_caches_follow_the_sources_of_the_functions_they_call(tmp_path: Path) -> None:
    """numba's cache=True rebuilds a function when its own file changes, not when a function it calls from
    another file does: after an edit of ``kernels.py`` alone, ``seq_delta``'s cached kernels kept the old code.
    ``jit_cache.refresh`` (run when ``fsdp_hotload.arc`` is imported) empties such caches. Two small modules in a
    fresh folder, each run in its own process."""
    pkg = tmp_path / "kern"
    pkg.mkdir()
    (pkg / "callee_mod.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef callee(x):\n"
                                       "    return x + 1\n")
    (pkg / "caller_mod.py").write_text("from numba import njit\nfrom callee_mod import callee\n\n"
                                       "@njit(cache=True)\ndef caller(x):\n    return callee(x) * 10\n")
    script = ("import sys\nfrom pathlib import Path\nimport callee_mod, caller_mod\n"
              "from fsdp_hotload.arc import jit_cache\n"
              "if sys.argv[1] == 'refresh':\n"
              "    jit_cache.refresh([callee_mod, caller_mod], Path(callee_mod.__file__).parent)\n"
              "print(caller_mod.caller(1))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg), str(Path(__file__).resolve().parents[1])])}
    env.pop("NUMBA_CACHE_DIR", None)

    def run(mode: str) -> str:
        out = subprocess.run([sys.executable, "-c", script, mode], cwd=pkg, env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    assert run("refresh") == "20"
    assert list((pkg / "__pycache__").glob("caller_mod.caller-*.nbi"))  # cached
    (pkg / "callee_mod.py").write_text("from numba import njit\n\n@njit(cache=True)\ndef callee(x):\n"
                                       "    return x + 2\n")
    assert run("plain") == "20"  # numba alone: the caller's cache still holds the old callee
    assert run("refresh") == "30"
    (index,) = (pkg / "__pycache__").glob("caller_mod.caller-*.nbi")
    before = index.stat().st_mtime_ns
    assert run("refresh") == "30"
    assert index.stat().st_mtime_ns == before  # kept (not emptied again) while the sources stay as they are


def test_every_arc_module_with_cached_kernels_is_refreshed_at_import() -> None:
    """The refresh at ``import fsdp_hotload.arc`` took a list of modules kept by hand, and ``sparse_decode`` (split
    out of ``sparse_kernels``) was missing: its cached decoder kept ``sparse_kernels``' old helpers after an edit of
    that file alone, and disagreed with the encoder. Run in a fresh process, so the import is the first."""
    script = ("import importlib, pkgutil\nimport fsdp_hotload.arc as arc\nfrom fsdp_hotload.arc import jit_cache\n"
              "taken = set(jit_cache.refreshed)\n"
              "names = [m.name for m in pkgutil.iter_modules(arc.__path__)]\n"
              "mods = [importlib.import_module(f'fsdp_hotload.arc.{name}') for name in names]\n"
              "print(sorted(m.__name__ for m in mods if jit_cache.cached_kernels([m])))\n"
              "print(sorted(m.__name__ for m in mods if jit_cache.cached_kernels([m]) and m.__name__ not in taken))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    with_kernels, missed = out.stdout.strip().splitlines()
    assert "fsdp_hotload.arc.sparse_decode" in with_kernels and "fsdp_hotload.arc.kernels" in with_kernels
    assert missed == "[]"
