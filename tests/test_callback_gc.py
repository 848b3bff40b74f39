"""HotloadCallback and the garbage collector: what the callback keeps per tensor and a publish holds per chunk is
counted (each object is walked by every full collection, which holds the GIL), the manifests are made at
construction rather than in a publish, and a rank with many chunks is told once how to keep collections short."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_hotload import HotloadCallback, HotloadConfig
from tests.test_callback import Net


def test_many_chunks_bring_the_gc_freeze_advice_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """From MANY_CHUNKS chunks on, rank 0 says at start how to keep the interpreter's full collections short."""
    import fsdp_hotload.callback as callback

    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))  # 4 chunks
    for threshold, told in ((4, True), (5, False)):
        monkeypatch.setattr(callback, "MANY_CHUNKS", threshold)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fsdp_hotload"):
            HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / f"b{threshold}"))).close()
        advice = [r.getMessage() for r in caplog.records if "gc.freeze()" in r.getMessage()]
        assert len(advice) == int(told), advice
        assert not told or advice[0].startswith("hotload: 4 chunks on this rank"), advice


def test_the_callback_keeps_few_python_objects_per_tensor(tmp_path: Path) -> None:
    """Every object the callback keeps per tensor is walked by each full garbage collection, which holds the GIL
    (at 40k tensors a collection took ~0.24 s, one or two per publish). Three were kept for nothing: asking a
    parameter for its ``untyped_storage()`` makes a Python storage object that torch keeps for the storage's
    life, a copy group of one chunk held a tuple of that chunk, and a source cut as ``detach().view(-1)`` keeps
    the detached tensor alive as its base. Counted over 400 tensors, after publishes
    that made the copy plans: what construction, the chunk walk and the first publishes keep."""
    import gc

    def tracked() -> int:
        gc.collect()
        return len(gc.get_objects())

    def storages() -> int:
        gc.collect()
        return sum(type(o) is torch.UntypedStorage for o in gc.get_objects())

    def run(n: int) -> tuple[int, int]:
        model = nn.Module()  # 10 tensors per layer (one file per layer: a list of names each)
        model.layers = nn.ModuleList([nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(10)))
                                      for _ in range(n // 10)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before, before_storages = tracked(), storages()
        hot = HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / f"b{n}"), busy_policy="wait",
                                                   progress_log_s=None))
        hot.attach(opt)  # the background copy: a buffer-chunk check, and sources given anew each publish
        for _ in range(3):
            model.layers[0][0].weight.grad = torch.ones(4, 4)
            opt.step()
            hot.wait()
        kept, kept_storages = tracked() - before, storages() - before_storages
        hot.close()
        return kept, kept_storages

    run(10)  # once-per-process objects (imports, compiled code) out of the count
    small, small_storages = run(100)
    large, large_storages = run(500)
    assert large_storages == small_storages, "a Python storage object kept per parameter"
    per_tensor = (large - small) / 400
    # a chunk, its spec, box, slice and copy group, the source and one window per staging buffer (two): 9; 12
    # before (a storage object, a one-chunk tuple, and the detached tensor the source was a view of)
    assert per_tensor <= 9.5, per_tensor


def test_the_manifests_are_made_at_construction_not_in_a_publish(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The index and weight spec are made from a dict per tensor: made at the first commit, at 40k tensors they
    set off a full garbage collection (~0.25 s holding the GIL) on the publisher's thread while the trainer ran.
    They are made when the callback is built now; no publish makes them, and every snapshot carries them."""
    from fsdp_hotload.layout import ShardPlan

    model = Net()
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "b"), busy_policy="wait", full_every=2,
                                               progress_log_s=None))
    want = {"model.safetensors.index.json": hot.engine.plan.to_index_json(),
            "model.weight.spec.json": hot.engine.plan.to_spec_json()}

    def refuse(self: ShardPlan) -> bytes:
        raise AssertionError("manifests made during a publish")

    monkeypatch.setattr(ShardPlan, "to_index_json", refuse)
    monkeypatch.setattr(ShardPlan, "to_spec_json", refuse)
    with hot:
        for step in range(3):
            with torch.no_grad():
                model.layers[0].weight.add_(0.25)
            hot.step(step)
            hot.wait()
    assert [m.kind for m in hot.metrics] == ["full", "delta", "full"] and all(m.ok for m in hot.metrics)
    for m in hot.metrics:
        for name, blob in want.items():
            assert (tmp_path / "b" / m.identity / name).read_bytes() == blob


def test_a_publish_holds_few_tracked_objects_per_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects a publish holds for long (from the encode to a file's assembly, or through a whole file) reach the
    garbage collector's oldest generation and set off full collections, which hold the GIL and walk every object
    of the process (at 40k tensors: two per publish, ~0.25 s each). Encodings, routed pieces and a delta file's
    table are now plain tuples, bytes and strings, which the collector stops tracking at its first pass, a file's
    tensors are written one at a time, and a full snapshot's chunks are the numpy views kept per buffer (each
    chunk was a tensor object). Counted where the most is alive: as the first file of a full and of a delta is
    assembled, and as the delta file's header is built, against the idle callback (4,000 tensors: 635, 134 and
    273 objects; before, 8,134, 4,134 and 9,641)."""
    import gc

    from fsdp_hotload.arc import container
    from fsdp_hotload.engine import writer

    n, per_file = 4000, 500
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(*(nn.Linear(2, 2, bias=False) for _ in range(per_file)))
                                  for _ in range(n // per_file)])
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "b"), busy_policy="wait", full_every=2,
                                               upload_concurrency=1, progress_log_s=None))
    seen: dict[str, int] = {}

    def counting(name: str, real: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if "base" in seen and name not in seen:
                gc.collect()
                seen[name] = len(gc.get_objects()) - seen["base"]
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(writer, "assemble_full_file", counting("full", writer.assemble_full_file))
    monkeypatch.setattr(writer, "assemble_delta_file", counting("delta", writer.assemble_delta_file))
    monkeypatch.setattr(container, "build_header", counting("header", container.build_header))
    try:
        for step in range(4):  # full, delta, then a full and a delta counted (the first made the plans and views)
            with torch.no_grad():
                for p in list(model.parameters())[step::7]:
                    p.add_(0.5)
            if step >= 2:
                gc.collect()
                seen["base"] = len(gc.get_objects())
            hot.step(step)
            hot.wait()
    finally:
        hot.close()
    assert [m.kind for m in hot.metrics] == ["full", "delta", "full", "delta"] and all(m.ok for m in hot.metrics)
    assert seen["full"] < 0.2 * n, seen
    assert seen["delta"] < 0.2 * n, seen
    assert seen["header"] < 0.2 * n, seen
