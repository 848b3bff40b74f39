"""The device diff's arithmetic, run on CPU tensors: CI has no GPU, so the torch code that a CUDA trainer runs
(`device_diff`: signed views, `nonzero`, gathers) is checked here against the host diff, element for element.
The CUDA-only parts (side stream, events, pinned copies) are in `test_gpu.py`."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from fsdp_hotload.arc.codecs import element_diff
from fsdp_hotload.engine.staging import Stager, device_diff
from tests.test_gpu import chunks


def cache_then_stage(st: Stager, change: Callable[[], None]) -> torch.Tensor:
    """Stage the chunks and make that the cache, run ``change`` on their sources, stage again: the new buffer."""
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    st.promote(buf)
    with torch.no_grad():
        change()
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    return buf


def test_device_diff_arithmetic_matches_the_host_diff_on_cpu() -> None:
    cs = chunks("cpu")
    st = Stager(cs, slots=1, cache_on="device")

    def change() -> None:
        cs[0].source[::7] += 1e-2
        cs[1].source[-1] = -cs[1].source[-1]  # sign bit only: a signed view must still see it
        cs[3].source[2] = -5
        cs[3].source[4] = 1 << 62

    buf = cache_then_stage(st, change)
    assert st.cache is not None
    wants = [element_diff(st.cache[s.offset:s.offset + s.nbytes].numpy(), buf[s.offset:s.offset + s.nbytes].numpy(),
                          s.itemsize) for s in st.slices]
    for block in (3, 64, 1 << 22):  # blocks that split runs of changes, and one block per chunk
        gots = device_diff(buf, st.cache, st.slices, block=block)
        assert len(gots) == len(wants)
        for got, want in zip(gots, wants):
            got.check()
            assert got.n == want.n and np.array_equal(got.idx, want.idx)
            assert got.old.dtype == want.old.dtype and np.array_equal(got.old, want.old)
            assert np.array_equal(got.new, want.new)
        assert [g.changed for g in gots] == [len(range(0, 257 * 33, 7)), 1, 0, 2]  # every 7th, a sign flip, 2 ints


def test_device_diffs_cut_their_host_arrays_from_one_arena_kept_between_diffs() -> None:
    """Each delta allocated three pinned host arrays per chunk, sized by its changes; torch's pinned cache rounds
    each to a power of two and keeps every size class it made, so page-locked memory grew past the largest diff's
    need over a run. The arrays are now views of one buffer per stager, kept while it is large enough and grown to
    the next power of two when a diff needs more; the values stay exact (run here on CPU tensors)."""
    from fsdp_hotload.engine.staging import HostArena

    cs = chunks("cpu")
    st = Stager(cs, slots=1)
    arena = HostArena(pin=False)
    sizes, most = [], 0
    for stride in (3, 7, 50, 1):  # fewer changes after more, then every element
        def change(stride: int = stride) -> None:
            cs[0].source[::stride] += 1e-2
            cs[3].source[stride % 5] += 1

        buf = cache_then_stage(st, change)
        assert st.cache is not None
        gots = device_diff(buf, st.cache, st.slices, block=64, arena=arena)
        for s, got in zip(st.slices, gots):
            want = element_diff(st.cache[s.offset:s.offset + s.nbytes].numpy(),
                                buf[s.offset:s.offset + s.nbytes].numpy(), s.itemsize)
            got.check()
            assert np.array_equal(got.idx, want.idx) and np.array_equal(got.old, want.old)
            assert np.array_equal(got.new, want.new)
        need = sum(g.changed * 8 + 2 * -(-g.changed * g.itemsize // 8) * 8 for g in gots)
        most = max(most, need)
        assert arena.buf is not None and need <= arena.buf.numel() < 2 * most  # a power of two, no larger
        assert arena.buf.numel() & (arena.buf.numel() - 1) == 0
        sizes.append((arena.buf.data_ptr(), arena.buf.numel()))
        st.release(buf)
    assert sizes[1] == sizes[0] and sizes[2] == sizes[0], sizes  # smaller needs: the same buffer, not a new one
    assert sizes[3][1] > sizes[0][1], sizes  # every element changed: grown once


def test_staging_keeps_nan_payloads_of_uncast_floats() -> None:
    """A copy without a cast moves the bits: NaN payloads and signed zeros arrive as the trainer holds them."""
    from dataclasses import replace

    cs = chunks("cpu")
    bits = torch.tensor([0x7FC1, 0xFFA5 - 0x10000, 0x7F81, -0x8000, 0x3F80], dtype=torch.int16)  # NaNs, -0.0, 1.0
    src = bits.view(torch.bfloat16)
    c = replace(cs[1], shape=(5,), box=type(cs[1].box).flat(0, 5), source=src)
    st = Stager([c], slots=1)
    buf = st.acquire(wait=False)
    assert buf is not None and st.slices[0].torch_dtype == torch.bfloat16
    st.wait_event(st.stage(buf))
    assert torch.equal(st.view(buf, st.slices[0]).view(torch.int16), bits)


def test_a_cast_from_a_strided_source_gives_the_bits_of_the_parameters_own_cast() -> None:
    """A permuted part (a transposed view) cast to bf16 on the CPU: torch casts strided floats element by element,
    which wrote every NaN as 0x7fc0 where ``param.to(torch.bfloat16)`` keeps its sign (0xffff), so the snapshot
    differed from the trainer's bf16 bytes. Staged from its own plan, patched in as a given source, copied pair by
    pair, and once the own sources are let go of: always the bits of the parameter's own cast."""
    from fsdp_hotload.arc.boxes import Box
    from fsdp_hotload.publish import WholeChunk

    g = torch.Generator().manual_seed(0)
    params = [torch.randn(6, 10, generator=g), torch.randn(6, 4, generator=g)]
    nans = torch.tensor([0x7FC00001, -0x7E7EDCBB, 0x7F800001, -0x400000, 0x7FFFFFFF], dtype=torch.int32)
    for p in params:  # quiet and signalling, both signs, with payloads, every 5th element
        every = p.view(torch.int32).view(-1)[::5]
        every.copy_(nans.repeat(every.numel())[:every.numel()])
    assert all(p.isnan().sum() >= 4 for p in params)
    want = [p.to(torch.bfloat16).t().contiguous().view(torch.int16) for p in params]
    cs = [WholeChunk(f"t{i}", tuple(p.t().shape), "BF16", "shape", Box.whole(tuple(p.t().shape)), p.t())
          for i, p in enumerate(params)]
    st = Stager(cs, slots=1)

    def staged(sources: list[torch.Tensor] | None) -> list[torch.Tensor]:
        buf = st.acquire(wait=False)
        assert buf is not None
        st.wait_event(st.stage(buf, sources))
        st.release(buf)
        return [st.view(buf, s).view(torch.int16).view(c.shape) for s, c in zip(st.slices, cs)]

    given = [p.clone().t() for p in params]  # other tensors, as strided as the own ones
    for got in (staged(None), staged(given), staged([given[0], params[1].t().contiguous()])):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    st.forget_sources()
    assert all(torch.equal(a, b) for a, b in zip(staged(given), want))
    # contiguous own sources, given strided ones: not patched into the batch the own ones were planned in
    values = [p.t().contiguous().view(-1) for p in params]
    st = Stager([WholeChunk(f"f{i}", (v.numel(),), "BF16", "flat", Box.flat(0, v.numel()), v)
                 for i, v in enumerate(values)], slots=1)
    spread = [torch.zeros(2 * v.numel()) for v in values]
    for sp, v in zip(spread, values):
        sp[::2] = v
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf, [sp[::2] for sp in spread]))
    assert all(torch.equal(st.view(buf, s).view(torch.int16), w.view(-1)) for s, w in zip(st.slices, want))


def test_all_staging_memory_is_taken_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots and cache are allocated when the Stager is built (the callback's construction), so a shortage fails
    before training starts, not on the publisher's thread at the first accepted snapshot; promotions only swap
    buffers, and the slot count stays ``slots``."""
    allocated: list[int] = []
    alloc = Stager._alloc

    def counting(self: Stager, device: torch.device) -> torch.Tensor:
        buf = alloc(self, device)
        allocated.append(buf.data_ptr())
        return buf

    monkeypatch.setattr(Stager, "_alloc", counting)
    st = Stager(chunks("cpu"), slots=2)
    assert len(allocated) == 3 and st.free_slots() == 2
    for _ in range(4):
        buf = st.acquire(wait=False)
        assert buf is not None
        st.wait_event(st.stage(buf))
        st.promote(buf)
        assert st.free_slots() == 2 and st.cache is not None
    assert len(allocated) == 3
    assert {st.cache.data_ptr(), *(b.data_ptr() for b in st._free)} == set(allocated)


def test_device_diff_falls_back_where_nonzero_static_has_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.4 and 2.5 define ``nonzero_static`` but have no CUDA kernel for it (one came in 2.6): the call
    raises NotImplementedError, which must not fail every delta; the diff takes ``nonzero`` instead."""
    from fsdp_hotload.engine import device_diff as staging

    calls = []

    def no_kernel(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        raise NotImplementedError("Could not run 'aten::nonzero_static' with arguments from the 'CUDA' backend")

    monkeypatch.setattr(torch, "nonzero_static", no_kernel, raising=False)
    monkeypatch.setattr(staging, "_NO_STATIC_NONZERO", set(), raising=False)
    cs = chunks("cpu")
    st = Stager(cs, slots=1)

    def change() -> None:
        cs[0].source[::5] += 1e-2
        cs[3].source[1] = 7

    buf = cache_then_stage(st, change)
    assert st.cache is not None
    gots = device_diff(buf, st.cache, st.slices, block=64)
    for s, got in zip(st.slices, gots):
        want = element_diff(st.cache[s.offset:s.offset + s.nbytes].numpy(), buf[s.offset:s.offset + s.nbytes].numpy(),
                            s.itemsize)
        assert np.array_equal(got.idx, want.idx) and np.array_equal(got.new, want.new)
    assert [g.changed for g in gots] == [len(range(0, 257 * 33, 5)), 0, 0, 1]
    assert len(calls) == 1, "the missing kernel is found once per device type, not once per block"


@pytest.mark.parametrize("wrong", ["one element", "too many", "one source short"])
def test_staging_refuses_sources_that_do_not_match_the_chunks(wrong: str) -> None:
    """Sources handed to ``publish`` replace the chunks' own: one of the wrong size was broadcast into the slot
    (a 1-element tensor filled the whole chunk), so a wrong snapshot was published without any error."""
    cs = chunks("cpu")
    st = Stager(cs, slots=1)
    buf = st.acquire(wait=False)
    assert buf is not None
    srcs = [c.source for c in cs]
    if wrong == "one element":
        srcs[0] = srcs[0][:1]
    elif wrong == "too many":
        srcs[1] = torch.zeros(srcs[1].numel() + 1, dtype=srcs[1].dtype)
    else:
        srcs = srcs[:-1]
    with pytest.raises(ValueError, match="source"):
        st.stage(buf, srcs)


def test_shards_on_a_device_without_bytes_are_refused_at_construction() -> None:
    """FSDP2's deferred init leaves parameters on the meta device until to_empty(). HotloadCallback refused such a
    model, but a TensorPublisher (or the engine) built on it started, and every publish then failed on the
    background thread ("Cannot copy out of meta tensor"). Now the stager says so at construction."""
    with pytest.raises(ValueError, match="meta device: create the publisher after the weights are materialised"):
        Stager(chunks("meta"), slots=1)


def test_adjacent_chunks_are_staged_in_one_copy_and_given_sources_are_still_read() -> None:
    """The parts of a split tensor are views next to each other: staged by one copy per run. A run is only used
    while the sources are the views it was made of; sources given anew, or one of them replaced (a buffer cloned
    for a background copy), are read as given."""
    from fsdp_hotload.publish import WholeChunk
    from fsdp_hotload.arc.boxes import Box

    def parts(base: torch.Tensor) -> list[WholeChunk]:
        flat = base.view(-1)
        return [WholeChunk(f"e{k}", (4, 6), "BF16", "flat", Box.flat(0, 24), flat[24 * k:24 * (k + 1)])
                for k in range(5)] + [WholeChunk("odd", (3,), "I64", "flat", Box.flat(0, 3), torch.arange(3))]

    torch.manual_seed(0)
    base = torch.randn(5, 4, 6)
    cs = parts(base)
    st = Stager(cs, slots=2)
    assert [(g.start, g.stop) for g in st._groups] == [(0, 5), (5, 6)]  # one copy for the five parts, one more

    def staged(sources: list[torch.Tensor] | None) -> bytes:
        buf = st.acquire(wait=False)
        assert buf is not None
        st.wait_event(st.stage(buf, sources))
        st.release(buf)
        return bytes(buf.numpy())

    def expected(srcs: list[torch.Tensor]) -> bytes:
        out = b""
        for s, src in zip(st.slices, srcs):
            out += b"\0" * (s.offset - len(out)) + bytes(src.to(s.torch_dtype).view(torch.uint8).numpy())
        return out + b"\0" * (st.nbytes - len(out))

    own = [c.source for c in cs]
    assert staged(None) == staged(own) == expected(own)
    other = [c.source for c in parts(torch.randn(5, 4, 6))]  # the model walked again: new views
    assert staged(other) == expected(other) != expected(own)
    mixed = list(own)
    mixed[2] = own[2].clone() * 2  # one member replaced: the run is copied chunk by chunk
    assert staged(mixed) == expected(mixed) != expected(own)
    with torch.no_grad():
        base.mul_(3)  # the same views, new values: the run reads them
    assert staged(None) == expected(own)
    # own views are not counted again each publish (a split MoE model has tens of thousands); any other source is,
    # since a copy would broadcast a one-element tensor over its whole chunk
    wrong = list(own)
    wrong[4] = torch.zeros(1)
    buf = st.acquire(wait=False)
    assert buf is not None
    with pytest.raises(ValueError, match="chunk 'e4': source has 1 elements, the chunk 24"):
        st.stage(buf, wrong)
    with pytest.raises(ValueError, match="5 source tensors for 6 chunks"):
        st.stage(buf, own[:5])
    wrong[4] = torch.zeros(24, device="meta")  # another device: its work would not be waited for on a GPU
    with pytest.raises(ValueError, match="chunk 'e4': source is on meta, the shard on cpu"):
        st.stage(buf, wrong)
    st.release(buf)


def test_device_diff_of_adjacent_chunks_is_cut_back_into_each_chunks_changes() -> None:
    """Chunks that follow each other are diffed as one range and cut apart on the host: changes at every chunk's
    first and last element, chunks without changes, a gap (alignment) and another element size end a range, and
    each chunk's positions count from its own start."""
    from fsdp_hotload.engine.staging import Slice

    # bf16 chunks of 4, 3 (then 2 bytes of padding), 4, 6 elements; an int32 chunk; then bf16 again
    layout = [(0, 4, 2), (8, 3, 2), (16, 4, 2), (24, 6, 2), (36, 3, 4), (48, 5, 2)]
    slices = [Slice(off, n * size, n, size, torch.bfloat16 if size == 2 else torch.int32) for off, n, size in layout]
    total = 58
    torch.manual_seed(3)
    old = torch.randint(0, 256, (total,), dtype=torch.uint8)
    new = old.clone()
    for off, n, size in layout[:2] + layout[3:]:  # the third chunk does not change
        new[off] ^= 1  # its first element
        new[off + n * size - 1] ^= 0x80  # its last element's top bit
    new[14:16] ^= 0xFF  # the padding differs: it belongs to no chunk
    wants = [element_diff(old[s.offset:s.offset + s.nbytes].numpy(), new[s.offset:s.offset + s.nbytes].numpy(),
                          s.itemsize) for s in slices]
    for block in (2, 5, 1 << 22):
        gots = device_diff(new, old, slices, block=block)
        assert [g.changed for g in gots] == [2, 2, 0, 2, 2, 2]
        for got, want in zip(gots, wants):
            got.check()
            assert got.n == want.n and np.array_equal(got.idx, want.idx)
            assert np.array_equal(got.old, want.old) and np.array_equal(got.new, want.new)


def test_a_cpu_shard_on_a_gpu_machine_takes_no_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinned host memory serves only copies to and from a CUDA device. A shard on the CPU (FSDP with CPU offload
    of the parameters, on a GPU machine) never crosses to a device, yet its slots and cache were pinned whenever
    CUDA was available: page-locked, and rounded up to a power of two by torch's pinned-memory cache (a 17.5 GB
    slot locks 32 GB), on exactly the trainers that offload because host memory is short. Here CUDA is said to be
    available; a CPU build cannot pin at all, so a request to pin fails the construction."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for cache_on in ("device", "host"):
        st = Stager(chunks("cpu"), slots=2, cache_on=cache_on)
        assert st._spare is not None and st._spare.device.type == "cpu" and not st._spare.is_pinned()
        assert all(b.device.type == "cpu" and not b.is_pinned() for b in st._free)


def test_each_batched_copy_has_one_destination_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks cast to different dtypes (fp32 masters published as bf16, one tensor overridden to fp16, one to
    fp8) must not share one ``torch._foreach_copy_`` call. Why: its CUDA kernel (torch 2.4 on, until
    pytorch/pytorch#173383 was fixed) takes the fused path whenever the sources share a dtype, and casts every
    pair to the first destination's dtype: the fp16 chunk then holds bf16 bits, and a 1-byte chunk is written
    2 bytes per element, over the next chunk. The CPU kernel copies pair by pair, so only the calls show it here."""
    from fsdp_hotload.arc.boxes import Box
    from fsdp_hotload.publish import WholeChunk

    calls: list[tuple[set[torch.dtype], set[torch.dtype]]] = []
    real = torch._foreach_copy_

    def recording(dst: list[torch.Tensor], src: list[torch.Tensor], *args: object, **kwargs: object) -> None:
        calls.append(({d.dtype for d in dst}, {s.dtype for s in src}))
        real(dst, src, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    torch.manual_seed(0)
    srcs = [torch.randn(n) * 0.5 for n in (40, 24, 16, 40)]  # fp32 masters, contiguous and of one dtype
    codes = ["BF16", "F16", "F8_E4M3", "BF16"]
    cs = [WholeChunk(f"t{i}", (s.numel(),), code, "flat", Box.flat(0, s.numel()), s)
          for i, (s, code) in enumerate(zip(srcs, codes))]
    st = Stager(cs, slots=1)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    assert calls and all(len(dst) == 1 and len(src) == 1 for dst, src in calls), calls
    # and none casts to an 8-bit float: older torch has no fused kernel for it, and a batch of them alone took it
    assert torch.float8_e4m3fn not in set().union(*(dst for dst, _src in calls)), calls
    for s, src in zip(st.slices, srcs):
        want = src.to(s.torch_dtype).view(torch.uint8)
        assert torch.equal(buf[s.offset:s.offset + s.nbytes], want)


def test_tensors_past_int32_elements_are_not_batched(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of 2**31 elements or more (an FSDP1 flat shard's run of views, a fused expert tensor on few ranks)
    must not go to ``torch._foreach_copy_``: before torch 2.8 (pytorch/pytorch#156261) its CUDA kernels computed
    each block's offset in 32-bit ints and read and wrote outside the tensors (an illegal memory access, which
    ends the CUDA context). The limit is lowered here so that small tensors stand for such large ones."""
    from fsdp_hotload.arc.boxes import Box
    from fsdp_hotload.engine import copies
    from fsdp_hotload.publish import WholeChunk

    monkeypatch.setattr(copies, "_FOREACH_MAX_NUMEL", 100, raising=False)
    seen: list[int] = []
    real = torch._foreach_copy_

    def recording(dst: list[torch.Tensor], src: list[torch.Tensor], *args: object, **kwargs: object) -> None:
        seen.extend(int(d.numel()) for d in dst)
        real(dst, src, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    torch.manual_seed(0)
    base = torch.randn(300)
    srcs = [base[:40], torch.randn(101), torch.randn(7)]
    cs = [WholeChunk(f"t{i}", (s.numel(),), "BF16", "flat", Box.flat(0, s.numel()), s) for i, s in enumerate(srcs)]
    cs += [WholeChunk(f"p{k}", (20,), "BF16", "flat", Box.flat(0, 20), base[40 + 20 * k:60 + 20 * k])
           for k in range(13)]
    st = Stager(cs, slots=1)
    assert max(g.merged.numel() for g in st._groups if g.merged is not None) == 260  # 13 adjacent parts: one run
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    assert seen and max(seen) <= 100, seen
    for c, s in zip(cs, st.slices):
        assert torch.equal(buf[s.offset:s.offset + s.nbytes], c.source.to(torch.bfloat16).view(torch.uint8)), c.name


def test_the_copy_plan_is_made_once_per_buffer_and_given_sources_never_stay_in_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each buffer's copies are batched once, at construction (sorting tens of thousands of copies by dtype pair on
    every publish cost the trainer ~2 us per chunk; at the first publishes, ~3 us per chunk and buffer). Sources
    given in place of a chunk's own (a buffer cloned for a background copy) are put into a copy of the plan for
    that publish only: the next publish reads the chunk's own source again. A given source of another shape, or
    one inside a run of adjacent chunks, is copied pair by pair."""
    from fsdp_hotload.arc.boxes import Box
    from fsdp_hotload.engine import copies
    from fsdp_hotload.publish import WholeChunk

    made: list[int] = []
    real = copies.CopyPlan.of

    def counting(dst: list[torch.Tensor], src: list[torch.Tensor]) -> object:
        made.append(len(dst))
        return real(dst, src)

    monkeypatch.setattr(copies.CopyPlan, "of", staticmethod(counting))
    torch.manual_seed(0)
    base = torch.randn(60)
    nan = torch.tensor([float("nan")] * 4, dtype=torch.bfloat16).view(torch.int16)
    nan[1] = 0x7FC1  # a NaN payload that a floating copy may rewrite
    srcs = [torch.randn(3, 5), torch.randn(8, dtype=torch.bfloat16), nan.view(torch.bfloat16),
            torch.arange(6, dtype=torch.int64), base[:20], base[20:40]]
    codes = ["BF16", "BF16", "BF16", "I64", "BF16", "BF16"]
    cs = [WholeChunk(f"t{i}", tuple(s.shape), code, "flat", Box.whole(tuple(s.shape)), s)
          for i, (s, code) in enumerate(zip(srcs, codes))]
    st = Stager(cs, slots=2)
    assert [(g.start, g.stop) for g in st._groups][-1] == (4, 6)  # the two adjacent views: one run
    assert made == [5, 5, 5], "one plan per buffer (two slots, the cache's), made at construction (5 copies)"

    def chunk_bytes(buf: torch.Tensor) -> list[bytes]:  # the padding between chunks is never written
        return [bytes(buf[s.offset:s.offset + s.nbytes].numpy()) for s in st.slices]

    def staged(sources: list[torch.Tensor] | None) -> list[bytes]:
        buf = st.acquire(wait=False)
        assert buf is not None
        st.wait_event(st.stage(buf, sources))
        st.release(buf)
        return chunk_bytes(buf)

    def expected(given: list[torch.Tensor]) -> list[bytes]:
        return [bytes(src.to(s.torch_dtype).contiguous().view(torch.uint8).numpy()) for s, src in zip(st.slices, given)]

    own = [c.source for c in cs]
    first, second = st.acquire(wait=False), st.acquire(wait=False)
    assert first is not None and second is not None
    for buf in (first, second, first):
        st.wait_event(st.stage(buf))
        assert chunk_bytes(buf) == expected(own)
    st.release(first)
    st.release(second)
    assert made == [5, 5, 5], "no plan made again"
    for k in (0, 1, 2, 3):  # a cast copy, bf16 and bf16 NaN bits moved as integers, an int64 chunk
        given = list(own)
        given[k] = own[k].clone() if k == 2 else own[k] * 3
        if k == 2:
            given[k].view(torch.int16)[2] = 0x7FC3  # another payload: kept only if moved as an integer
        assert staged(given) == expected(given) != expected(own), k
        assert staged(list(own)) == staged(None) == expected(own), f"chunk {k}'s given source stayed in the plan"
    assert made == [5, 5, 5], "sources given in place of the chunks' own are patched into the plan"
    reshaped = list(own)
    reshaped[0] = own[0].reshape(5, 3) * 2  # the same elements, another shape: the destination view differs
    assert staged(reshaped) == expected(reshaped)
    in_run = list(own)
    in_run[5] = own[5] + 1  # one member of the run: its copy no longer reads the run's views
    assert staged(in_run) == expected(in_run)
    assert made == [5, 5, 5, 5, 6]
    with torch.no_grad():
        base.mul_(2)
        own[0].add_(1)
    assert staged(None) == expected(own), "the plan reads the sources' current values"


def test_a_host_arena_shrinks_once_diffs_need_under_an_eighth_of_it() -> None:
    """One delta with half the values changed grew the (pinned) arena to 6x the bf16 shard, kept for the rest of
    the job; it now goes back once three diffs in a row need under an eighth of it, with no reallocation for needs
    close by, nor for needs that alternate (a large delta after a skipped publish, then small ones)."""
    from fsdp_hotload.engine.device_diff import SHRINK_AFTER, SHRINK_BELOW, HostArena

    arena = HostArena(pin=False)
    small = arena.take(1000)
    assert small.numel() == 1024 and arena.take(SHRINK_BELOW) is not small  # grown to the need
    assert arena.take(10) is arena.buf and arena.buf.numel() == SHRINK_BELOW  # small needs keep a small arena
    big = arena.take(64 * SHRINK_BELOW)
    assert big.numel() == 64 * SHRINK_BELOW and arena.take(8 * SHRINK_BELOW + 1) is big  # within 8x: kept
    for _ in range(4):  # alternating: kept
        assert arena.take(SHRINK_BELOW) is big and arena.take(40 * SHRINK_BELOW) is big
    for _ in range(SHRINK_AFTER - 1):
        assert arena.take(8 * SHRINK_BELOW - 1) is big
    assert arena.take(8 * SHRINK_BELOW - 1).numel() == 8 * SHRINK_BELOW  # the third in a row: a smaller one
    assert arena.take(3 * SHRINK_BELOW).numel() == 8 * SHRINK_BELOW
