"""The device-side diff: on a GPU only changed positions and values cross to the host, and they match the host
diff exactly. Skipped without CUDA (CI has none); run on a GPU machine with `pytest -m gpu tests/test_gpu.py`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.arc.codecs import element_diff
from fsdp_hotload.engine.staging import DIFF_BLOCK, Stager
from fsdp_hotload.publish import WholeChunk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def chunks(device: str) -> list[WholeChunk]:
    g = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for name, shape, dtype in [("a", (257, 33), torch.float32), ("b", (5,), torch.bfloat16),
                               ("c", (0,), torch.float32), ("d", (7, 3), torch.int64)]:
        t = (torch.randn(shape, generator=g) * 0.02).to(dtype) if dtype.is_floating_point else torch.arange(
            int(np.prod(shape)), dtype=dtype).reshape(shape)
        code = "BF16" if dtype.is_floating_point else "I64"
        out.append(WholeChunk(name, shape, code, "flat", Box.flat(0, t.numel()), t.to(device).reshape(-1)))
    return out


def expert_parts(device: str) -> list[WholeChunk]:
    """A fused MoE tensor published per expert part (``split``): adjacent views, staged and diffed as one run."""
    fused = (torch.randn(3, 8, 5, generator=torch.Generator(device="cpu").manual_seed(1)) * 0.02).to(device)
    flat = fused.reshape(-1)
    return [WholeChunk(f"experts.{k // 2}.{'gate' if k % 2 == 0 else 'up'}_proj.weight", (4, 5), "BF16", "flat",
                       Box.flat(0, 20), flat[20 * k:20 * (k + 1)]) for k in range(6)]


def transposed_parts(device: str) -> list[WholeChunk]:
    """Parts published with their dims permuted (``transpose_fused_experts``, a per-expert part with dims (1, 0)):
    strided N-D sources, which the staging copy reads in the published order."""
    g = torch.Generator(device="cpu").manual_seed(2)
    gate_up = (torch.randn(3, 8, 5, generator=g) * 0.02).to(device)
    down = (torch.randn(3, 5, 4, generator=g) * 0.02).to(device)
    out = [WholeChunk("experts.gate_up_proj", (3, 5, 8), "BF16", "shape", Box.whole((3, 5, 8)),
                      gate_up.permute(0, 2, 1))]
    return out + [WholeChunk(f"experts.{e}.down_proj.weight", (4, 5), "BF16", "shape", Box.whole((4, 5)), down[e].t())
                  for e in range(3)]


LAYOUTS = {"tensors": chunks, "parts": expert_parts, "transposed": transposed_parts}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("cache_on", ["device", "host"])
def test_device_diff_matches_host_diff(cache_on: str, layout: str) -> None:
    cs = LAYOUTS[layout]("cuda")
    st = Stager(cs, slots=1, cache_on=cache_on)
    buf = st.acquire(wait=False)
    assert buf is not None and buf.device.type == "cuda"
    st.wait_event(st.stage(buf))
    host_before = buf.cpu().numpy().copy()
    for c, s in zip(cs, st.slices):  # each chunk's bytes in its box's C order (a permuted source: the published one)
        want = c.source.to(torch.bfloat16 if c.dtype == "BF16" else torch.int64).contiguous().reshape(-1)
        assert np.array_equal(host_before[s.offset:s.offset + s.nbytes], want.view(torch.uint8).cpu().numpy()), c.name
    st.promote(buf)
    with torch.no_grad():
        for c in cs:
            if c.source.is_floating_point() and c.source.numel():
                c.source[::7] += 1e-2
        cs[3].source[2] = -5
        cs[-1].source[-1] = 7  # the last element of a run
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    host_after = buf.cpu().numpy()
    diffs = st.diff(buf)
    for s, d in zip(st.slices, diffs):
        want = element_diff(host_before[s.offset:s.offset + s.nbytes], host_after[s.offset:s.offset + s.nbytes],
                            s.itemsize)
        assert d.n == want.n and np.array_equal(d.idx, want.idx)
        assert np.array_equal(d.old, want.old) and np.array_equal(d.new, want.new)
    assert sum(d.changed for d in diffs) > 0


def _staged_bytes(cs: list[WholeChunk]) -> torch.Tensor:
    return torch.cat([c.source.detach().to(torch.bfloat16 if c.dtype == "BF16" else torch.int64)
                      .reshape(-1).view(torch.uint8) for c in cs]).cpu()


def test_staging_copy_is_ordered_after_the_last_update() -> None:
    """The side stream waits for the training stream: an update still queued there (behind a long kernel) when
    stage() is called is in the copy."""
    cs = chunks("cuda")
    st = Stager(cs, slots=1)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the training stream
    with torch.no_grad():
        cs[0].source.mul_(3.0)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    want = _staged_bytes(cs)
    got = torch.cat([buf[s.offset:s.offset + s.nbytes] for s in st.slices])
    assert torch.equal(got.cpu(), want)


def test_staging_copy_is_ordered_before_next_update() -> None:
    """The training stream waits for the staging copy: an in-place update queued right after stage() cannot leak
    in, even when the copy itself starts late (held back here by a long kernel on the side stream)."""
    cs = chunks("cuda")
    st = Stager(cs, slots=1)
    want = _staged_bytes(cs)
    buf = st.acquire(wait=False)
    assert buf is not None
    with torch.cuda.stream(st._stream):
        torch.cuda._sleep(200_000_000)
    event = st.stage(buf)
    with torch.no_grad():
        cs[0].source.mul_(3.0)  # queued on the training stream after the copy
    st.wait_event(event)
    got = torch.cat([buf[s.offset:s.offset + s.nbytes] for s in st.slices])
    assert torch.equal(got.cpu(), want)


def test_a_given_source_dropped_after_stage_is_not_reused_before_the_copy_reads_it() -> None:
    """A tensor the caller made on another stream and dropped right after stage() went back to the caching allocator
    for that stream alone: the next tensor of its size made there was handed the same memory, and written before the
    side stream's copy (held back here behind a long kernel on the training stream) read it."""
    cs = chunks("cuda")
    st = Stager(cs, slots=1)
    want = _staged_bytes(cs)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        given = [c.source.clone() for c in cs]
    torch.cuda.current_stream().wait_stream(other)  # the caller orders its writes before the copy, as documented
    buf = st.acquire(wait=False)
    assert buf is not None
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the training stream, which the copy waits for
    event = st.stage(buf, given)
    del given
    with torch.cuda.stream(other):
        reused = [torch.full_like(c.source, 7) for c in cs]  # would take the memory just dropped
    st.wait_event(event)
    got = torch.cat([buf[s.offset:s.offset + s.nbytes] for s in st.slices])
    assert torch.equal(got.cpu(), want)
    del reused


def test_staging_keeps_nan_payloads_on_the_device() -> None:
    """A bf16 -> bf16 staging copy moves bits, so NaN payloads are not rewritten by a float round trip."""
    bits = torch.tensor([0x7FC1, 0xFFA5 - 0x10000, 0x7F81, -0x8000, 0x3F80], dtype=torch.int16)
    c = WholeChunk("n", (5,), "BF16", "flat", Box.flat(0, 5), bits.view(torch.bfloat16).cuda())
    st = Stager([c], slots=1)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    assert torch.equal(st.view(buf, st.slices[0]).view(torch.int16).cpu(), bits)


@pytest.mark.parametrize("cache_on", ["device", "host"])
def test_device_diff_memory_is_bounded_when_everything_changes(cache_on: str) -> None:
    """A full-rank update changes nearly every value; the diff's device temporaries stay below the chunk's own
    size (they are bounded per block), instead of several times it."""
    n = 1 << 26  # 64 Mi bf16 values: 128 MiB
    src = torch.randn(n, device="cuda")
    c = WholeChunk("big", (n,), "BF16", "flat", Box.flat(0, n), src)
    st = Stager([c], slots=1, cache_on=cache_on)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    st.promote(buf)
    with torch.no_grad():
        src.add_(1.0)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    (d,) = st.diff(buf)
    extra = torch.cuda.max_memory_allocated() - base
    assert d.changed > 0.9 * n
    assert extra < 2 * n * 0.5, f"diff temporaries {extra / 2**20:.0f} MiB for a {2 * n / 2**20:.0f} MiB chunk"
    assert extra <= DIFF_BLOCK * (9 + 2 * 2), "over the bound device_diff documents"


def test_device_diffs_keep_one_pinned_arena() -> None:
    """Deltas of changing sizes cut their host arrays from one pinned buffer per stager: page-locked memory stays
    that buffer (under twice the largest diff's need), where three arrays per chunk and diff left torch's pinned
    cache holding every size class they reached."""
    cs = chunks("cuda")
    st = Stager(cs, slots=1)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    st.promote(buf)
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    most = 0
    for stride in (1, 3, 29, 2, 101, 1, 5):
        with torch.no_grad():
            cs[0].source[::stride] += 1e-2
        buf = st.acquire(wait=False)
        assert buf is not None
        st.wait_event(st.stage(buf))
        diffs = st.diff(buf)
        most = max(most, sum(d.changed * 8 + 2 * -(-d.changed * d.itemsize // 8) * 8 for d in diffs))
        assert diffs[0].changed == len(range(0, 257 * 33, stride))
        st.promote(buf)
    arena = st._arena.buf
    assert arena is not None and arena.is_pinned() and arena.numel() < 2 * most
    held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before
    assert held <= arena.numel(), f"{held} bytes pinned for an arena of {arena.numel()}"


def test_attached_callback_on_cuda_round_trips(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """attach() on a CUDA model: the copy goes on the side stream (no host fence), the device diff feeds the
    encoder, and every accepted snapshot rebuilt from the bucket equals the trainer's bytes."""
    from fsdp_hotload import HotloadCallback, HotloadConfig
    from fsdp_hotload.arc.dtypes import RawTensor
    from tests.snapshots import rebuild_accepted

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "net", "tie_word_embeddings": false}')
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(tmp_path / "hf"), full_every=3,
                        busy_policy="wait")
    states = []
    with HotloadCallback(model, cfg) as hot:
        hot.attach(opt)
        for _ in range(5):
            model(torch.randn(16, 64, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
            states.append({k: RawTensor.from_any(v.detach().cpu().bfloat16()).digest()
                           for k, v in model.state_dict().items()})
    assert [m.kind for m in hot.metrics] == ["full", "delta", "delta", "full", "delta"]
    rebuilt = rebuild_accepted(tmp_path / "bucket", hot.metrics)
    for m, want in zip(hot.metrics, states):
        assert {k: t.digest() for k, t in rebuilt[m.identity].items()} == want


def test_casts_to_several_dtypes_stage_each_chunk_in_its_own_dtype() -> None:
    """fp32 masters published as bf16, one tensor overridden to fp16 and one to fp8: every chunk holds its own
    cast of its source, byte for byte as the CPU casts it (finite values round to nearest even on both). One
    batched copy over all of them took the CUDA kernel's fused path with the first destination's dtype for all."""
    g = torch.Generator(device="cpu").manual_seed(4)
    host = [torch.randn(n, generator=g) * 0.5 for n in (4096, 1000, 512, 4096)]  # sources of one dtype: fused
    codes = ["BF16", "F16", "F8_E4M3", "BF16"]
    cs = [WholeChunk(f"t{i}", (t.numel(),), code, "flat", Box.flat(0, t.numel()), t.cuda())
          for i, (t, code) in enumerate(zip(host, codes))]
    st = Stager(cs, slots=1)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    got = buf.cpu()
    for c, s, t in zip(cs, st.slices, host):
        assert torch.equal(got[s.offset:s.offset + s.nbytes], t.to(s.torch_dtype).view(torch.uint8)), c.dtype


def test_a_chunk_past_int32_elements_is_staged_whole() -> None:
    """A chunk of more than 2**31 elements (an FSDP1 flat shard's run of views is one copy) is staged whole and
    in place. Before torch 2.8 the CUDA foreach copy computed block offsets in 32-bit ints: past 2**31 elements
    it read and wrote outside the tensors (an illegal memory access; pytorch/pytorch#156261)."""
    n = (1 << 31) + (1 << 16)
    if torch.cuda.mem_get_info()[0] < 4 * 2 * n + (1 << 30):  # source, slot, cache, the comparison's mask
        pytest.skip("needs ~19 GB of free device memory")
    src = torch.empty(n, dtype=torch.int16, device="cuda")
    src[:] = 7
    src[-(1 << 20):] = torch.arange(1 << 20, device="cuda", dtype=torch.int32).to(torch.int16)
    c = WholeChunk("big", (n,), "BF16", "flat", Box.flat(0, n), src.view(torch.bfloat16))
    st = Stager([c], slots=1)
    buf = st.acquire(wait=False)
    assert buf is not None
    st.wait_event(st.stage(buf))
    torch.cuda.synchronize()
    assert torch.equal(st.view(buf, st.slices[0]).view(torch.int16), src)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_shard_on_the_second_gpu_opens_no_context_on_the_first(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A rank on cuda:1 that never calls set_device: the publisher's threads (staging wait, device diff, host
    copies) start on device 0, and leaving a stream context there created a CUDA context on GPU 0 (~0.5 GB per
    rank of the node). Run in a fresh process, where nothing else touched GPU 0."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch
        from fsdp_hotload import HotloadConfig
        from fsdp_hotload.publish import TensorPublisher
        w = torch.randn(4096, 64, device="cuda:1")
        model = {{"model.layers.0.mlp.up_proj.weight": w}}
        cfg = HotloadConfig(bucket_url={str(tmp_path / "bucket")!r}, busy_policy="wait")
        with TensorPublisher(model, cfg) as pub:
            for step in range(3):
                w.add_(torch.rand_like(w) < 0.02)
                pub.publish(step)
        assert [m.kind for m in pub.metrics] == ["full", "delta", "delta"] and all(m.ok for m in pub.metrics)
        print("context on GPU 0:", torch._C._cuda_hasPrimaryContext(0))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "context on GPU 0: False" in out.stdout, out.stdout
