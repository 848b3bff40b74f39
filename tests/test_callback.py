"""HotloadCallback on a plain (unsharded) module in one process, driven by the optimizer hook. Its start-up checks
against the base checkpoint and the fused-experts splits are in test_callback_model_checks.py, its garbage
collector footprint in test_callback_gc.py."""
from __future__ import annotations

import gc
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_hotload import HotloadCallback, HotloadConfig
from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.callback import hf_tie_word_embeddings
from fsdp_hotload.emulator import HotLoadEmulator
from tests.snapshots import rebuild_accepted


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(40, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.lm_head = nn.Linear(16, 40, bias=False)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.lm_head(h)


def test_attach_publishes_every_optimizer_step(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    hf = tmp_path / "hf"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "net", "tie_word_embeddings": false}')
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HotLoadEmulator(str(bucket), replicas=2, api_key="k") as emu:
        cfg = HotloadConfig(bucket_url=str(bucket), hotload_api_url=emu.url, account_id="a", model_id="m",
                            deployment_id="d", api_key="k", hf_config_dir=str(hf), full_every=3,
                            poll_interval_s=0.02, busy_policy="wait")
        with HotloadCallback(model, cfg) as hot:
            hot.attach(opt)
            for _ in range(5):
                model(torch.randint(0, 40, (2, 8))).sum().backward()
                model.steps += 1
                opt.step()  # the post-step hook stages the weights here
                opt.zero_grad()
                hot.wait()
                want = {k: RawTensor.from_any(v.detach().bfloat16() if v.is_floating_point() else v).digest()
                        for k, v in model.state_dict().items()}
                (dep,) = emu.state()["deployments"].values()
                for rep in dep["replicas"]:
                    assert rep["identity"] == hot.metrics[-1].identity
                    assert {k: t["digest"] for k, t in rep["tensors"].items()} == want
    assert [m.kind for m in hot.metrics] == ["full", "delta", "delta", "full", "delta"]
    assert [m.step for m in hot.metrics] == [0, 1, 2, 3, 4]
    assert all(m.ok and m.blocking_ms >= 0 for m in hot.metrics)


def _served(emu: HotLoadEmulator) -> list[tuple[str, dict[str, str]]]:
    (dep,) = emu.state()["deployments"].values()
    return [(rep["identity"], {k: t["digest"] for k, t in rep["tensors"].items()}) for rep in dep["replicas"]]


def _expected(model: nn.Module) -> dict[str, str]:
    return {k: RawTensor.from_any(v.detach().bfloat16() if v.is_floating_point() else v).digest()
            for k, v in model.state_dict().items()}


def test_replaced_parameter_is_walked_again(tmp_path: Path) -> None:
    """Chunk views are cached while the model's storage is unchanged; replacing a parameter (as loading with
    assign=True or a user's surgery does), or its ``.data``, must make the next publish read the new tensor, not
    the old one."""
    bucket, hf = tmp_path / "bucket", tmp_path / "hf"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "net", "tie_word_embeddings": false}')
    model = Net()
    with HotLoadEmulator(str(bucket), replicas=1, api_key="k") as emu:
        cfg = HotloadConfig(bucket_url=str(bucket), hotload_api_url=emu.url, account_id="a", model_id="m",
                            deployment_id="d", api_key="k", hf_config_dir=str(hf), poll_interval_s=0.02)
        with HotloadCallback(model, cfg) as hot:
            for step in range(3):
                with torch.no_grad():
                    model.layers[0].weight.add_(0.01)
                hot.step(step)
                hot.wait()
            assert hot.walks == 1
            replaced = StorageWeakRef(model.layers[1].weight.untyped_storage())
            model.layers[1].weight = nn.Parameter(torch.randn(16, 16))
            hot.step(3)
            hot.wait()
            assert hot.walks == 2
            assert _served(emu) == [(hot.metrics[-1].identity, _expected(model))]
            left = StorageWeakRef(model.layers[0].weight.untyped_storage())
            model.layers[0].weight.data = torch.randn(16, 16)  # the same Parameter object on new memory
            hot.step(4)
            hot.wait()
            assert hot.walks == 3
            assert _served(emu) == [(hot.metrics[-1].identity, _expected(model))]
            gc.collect()  # the memory the model let go of is not kept by the publisher (it was, to close())
            assert replaced.expired() and left.expired()
            with torch.no_grad():  # the new tensors, staged by the copy plans made again for them
                model.layers[1].weight.add_(0.5)
                model.layers[0].weight.mul_(2)
            hot.step(5)
            hot.wait()
            assert hot.walks == 3
            assert _served(emu) == [(hot.metrics[-1].identity, _expected(model))]
    assert all(m.ok for m in hot.metrics) and hot.metrics[-1].kind == "delta"


def test_a_reshaped_parameter_fails_the_step_and_a_meta_model_fails_construction(tmp_path: Path) -> None:
    """A parameter replaced by one of another shape but as many elements has the same flat boxes: the layout
    alone passed, and the snapshot went out with the old shape. The specs are compared too (they are the same
    on every rank, so every rank raises at that step, also those holding none of a replicated tensor). A model
    still on the meta device used to fail in the background at the first publish, then at every step."""
    (tmp_path / "config.json").write_text('{"model_type": "net", "tie_word_embeddings": false}')
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"), hf_config_dir=str(tmp_path))
    model = Net()
    hot = HotloadCallback(model, cfg)
    hot.step(0)
    hot.wait()
    model.layers[1].weight = nn.Parameter(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match=r"tensors or sharding changed .*\(tensor 'layers\.1\.weight' was BF16 "
                                           r"\[16, 16\], is BF16 \[8, 32\]\)"):
        hot.step(1)
    with pytest.raises(RuntimeError, match="tensors or sharding changed"):
        hot.close()  # its final publish of step 1 meets the same model
    assert [m.ok for m in hot.metrics] == [True] and hot.engine.closed
    with pytest.raises(ValueError, match="no tensor to publish .*rename function returned None for all"):
        HotloadCallback(Net(), cfg, rename=lambda name: None)
    with torch.device("meta"):
        lazy = Net()
    with pytest.raises(ValueError, match="rank 0: its tensors are on the meta device: create the HotloadCallback "
                                         "after the weights are materialised"):
        HotloadCallback(lazy, cfg)


def test_a_megatron_model_in_one_process_or_its_chunk_list_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    """At a tensor-parallel size of 1 (one GPU) Megatron's layers still mark their parameters; the callback only
    looked for the marks over several ranks, so a one-process run published linear_qkv (interleaved per query
    group) under Megatron's names, which no fleet loads. get_model's list of model chunks raised AttributeError."""
    gpt = nn.Module()
    gpt.linear_qkv = nn.Linear(8, 16, bias=False)
    gpt.linear_qkv.weight.tensor_model_parallel = True  # type: ignore[attr-defined]  # as Megatron marks it
    gpt.norm = nn.LayerNorm(8)
    cfg = HotloadConfig(bucket_url=str(tmp_path / "bucket"))
    with pytest.raises(ValueError, match=r"Megatron 1 tensor-parallel \(e.g. 'linear_qkv.weight'\) parameters: their "
                                         r"names and fused layouts .* are not a Hugging Face checkpoint's; .*"
                                         r"TensorPublisher, or pass rename= and split= that map them$") as info:
        HotloadCallback(gpt, cfg)
    assert "partition" not in str(info.value)  # not said of one process
    with pytest.raises(TypeError, match=r"takes a torch.nn.Module, got list \(Megatron's get_model returns its model "
                                        r"chunks as a list"):
        HotloadCallback([gpt], cfg)  # type: ignore[arg-type]
    hot = HotloadCallback(gpt, cfg, rename=lambda name: name.replace("linear_qkv", "qkv_proj"))  # mapped by the user
    hot.step(0)
    hot.close()
    assert [m.ok for m in hot.metrics] == [True]


def test_async_copy_waits_at_the_next_optimizer_step(tmp_path: Path) -> None:
    """With attach() the CPU copy runs on a helper thread; the optimizer's pre-step hook waits for it, so a
    slow copy never sees the next step's weights, and its wait is counted as blocking."""
    bucket, hf = tmp_path / "bucket", tmp_path / "hf"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "net", "tie_word_embeddings": false}')
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait")
    hot = HotloadCallback(model, cfg)
    stager = hot.engine.stager
    copy = stager._copy_host

    def slow_copy(*a: object) -> None:
        time.sleep(0.2)  # still copying when the next optimizer step arrives
        copy(*a)  # type: ignore[arg-type]

    stager._copy_host = slow_copy  # type: ignore[method-assign]
    hot.attach(opt)
    states = []
    for _ in range(3):
        model(torch.randint(0, 40, (2, 8))).sum().backward()
        opt.step()
        opt.zero_grad()
        states.append(_expected(model))
    hot.close()
    assert [m.kind for m in hot.metrics] == ["full", "delta", "delta"]
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    for m, want in zip(hot.metrics, states):
        assert {k: t.digest() for k, t in rebuilt[m.identity].items()} == want
    # the first two copies were waited for at the next optimizer step (~0.2 s each)
    assert all(m.blocking_ms > 100 for m in hot.metrics[:2])


def test_close_from_another_thread_still_waits_for_the_copy_at_the_next_optimizer_step(tmp_path: Path) -> None:
    """close() on a watchdog thread removed every hook before waiting for the copy still reading the weights,
    so the trainer's next optimizer step ran without the pre-step hook's wait and changed them under the copy:
    the snapshot of step 0 held step 1's weights."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    stager = hot.engine.stager
    copy = stager._copy_host
    go = threading.Event()

    def gated_copy(*a: object) -> None:
        assert go.wait(30)
        copy(*a)  # type: ignore[arg-type]

    stager._copy_host = gated_copy  # type: ignore[method-assign]
    hot.attach(opt)
    model(torch.randint(0, 40, (2, 8))).sum().backward()
    opt.step()  # stages step 0; its copy waits for `go`
    at_step_0 = _expected(model)
    closer = threading.Thread(target=hot.close)
    closer.start()
    deadline = time.monotonic() + 30
    while hot._hooks_on and time.monotonic() < deadline:  # close() has begun detaching
        time.sleep(0.01)
    threading.Timer(1.0, go.set).start()  # the copy finishes later than the trainer's next step starts
    model(torch.randint(0, 40, (2, 8))).sum().backward()
    opt.step()  # the trainer goes on: this step must wait for the copy
    closer.join(30)
    assert not closer.is_alive() and hot.engine.closed
    assert [m.step for m in hot.metrics] == [0] and hot.metrics[0].ok
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    assert {k: t.digest() for k, t in rebuilt[hot.metrics[0].identity].items()} == at_step_0


@pytest.mark.parametrize("config, tied", [
    ({"tie_word_embeddings": False}, False),
    ({"model_type": "llava", "text_config": {"tie_word_embeddings": True}}, True),  # multimodal: nested only
    ({"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True}}, None),  # the model decides
    ({"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}, None),
    ({"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": True}}, True),
    ({"text_config": {"model_type": "llama"}}, None),
    ({"text_config": "llama"}, None),
    ([1, 2], None),
])
def test_tie_word_embeddings_from_config_json(config: Any, tied: bool | None, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf_tie_word_embeddings(str(tmp_path)) is tied
    assert hf_tie_word_embeddings(str(tmp_path / "missing")) is None


def test_tie_word_embeddings_disagreement_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True,
                                                       "text_config": {"tie_word_embeddings": False}}))
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        assert hf_tie_word_embeddings(str(tmp_path)) is None
    assert "tie_word_embeddings=True at the top level and False under text_config; the model decides" in caplog.text
    caplog.clear()
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False,
                                                       "text_config": {"tie_word_embeddings": False}}))
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        assert hf_tie_word_embeddings(str(tmp_path)) is False
    assert "text_config" not in caplog.text


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    bucket, hf = tmp_path / "bucket", tmp_path / "hf"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "net", "tie_word_embeddings": false}')
    return bucket, hf


def _slow_copies(hot: HotloadCallback, seconds: float) -> None:
    stager = hot.engine.stager
    copy = stager._copy_host

    def slow_copy(*a: object) -> None:
        time.sleep(seconds)  # still copying while the next forward runs
        copy(*a)  # type: ignore[arg-type]

    stager._copy_host = slow_copy  # type: ignore[method-assign]


def test_buffers_a_forward_changes_are_published_as_they_were_at_the_step(tmp_path: Path) -> None:
    """The background copy overlaps the next forward, which updates buffers in place (running statistics,
    counters): those are taken at the hook, so a snapshot never holds the next forward's buffer values."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    _slow_copies(hot, 0.2)
    hot.attach(opt)
    states = []
    for _ in range(3):
        model(torch.randint(0, 40, (2, 8))).sum().backward()
        model.steps += 1
        opt.step()
        states.append(_expected(model))
        model.steps += 100  # the next forward's buffer update, while the copy is still running
        opt.zero_grad()
    hot.close()
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    assert len(hot.metrics) == 3
    for m, want in zip(hot.metrics, states):
        assert {k: t.digest() for k, t in rebuilt[m.identity].items()} == want


def test_attach_to_several_optimizers_publishes_once_all_have_stepped(tmp_path: Path) -> None:
    """Muon-style training: two optimizers over disjoint parameters. One snapshot per training step, taken
    after both stepped, whatever their order."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    mats = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("layers.") and p.ndim == 2)]
    opt_a, opt_b = torch.optim.SGD(mats, lr=0.1), torch.optim.AdamW(rest, lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    _slow_copies(hot, 0.05)
    hot.attach(opt_a, opt_b)
    states = []
    for i in range(4):
        model(torch.randint(0, 40, (2, 8))).sum().backward()
        first, second = (opt_a, opt_b) if i % 2 else (opt_b, opt_a)
        first.step()
        second.step()
        first.zero_grad(), second.zero_grad()
        states.append(_expected(model))
    hot.close()
    assert [m.step for m in hot.metrics] == [0, 1, 2, 3]
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    for m, want in zip(hot.metrics, states):
        assert {k: t.digest() for k, t in rebuilt[m.identity].items()} == want
    with pytest.raises(ValueError, match="same optimizer twice"):
        HotloadCallback(model, HotloadConfig(bucket_url=str(bucket))).attach(opt_a, opt_a)
    with pytest.raises(RuntimeError, match="closed"):
        hot.attach(opt_a)


def test_a_step_seen_twice_is_refused_and_nothing_is_overwritten(tmp_path: Path) -> None:
    """Steps name the snapshots: a loop that restarts its step count each epoch would rewrite published
    snapshots (and the one the fleet serves). The repeated step is refused before anything is written."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf),
                                              busy_policy="wait")) as hot:
        for step in range(3):
            model(torch.randint(0, 40, (2, 8))).sum().backward()
            opt.step()
            hot.step(step)
        hot.wait()
        before = {p: p.read_bytes() for p in bucket.rglob("*") if p.is_file()}
        opt.step()
        with pytest.raises(ValueError, match="step 0 does not follow step 2") as refused:
            hot.step(0)  # epoch 2 of `for step, batch in enumerate(loader)`
        assert "not the step within an epoch; to go back to an older step, create a new HotloadCallback" \
            in str(refused.value)
        with pytest.raises(ValueError, match="step 2 does not follow step 2"):
            hot.attach(opt, first_step=2)  # refused here, not from inside the next optimizer step
        for bad in (3.7, "3", True):
            with pytest.raises(ValueError, match=f"non-negative integer, got {bad!r}"):
                hot.attach(opt, first_step=bad)  # type: ignore[arg-type]  (3.7 was truncated to 3)
        opt.step()  # no hooks were left behind by the refused calls
        hot.wait()
        assert {p: p.read_bytes() for p in bucket.rglob("*") if p.is_file()} == before
        hot.step(3)
    assert [m.step for m in hot.metrics] == [0, 1, 2, 3] and all(m.ok for m in hot.metrics)


def test_a_refused_step_is_not_truncated_and_does_not_move_the_count(tmp_path: Path) -> None:
    """``step()`` ran ``int()`` on its argument: 11.5 published as step 11, and ``"12"`` and ``True`` were taken
    too. A refused step also moved the count that ``attach`` continues from (a stray ``step(3)`` after step 10
    made the next seven optimizer steps fail)."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf),
                                              busy_policy="wait")) as hot:
        hot.step(10)
        for bad in (11.5, "12", True, torch.tensor(True)):  # a bool tensor was taken as step 1 (or 0)
            with pytest.raises(ValueError, match="non-negative integer, got"):
                hot.step(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="step 3 does not follow step 10"):
            hot.step(3)
        hot.attach(opt)  # goes on from the last step taken
        model(torch.randint(0, 40, (2, 8))).sum().backward()
        opt.step()
    assert [m.step for m in hot.metrics] == [10, 11] and all(m.ok for m in hot.metrics)
    with pytest.raises(RuntimeError, match="HotloadCallback is closed: create a new one"):
        hot.step()  # said as attach() says it, and the count stays
    assert hot._step == 12


def test_a_buffer_cast_after_construction_names_the_tensor_and_both_dtypes(tmp_path: Path) -> None:
    """FSDP1's MixedPrecision(buffer_dtype=...) casts buffers at its first forward, after a callback made before
    it recorded their dtype; with a "keep" override that stopped publishing with no word of which tensor changed."""
    model = nn.Linear(4, 4)
    model.register_buffer("scale", torch.ones(3))
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "bucket"), dtype_overrides={"scale": "keep"}))
    hot.step(0)
    hot.wait()
    model.scale.data = model.scale.data.to(torch.bfloat16)  # what FSDP1 does to a buffer at its lazy init
    with pytest.raises(RuntimeError, match=r"\(tensor 'scale' was F32 \[3\], is BF16 \[3\] \(FSDP1's MixedPrecision "
                                           r"casts buffers at the first forward: create the callback after it\)\)"):
        hot.step(1)
    hot.close(raise_errors=False)


def test_a_step_given_while_attached_is_refused_with_advice_about_attach(tmp_path: Path) -> None:
    """attach() and step() both used: the hook published step 0, and step(0) was refused with advice about the
    step within an epoch, which the caller's global counter already is. It now says attach()'s hooks publish."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf),
                                              busy_policy="wait")) as hot:
        hot.attach(opt)
        model(torch.randint(0, 40, (2, 8))).sum().backward()
        opt.step()
        with pytest.raises(ValueError, match="step 0 does not follow step 0") as refused:
            hot.step(0)
        said = str(refused.value)
        assert "attach()'s hooks already publish at every optimizer.step(): use one of attach() or step()" in said
        assert "within an epoch" not in said and "older step" not in said
        hot.detach()
        with pytest.raises(ValueError, match="not the step within an epoch$"):
            hot.step(0)  # detached: the step counter is the caller's alone again
    assert [m.step for m in hot.metrics] == [0]
