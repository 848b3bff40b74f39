"""Tests of the ``arc_sparse_v1`` codec (round trips, strict decoding) and of the RL-like snapshot generator."""
from __future__ import annotations

import importlib.util
import sys
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_hotload.arc import sparse
from fsdp_hotload.arc.codecs import element_diff, get_codec
from fsdp_hotload.arc.dtypes import UINT_BY_SIZE
from fsdp_hotload.arc.errors import FormatError
from fsdp_hotload.arc.sparse import MODE_CLASS, MODE_SPARSE, SPARSE_CODEC, SparseCodec

ROOT = Path(__file__).resolve().parent.parent


def _load_rl_data() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("rl_data", ROOT / "benchmarks" / "rl_data.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("rl_data", mod)
    spec.loader.exec_module(mod)
    return mod


rl_data = _load_rl_data()
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------------- helpers
def make_chunks(seed: int, itemsize: int, n: int, density: float, kind: str, first: bool,
                last: bool) -> tuple[np.ndarray, np.ndarray]:
    """Parent/new chunks as flat uint8 arrays: weight-like or random parents, ulp-sized or random changes."""
    rng = np.random.default_rng(seed)
    u = UINT_BY_SIZE[itemsize]
    if kind == "weights" and itemsize in (2, 4):
        w = (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)
        parent = (w >> 16).astype(np.uint16) if itemsize == 2 else w
    else:
        parent = rng.integers(0, 256, n * itemsize, dtype=np.uint8).view(u)
    mask = rng.random(n) < density
    if n:
        mask[0] |= first
        mask[-1] |= last
    new = parent.copy()
    if kind == "random":
        vals = rng.integers(0, 256, n * itemsize, dtype=np.uint8).view(u)
        new[mask] = vals[mask]
    else:
        step = rng.choice(np.array([1, 1, 1, 2, 3], dtype=u), size=n)
        up = rng.random(n) < 0.5
        new[mask & up] += step[mask & up]
        new[mask & ~up] -= step[mask & ~up]
    return parent.view(np.uint8), new.view(np.uint8)


def roundtrip(payload: bytes, parent: np.ndarray, new: np.ndarray, itemsize: int) -> None:
    out = np.full_like(parent, 0xA5)
    get_codec(SPARSE_CODEC).decode(payload, parent, itemsize, out)
    assert np.array_equal(out, new)


def header(payload: bytes) -> tuple[dict[str, int], int]:
    """Header fields of a payload and the offset of its model section."""
    fields: dict[str, int] = {"version": payload[4], "itemsize": payload[5], "mode": payload[6]}
    pos = 7
    for name in ("n", "k", "mlen", "slen"):
        v = sh = 0
        while True:
            b = payload[pos]
            pos += 1
            v |= (b & 127) << sh
            sh += 7
            if b < 128:
                break
        fields[name] = v
    return fields, pos


def varint(v: int) -> bytes:
    out = bytearray()
    while v >= 128:
        out.append((v & 127) | 128)
        v >>= 7
    out.append(v)
    return bytes(out)


def seal(body: bytes) -> bytes:
    """A version-2 payload's CRC-32 appended, so that a test's edit reaches the checks behind it."""
    return body + zlib.crc32(body).to_bytes(4, "little")


def with_header(payload: bytes, *, magic: bytes = b"ASPC", tail: bytes = b"", cut: int = 0,
                **changes: int) -> bytes:
    """The payload with some header fields replaced, ``cut`` bytes taken off its body and ``tail`` added (the
    CRC-32 recomputed)."""
    fields, pos = header(payload)
    body = payload[pos:-4]
    fields.update(changes)
    head = magic + bytes((fields["version"], fields["itemsize"], fields["mode"]))
    head += b"".join(varint(fields[f]) for f in ("n", "k", "mlen", "slen"))
    return seal(head + body[:len(body) - cut] + tail)


def craft(mode: int, itemsize: int, n: int, k: int, ops: list[tuple[int, int, int]]) -> bytes:
    """A payload from hand-written (kind, context, value) ops: a well-formed stream with chosen contents."""
    kind = np.array([o[0] for o in ops], np.uint8)
    ctx = np.array([o[1] for o in ops], np.uint8)
    val = np.array([o[2] for o in ops], np.uint64)
    return SparseCodec._pack(mode, itemsize, n, k, (kind, ctx, val))


def rl_pair(total_params: int = 200_000, seed: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    snaps = list(rl_data.rl_snapshots(total_params=total_params, steps=2, lr=1e-6, seed=seed))
    return [(snaps[1][n].view(torch.uint8).numpy().reshape(-1), snaps[2][n].view(torch.uint8).numpy().reshape(-1))
            for n in snaps[0]]


def assert_rejects(payload: bytes, parent: np.ndarray, itemsize: int, match: str | None = None) -> None:
    out = np.empty_like(parent)
    with pytest.raises(FormatError, match=match):
        SparseCodec().decode(payload, parent, itemsize, out)


# ------------------------------------------------------------------------------------------------- round trips
@HYP
@given(
    seed=st.integers(0, 2**32 - 1),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    n=st.one_of(st.integers(0, 8), st.integers(0, 3000)),
    density=st.one_of(st.sampled_from([0.0, 0.001, 0.02, 0.5, 1.0]), st.floats(0, 1)),
    kind=st.sampled_from(["weights", "ulps", "random"]),
    first=st.booleans(),
    last=st.booleans(),
)
def test_roundtrip_both_modes(seed: int, itemsize: int, n: int, density: float, kind: str, first: bool,
                              last: bool) -> None:
    parent, new = make_chunks(seed, itemsize, n, density, kind, first, last)
    codec = SparseCodec()
    roundtrip(codec.encode(element_diff(parent, new, itemsize)), parent, new, itemsize)
    roundtrip(codec.encode_arrays(parent, new, itemsize), parent, new, itemsize)


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_extreme_values_and_full_density(itemsize: int) -> None:
    u = UINT_BY_SIZE[itemsize]
    top = np.iinfo(u).max
    parent = np.array([0, top, 0, top, 1, top - 1, 5, 7], dtype=u)
    new = np.array([top, 0, 1, top - 1, 0, top, 5, 8], dtype=u)  # wrap-around, +-1 at both ends, one unchanged
    p8, n8 = parent.view(np.uint8), new.view(np.uint8)
    codec = SparseCodec()
    for payload in (codec.encode(element_diff(p8, n8, itemsize)), codec.encode_arrays(p8, n8, itemsize)):
        roundtrip(payload, p8, n8, itemsize)


def test_unchanged_and_empty_chunks() -> None:
    for n in (0, 1, 1000):
        a = np.arange(2 * n, dtype=np.uint8)
        payload = SparseCodec().encode_arrays(a, a.copy(), 2)
        assert len(payload) <= 16  # header and CRC-32
        roundtrip(payload, a, a, 2)
        roundtrip(SparseCodec().encode(element_diff(a, a.copy(), 2)), a, a, 2)


def test_rl_updates_round_trip_and_compress() -> None:
    """On generated RL updates both modes are exact, well below 2 bytes a change, and class mode is smaller."""
    changed = sparse_bytes = class_bytes = 0
    for parent, new in rl_pair():
        p1 = SparseCodec().encode(element_diff(parent, new, 2))
        p2 = SparseCodec().encode_arrays(parent, new, 2)
        roundtrip(p1, parent, new, 2)
        roundtrip(p2, parent, new, 2)
        changed += int((parent.view(np.uint16) != new.view(np.uint16)).sum())
        sparse_bytes += len(p1)
        class_bytes += len(p2)
    assert changed > 1000
    assert sparse_bytes < 1.5 * changed
    assert class_bytes < sparse_bytes


def test_registered_and_kernels_release_the_gil() -> None:
    codec = get_codec(SPARSE_CODEC)
    assert isinstance(codec, SparseCodec) and codec.name == "arc_sparse_v1"
    kernels = [sparse._class_pass, sparse._ops_class, sparse._ops_sparse, sparse._build_model,
               sparse._encode_stream, sparse._parse_model, sparse._decode_sparse, sparse._decode_class]
    assert all(k.targetoptions.get("nogil") for k in kernels)


def test_encoder_rejects_bad_diffs() -> None:
    a = np.zeros(8, np.uint8)
    b = a.copy()
    b[2] = 1
    d = element_diff(a, b, 2)
    codec = SparseCodec()
    with pytest.raises(FormatError, match="equal"):
        codec.encode(type(d)(d.n, 2, d.idx, d.old, d.old.copy()))
    with pytest.raises(FormatError, match="increasing"):
        codec.encode(type(d)(d.n, 2, np.array([1, 1]), np.zeros(2, np.uint16), np.ones(2, np.uint16)))
    with pytest.raises(FormatError, match="below n"):
        codec.encode(type(d)(d.n, 2, np.array([9]), np.zeros(1, np.uint16), np.ones(1, np.uint16)))
    with pytest.raises(FormatError):
        codec.encode_arrays(a, b[:6], 2)


# --------------------------------------------------------------------------------------------- strict decoding
@pytest.fixture(scope="module")
def valid() -> dict[int, tuple[bytes, np.ndarray]]:
    snaps = list(rl_data.rl_snapshots(total_params=200_000, steps=2, lr=1e-6, seed=5))
    parent, new = (snaps[i]["layers.0.attn.qkv.weight"].view(torch.uint8).numpy().reshape(-1) for i in (1, 2))
    return {MODE_SPARSE: (SparseCodec().encode(element_diff(parent, new, 2)), parent),
            MODE_CLASS: (SparseCodec().encode_arrays(parent, new, 2), parent)}


@pytest.mark.parametrize("mode", [MODE_SPARSE, MODE_CLASS])
def test_every_truncation_is_rejected(valid: dict[int, tuple[bytes, np.ndarray]], mode: int) -> None:
    payload, parent = valid[mode]
    assert header(payload)[0]["mode"] == mode
    step = max(1, len(payload) // 300)
    for cut in list(range(0, 40)) + list(range(40, len(payload), step)):
        assert_rejects(payload[:cut], parent, 2)


@pytest.mark.parametrize("mode", [MODE_SPARSE, MODE_CLASS])
def test_header_violations(valid: dict[int, tuple[bytes, np.ndarray]], mode: int) -> None:
    payload, parent = valid[mode]
    f, _ = header(payload)
    assert_rejects(with_header(payload, magic=b"ASPX"), parent, 2, "magic")
    assert_rejects(with_header(payload, version=3), parent, 2, "version")
    assert_rejects(with_header(payload, mode=7), parent, 2, "mode")
    assert_rejects(payload, parent, 4, "itemsize")
    assert_rejects(with_header(payload, itemsize=4), parent, 4, "elements")
    assert_rejects(with_header(payload, n=f["n"] + 1), parent, 2, "elements")
    assert_rejects(with_header(payload, k=f["n"] + 1), parent, 2, "changes for")
    assert_rejects(with_header(payload, k=0), parent, 2, "do not fit")
    assert_rejects(with_header(payload, mlen=f["mlen"] + 2**40), parent, 2, "header declares")
    assert_rejects(with_header(payload, slen=2**62), parent, 2, "header declares")
    assert_rejects(seal(payload[:7] + b"\xff" * 11), parent, 2, "longer than 64 bits")
    assert_rejects(with_header(payload, slen=f["slen"] + 1, tail=b"\x00"), parent, 2, "trailing")
    assert_rejects(with_header(payload, slen=f["slen"] - 1, cut=1), parent, 2)
    assert_rejects(with_header(payload, mlen=f["mlen"] + 1, slen=f["slen"] - 1), parent, 2, "model")
    assert_rejects(with_header(payload, k=f["k"] - 1), parent, 2, "trailing|more changes")
    assert_rejects(with_header(payload, k=f["k"] + 1), parent, 2, "truncated|fewer changes")
    small = np.zeros(64, np.uint8)
    assert_rejects(with_header(payload, n=32), small, 2)  # the parent is too small for the changes


def test_model_section_violations(valid: dict[int, tuple[bytes, np.ndarray]]) -> None:
    payload, parent = valid[MODE_CLASS]
    _, pos = header(payload)

    def patched(offset: int, byte: int) -> bytes:
        b = bytearray(payload[:-4])
        b[pos + offset] = byte
        return seal(bytes(b))

    assert payload[pos] <= 15
    assert_rejects(patched(0, 0), parent, 2, "table count")
    assert_rejects(patched(0, 16), parent, 2, "table count")
    assert payload[pos + 1] > 100  # the first class with changes: bf16 exponents of weights are ~100-125
    assert_rejects(patched(1, 0xFF), parent, 2, "context map|truncated")  # first class >= 255 + count bytes
    assert_rejects(patched(2, 0), parent, 2, "context map")  # empty map


def test_crafted_streams_are_rejected() -> None:
    zeros8 = np.zeros(8, np.uint8)
    # a gap that lands past the end of the chunk
    assert_rejects(craft(MODE_SPARSE, 1, 8, 1, [(0, 0, 8), (1, 0, 0)]), zeros8, 1, "past the end")
    # a delta wider than the element (z = 301 > 255)
    assert_rejects(craft(MODE_SPARSE, 1, 8, 1, [(0, 0, 2), (1, 0, 300)]), zeros8, 1, "element width")
    # class mode: 8 elements of class 0; first change at rank 3, then a gap of 9 runs past the class
    z16 = np.zeros(16, np.uint8)
    assert_rejects(craft(MODE_CLASS, 2, 8, 1, [(0, 0, 3), (1, 0, 0), (0, 0, 9)]), z16, 2, "past the end of its")
    assert_rejects(craft(MODE_CLASS, 2, 8, 1, [(0, 0, 3), (1, 0, 0), (0, 0, 5)]), z16, 2, "past the end of its")
    assert_rejects(craft(MODE_CLASS, 2, 8, 1, [(0, 0, 3), (1, 0, 0), (0, 0, 2)]), z16, 2, "more changes")
    assert_rejects(craft(MODE_CLASS, 2, 8, 2, [(0, 0, 3), (1, 0, 0), (0, 0, 4)]), z16, 2, "fewer changes")
    roundtrip(craft(MODE_CLASS, 2, 8, 1, [(0, 0, 3), (1, 0, 1), (0, 0, 4)]), z16,
              np.array([0, 0, 0, 1, 0, 0, 0, 0], np.uint16).view(np.uint8), 2)
    ok = craft(MODE_CLASS, 2, 8, 2, [(0, 0, 3), (1, 0, 0), (0, 0, 0), (1, 0, 1), (0, 0, 3)])
    out = np.empty(16, np.uint8)
    SparseCodec().decode(ok, z16, 2, out)  # the crafting is sound: a consistent stream decodes
    assert out.view(np.uint16).tolist() == [0, 0, 0, 0xFFFF, 1, 0, 0, 0]
    assert_rejects(with_header(ok, k=1), z16, 2, "more changes")
    # values of a class the model has no table for (300 changes, so a table of its own is cheaper)
    ops = [op for _ in range(300) for op in ((0, 0, 0), (1, 5, 0))]
    assert_rejects(craft(MODE_SPARSE, 2, 300, 300, ops), np.zeros(600, np.uint8), 2, "no coding table|has none")


@HYP
@given(data=st.data(), mode=st.sampled_from([MODE_SPARSE, MODE_CLASS]))
def test_corrupted_payloads_fail_cleanly(valid: dict[int, tuple[bytes, np.ndarray]], data: st.DataObject,
                                         mode: int) -> None:
    """Random byte corruption behind a recomputed CRC-32 (so that it reaches the kernels) either decodes or
    raises FormatError; without the recomputed CRC it always raises: the CRC-32's mismatch, or, where the
    corruption turned the version byte into 1 (a version without a CRC-32), what the header's checks say (its
    length then counts 4 bytes too many, unless a length field was hit too)."""
    payload, parent = valid[mode]
    b = bytearray(payload[:-4])
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, len(b) - 1))] = data.draw(st.integers(0, 255))
    out = np.empty_like(parent)
    if bytes(b) != payload[:-4]:
        with pytest.raises(FormatError, match="CRC-32|magic|version|mode|elements|bytes"):
            SparseCodec().decode(bytes(b) + payload[-4:], parent, 2, out)
    try:
        SparseCodec().decode(seal(bytes(b)), parent, 2, out)
    except FormatError:
        pass


@HYP
@given(body=st.binary(max_size=300), n=st.integers(0, 300), k=st.integers(0, 300), mode=st.integers(0, 3),
       split=st.integers(0, 300))
def test_arbitrary_bodies_fail_cleanly(body: bytes, n: int, k: int, mode: int, split: int) -> None:
    """A consistent header in front of arbitrary model and stream bytes never crashes the decoder (version 1,
    which has no CRC-32, so that every body reaches the kernels)."""
    split = min(split, len(body))
    payload = b"ASPC" + bytes((1, 2, mode)) + b"".join(map(varint, (n, k, split, len(body) - split))) + body
    parent = np.zeros(2 * n, np.uint8)
    try:
        SparseCodec().decode(payload, parent, 2, np.empty_like(parent))
    except FormatError:
        pass


# ------------------------------------------------------------------------------------------------ the generator
def test_rl_snapshots_change_one_to_five_percent_per_step() -> None:
    snaps = list(rl_data.rl_snapshots(total_params=60_000, steps=4, lr=1e-6, seed=7))
    assert len(snaps) == 5
    assert all(t.dtype == torch.bfloat16 for s in snaps for t in s.values())
    assert sum(t.numel() for t in snaps[0].values()) >= 30_000
    for prev, cur in zip(snaps, snaps[1:]):
        assert 0.01 <= rl_data.changed_fraction(prev, cur) <= 0.05
    again = next(rl_data.rl_snapshots(total_params=60_000, steps=0, lr=1e-6, seed=7))
    other = next(rl_data.rl_snapshots(total_params=60_000, steps=0, lr=1e-6, seed=8))
    name = "layers.0.mlp.up.weight"
    assert torch.equal(again[name], snaps[0][name]) and not torch.equal(other[name], snaps[0][name])


def test_tiny_gpt_snapshots_train_and_change_sparsely() -> None:
    snaps = list(rl_data.tiny_gpt_snapshots(steps=2, lr=1e-6, seed=0, vocab=64, d=32, layers=1, heads=2,
                                            context=16, batch=4, pretrain_steps=3))
    assert len(snaps) == 3 and "tok.weight" in snaps[0]
    for prev, cur in zip(snaps, snaps[1:]):
        assert 0.0 < rl_data.changed_fraction(prev, cur) < 0.2


def test_every_single_bit_flip_of_a_sparse_payload_is_refused() -> None:
    """One flipped bit of a rANS stream used to decode to the end in ~0.1% of cases, as two +-1 ulp pairs a few
    elements apart that the container's Adler-32 could not see: wrong weights accepted as valid (bit 4080 of
    this file was one). Every flip of the tensor's bytes must now raise."""
    from fsdp_hotload.arc import ArcError, RawTensor, apply_delta_file, encode_delta_file, read_delta_info

    rng = np.random.default_rng(0)
    p = ((rng.standard_normal(1001) * 0.02).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    q = p.copy()
    m = rng.random(p.size) < 0.03
    q[m] += rng.choice(np.array([1, 0xFFFF], np.uint16), m.sum())
    parent, new = ({"w": RawTensor("BF16", (1001,), x.view(np.uint8))} for x in (p, q))
    blob = encode_delta_file(parent, new, parent_identity="s", codec=SPARSE_CODEC)
    assert np.array_equal(apply_delta_file(parent, blob)["w"].data.view(np.uint16), q)
    h = read_delta_info(blob).header
    entry = h.entries["w"]
    accepted = []
    for bit in range((h.data_start + entry.begin) * 8, (h.data_start + entry.end) * 8):
        b = bytearray(blob)
        b[bit // 8] ^= 1 << (bit % 8)
        try:
            apply_delta_file(parent, bytes(b))
        except ArcError:
            continue
        accepted.append(bit)
    assert accepted == []


def test_version_1_payloads_without_crc_are_still_read(valid: dict[int, tuple[bytes, np.ndarray]]) -> None:
    for mode in (MODE_SPARSE, MODE_CLASS):
        payload, parent = valid[mode]
        assert payload[4] == 2
        old = payload[:4] + b"\x01" + payload[5:-4]
        out, want = np.empty_like(parent), np.empty_like(parent)
        SparseCodec().decode(old, parent, 2, out)
        SparseCodec().decode(payload, parent, 2, want)
        assert np.array_equal(out, want)


def test_arrays_written_while_they_are_diffed_raise_instead_of_corrupting_the_heap() -> None:
    """The host diff counts the changes, allocates that many positions and fills them in a second pass, GIL-free.
    Bytes that another thread changes between the passes made the second write past its array: glibc aborted
    the process ("malloc(): invalid size"), or the positions held garbage. Now the second pass is bounded and a
    count that moved raises. Whatever a diff returns meanwhile is well formed."""
    import threading
    import time

    from fsdp_hotload.arc.codecs import element_diff

    n = 1 << 18
    parent, new = np.zeros(2 * n, np.uint8), np.zeros(2 * n, np.uint8)
    stop = threading.Event()

    def writer() -> None:
        v = 0
        while not stop.is_set():
            v ^= 1
            new[::2] = v  # every element flips between equal to the parent and not

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    raised, deadline = 0, time.monotonic() + 30
    try:
        while raised < 3 and time.monotonic() < deadline:
            try:
                diff = element_diff(parent, new, 2)
            except RuntimeError as exc:
                assert "changed while they were diffed" in str(exc)
                raised += 1
                continue
            assert diff.idx.size == diff.old.size == diff.new.size
            assert ((diff.idx >= 0) & (diff.idx < n)).all() and (np.diff(diff.idx) > 0).all()
    finally:
        stop.set()
        thread.join()
    assert raised == 3
