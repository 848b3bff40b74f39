"""HotloadCallback on a plain (unsharded) module in one process, driven by the optimizer hook."""
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
from tests.moe import fused_moe_layer
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


def test_an_fp16_model_published_as_bf16_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The callback names tensors whose trainer dtype is cast to another narrow format, and globs that match
    nothing; with the matching snapshot_dtype there is nothing to say."""
    model = Net().half()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "a"),
                                             dtype_overrides={"nope.*": "keep"})).close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "6 float16 tensor(s) ('embed_tokens.weight' and 5 more) are published as bfloat16" in text, text
    assert "dtype_overrides glob 'nope.*' matches no floating tensor" in text, text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "b"), snapshot_dtype="float16")).close()
    assert not [r for r in caplog.records if "dtype" in r.getMessage()], caplog.records


def test_unmerged_lora_adapters_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """peft-style adapters: dropping them with rename would publish the base weights without the update."""
    model = Net()
    model.layers[0].lora_A = nn.ModuleDict({"default": nn.Linear(16, 2, bias=False)})
    model.layers[0].lora_B = nn.ModuleDict({"default": nn.Linear(2, 16, bias=False)})
    drop = lambda n: None if ".lora_" in n else n  # noqa: E731
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "a")), rename=drop).close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "2 unmerged LoRA adapter tensor(s) (e.g. 'layers.0.lora_A.default.weight')" in text, text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / "b"))).close()
    assert not [r for r in caplog.records if "LoRA" in r.getMessage()], caplog.records


class FusedMoe(nn.Module):
    """A sparse MoE decoder as transformers 5 builds it: each projection of all experts is one 3-D parameter,
    while the model's checkpoints name each expert's 2-D weight."""

    def __init__(self, experts: int = 4, hidden: int = 8, inter: int = 4) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(20, hidden)
        self.model.layers = nn.ModuleList([fused_moe_layer(experts, hidden, inter)])
        self.lm_head = nn.Linear(hidden, 20, bias=False)


def _base_checkpoint(folder: Path, names: list[str]) -> None:
    """A base model folder whose weight index names ``names`` (only the index is read)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "tie_word_embeddings": False}))
    weight_map = {n: "model-00001-of-00001.safetensors" for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_names_the_base_checkpoint_lacks_are_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A transformers 5 MoE model publishes fused expert tensors, which transformers 5 itself loads but the fleet,
    checking against its base checkpoint's per-expert names, refuses on every publish: said at construction."""
    per_expert = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4)
                  for p in ("gate_proj", "up_proj", "down_proj")]
    _base_checkpoint(tmp_path / "hf", ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                                        "lm_head.weight", *per_expert])
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        HotloadCallback(FusedMoe(), HotloadConfig(bucket_url=str(tmp_path / "a"),
                                                  hf_config_dir=str(tmp_path / "hf"))).close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "tensor names differ from the base checkpoint's" in text, text
    assert "12 base tensor(s) are not published (e.g. 'model.layers.0.mlp.experts.0.down_proj.weight')" in text
    assert "2 published tensor(s) are not in the base checkpoint" in text
    assert "fused MoE experts" in text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):  # no weights in the folder: the names alone say it
        HotloadCallback(FusedMoe(), HotloadConfig(bucket_url=str(tmp_path / "b"))).close()
    assert "fused MoE expert parameters (e.g. 'model.layers.0.mlp.experts.down_proj', 2 in all)" in caplog.text


def test_names_that_are_the_base_checkpoints_pass_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Index or bare safetensors headers: the same names (a tied lm_head left out on both sides) say nothing."""
    from safetensors.torch import save_file

    _base_checkpoint(tmp_path / "hf", ["embed_tokens.weight", "layers.0.weight", "layers.0.bias", "layers.1.weight",
                                        "layers.1.bias", "lm_head.weight", "steps"])
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    save_file({n: t.detach().clone() for n, t in Net().state_dict().items()}, str(bare / "model.safetensors"))
    for folder in (tmp_path / "hf", bare):
        with caplog.at_level("WARNING", logger="fsdp_hotload"):
            HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / folder.name / "b"),
                                                 hf_config_dir=str(folder))).close()
        assert "base checkpoint" not in caplog.text and "MoE" not in caplog.text, caplog.text
    (bare / "model.safetensors").write_bytes(b"\x00" * 4)  # unreadable: nothing to compare with, no error
    HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / "c"), hf_config_dir=str(bare))).close()


def test_a_tensor_in_another_layout_than_the_base_checkpoints_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The names match but a shape does not (a checkpoint that stores a tensor transposed, as Qwen3-VL-MoE's does
    its experts against transformers 5's model): the fleet would refuse every snapshot, so it is said at start,
    read from the safetensors headers, bare or through the index; an index whose files are absent gives names
    only, and says nothing of shapes."""
    from safetensors.torch import save_file

    state = {n: t.detach().clone() for n, t in Net().state_dict().items()}
    state["embed_tokens.weight"] = state["embed_tokens.weight"].t().contiguous()  # (16, 40) for (40, 16)
    state["layers.1.bias"] = torch.zeros(17)
    bare, indexed, names_only = (tmp_path / d for d in ("bare", "indexed", "names"))
    for folder in (bare, indexed, names_only):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    save_file(state, str(bare / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in state}}
    for folder in (indexed, names_only):
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(state, str(indexed / "model-00001-of-00001.safetensors"))
    for folder in (bare, indexed, names_only):
        caplog.clear()
        with caplog.at_level("WARNING", logger="fsdp_hotload"):
            HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / folder.name / "b"),
                                                 hf_config_dir=str(folder))).close()
        text = "\n".join(r.getMessage() for r in caplog.records)
        if folder is names_only:
            assert "shape" not in text and "base checkpoint" not in text, text
            continue
        assert ("2 published tensor(s) have another shape than in the base checkpoint in hf_config_dir (e.g. "
                "'embed_tokens.weight': [40, 16] published, [16, 40] there (the same dims in another order: a "
                "transposed layout)), so the fleet will not load these snapshots as that checkpoint's tensors: "
                "publish them in its layout") in text, text
        assert "names differ" not in text, text


def test_fused_experts_are_published_per_expert_bit_exact(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    """split=split_fused_experts publishes a transformers 5 MoE model under its checkpoint's per-expert names:
    each expert's gate, up and down weights are its ranges of the fused tensors, through a full snapshot and a
    delta, and the names check against the base checkpoint has nothing to say."""
    from fsdp_hotload import split_fused_experts

    experts, hidden, inter = 3, 8, 4
    per_expert = [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(experts)
                  for p in ("gate_proj", "up_proj", "down_proj")]
    _base_checkpoint(tmp_path / "hf", ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                                        "lm_head.weight", *per_expert])
    torch.manual_seed(0)
    model = FusedMoe(experts, hidden, inter)
    bucket = tmp_path / "bucket"
    cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(tmp_path / "hf"), full_every=2,
                        busy_policy="wait")
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        hot = HotloadCallback(model, cfg, split=split_fused_experts)
    assert "base checkpoint" not in caplog.text and "MoE" not in caplog.text, caplog.text
    mlp = model.model.layers[0].mlp

    def published() -> dict[str, torch.Tensor]:
        want = {"model.embed_tokens.weight": model.model.embed_tokens.weight,
                "model.layers.0.mlp.gate.weight": mlp.gate.weight, "lm_head.weight": model.lm_head.weight}
        for e in range(experts):
            want[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = mlp.experts.gate_up_proj[e, :inter]
            want[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = mlp.experts.gate_up_proj[e, inter:]
            want[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = mlp.experts.down_proj[e]
        return want

    _two_publishes_bit_exact(model, hot, published, bucket)


def _two_publishes_bit_exact(model: nn.Module, hot: HotloadCallback, published: Any, bucket: Path) -> None:
    """Two sparse updates of ``model``, each published by ``hot`` (a full snapshot, then a delta); each rebuilt
    snapshot must hold exactly what ``published()`` (name -> tensor, in the published layout) gave at its step,
    cast to bf16. Closes ``hot``."""
    expected = []
    with hot:
        for step in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1 * (torch.rand_like(p) < 0.3))
            hot.step(step)
            hot.wait()
            expected.append({k: RawTensor.from_any(v.detach().bfloat16().contiguous())
                             for k, v in published().items()})
    assert [(m.kind, m.ok) for m in hot.metrics] == [("full", True), ("delta", True)]
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    for m, want_raw in zip(hot.metrics, expected):
        got = rebuilt[m.identity]
        assert sorted(got) == sorted(want_raw)
        for name, raw in want_raw.items():
            assert (got[name].shape, got[name].data.tobytes()) == (raw.shape, raw.data.tobytes()), name


def test_fused_experts_in_a_transposed_checkpoint_layout_are_published_bit_exact(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """split=transpose_fused_experts publishes the fused experts as Qwen3-VL-MoE's checkpoints store them, their
    last two dims swapped, through a full snapshot and a delta, bit exact; a base checkpoint in that layout then
    gives no shape warning, and one in the model's layout does. A part split per expert and transposed (a
    per-expert checkpoint that stores each weight transposed) is published likewise."""
    from safetensors.torch import save_file

    from fsdp_hotload import transpose_fused_experts

    experts, hidden, inter = 3, 8, 4
    torch.manual_seed(0)
    model = FusedMoe(experts, hidden, inter)
    mlp = model.model.layers[0].mlp

    def per_expert_transposed(path: str, shape: tuple[int, ...]) -> list[tuple[Any, ...]] | None:
        if not path.endswith("down_proj"):
            return None
        return [(f"{path}.{e}", e * hidden * inter, (hidden, inter), (1, 0)) for e in range(experts)]

    def layouts() -> list[dict[str, torch.Tensor]]:  # what each split publishes, from the live weights
        common = {"model.embed_tokens.weight": model.model.embed_tokens.weight,
                  "model.layers.0.mlp.gate.weight": mlp.gate.weight, "lm_head.weight": model.lm_head.weight}
        down = "model.layers.0.mlp.experts.down_proj"
        return [{**common, "model.layers.0.mlp.experts.gate_up_proj": mlp.experts.gate_up_proj.transpose(1, 2),
                 down: mlp.experts.down_proj.transpose(1, 2)},
                {**common, "model.layers.0.mlp.experts.gate_up_proj": mlp.experts.gate_up_proj,
                 **{f"{down}.{e}": mlp.experts.down_proj[e].t() for e in range(experts)}}]

    for i, split in enumerate([transpose_fused_experts, per_expert_transposed]):
        hf, bucket = tmp_path / f"hf{i}", tmp_path / f"bucket{i}"
        hf.mkdir()
        (hf / "config.json").write_text("{}")
        save_file({k: v.detach().contiguous() for k, v in layouts()[i].items()}, str(hf / "model.safetensors"))
        cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), full_every=2, busy_policy="wait")
        caplog.clear()
        with caplog.at_level("WARNING", logger="fsdp_hotload"):
            hot = HotloadCallback(model, cfg, split=split)
        assert "shape" not in caplog.text and "base checkpoint" not in caplog.text, caplog.text
        _two_publishes_bit_exact(model, hot, lambda i=i: layouts()[i], bucket)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fsdp_hotload"):  # the model's layout against a transposed checkpoint
        HotloadCallback(model, HotloadConfig(bucket_url=str(tmp_path / "c"), hf_config_dir=str(tmp_path / "hf0")
                                             )).close()
    assert ("'model.layers.0.mlp.experts.down_proj': [3, 8, 4] published, [3, 4, 8] there (the same dims in another "
            "order: a transposed layout)), so the fleet will not load these snapshots as that checkpoint's tensors: "
            "pass split=transpose_fused_experts") in caplog.text, caplog.text


def test_a_start_up_check_that_fails_is_told_and_publishing_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The start-up checks run on rank 0 only, after the publisher started: an error in one would stop rank 0 alone
    while the other ranks go on to their first collective. It is logged instead, and the callback publishes."""
    import fsdp_hotload.callback as callback_module

    def broken(*_a: Any, **_k: Any) -> str | None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(callback_module, "shapes_note", broken)
    with caplog.at_level("WARNING", logger="fsdp_hotload"):
        with HotloadCallback(Net(), HotloadConfig(bucket_url=str(tmp_path / "b"), busy_policy="wait")) as hot:
            hot.step(0)
    assert "start-up checks of the model's names, dtypes and shapes failed: RecursionError" in caplog.text
    assert [(m.kind, m.ok) for m in hot.metrics] == [("full", True)]


def test_a_split_must_tile_its_tensor(tmp_path: Path) -> None:
    """A split that leaves elements out would publish a model without them; one that overlaps, some twice."""
    from fsdp_hotload.fsdp import full_tensor_specs

    def gap(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
        if path.endswith("down_proj"):  # (4, 8, 4): 128 elements; parts of 32 at 0 and 64
            return [(path + ".a", 0, (8, 4)), (path + ".b", 64, (8, 4))]
        return None

    def short(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
        return [(path + ".a", 0, (1,))] if path.endswith("down_proj") else None

    with pytest.raises(ValueError, match=r"tile the tensor's elements in order; the part at element 32"):
        full_tensor_specs(FusedMoe(), split=gap)
    with pytest.raises(ValueError, match=r"covers 1 of its 128 elements"):
        full_tensor_specs(FusedMoe(), split=short)


def _raises(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
    if path.endswith("down_proj"):
        raise KeyError("no such expert")
    return None


@pytest.mark.parametrize("split", [
    lambda p, s: [(p + ".a", 0)] if p.endswith("down_proj") else None,  # no shape
    lambda p, s: [(p + ".a", 0, 128)] if p.endswith("down_proj") else None,  # a shape that is not a sequence
    lambda p, s: [(p + ".a", None, (4, 8, 4))] if p.endswith("down_proj") else None,  # no first element
    lambda p, s: "parts" if p.endswith("down_proj") else None,  # not a list of parts
    lambda p, s: [(p + ".a", 0, (-4, -32))] if p.endswith("down_proj") else None,  # negative dims, 128 elements
    lambda p, s: [(p + ".a", 0, (4, 8, 4), (0, 0, 1))] if p.endswith("down_proj") else None,  # not an order
    lambda p, s: [(p + ".a", 0, (4, 8, 4), (0, 2))] if p.endswith("down_proj") else None,  # too few dims
    lambda p, s: [(p + ".a", 0, (4, 8, 4), (0, 2, 1), "x")] if p.endswith("down_proj") else None,  # a str shape
    lambda p, s: [(p + ".a", 0, (4, 8, 4), None, (4, 30))] if p.endswith("down_proj") else None,  # 120 elements
    lambda p, s: [(p + ".a", 0, (4, 8, 4), None, (-4, -32))] if p.endswith("down_proj") else None,  # negative
    lambda p, s: [(p + ".a", 0, (4, 8, 4), None, (128,), 0)] if p.endswith("down_proj") else None,  # six items
    _raises,
], ids=["pair", "int-shape", "none-start", "str", "negative-dims", "repeated-dim", "short-order", "str-as-shape",
        "as-shape-count", "as-shape-negative", "six", "raises"])
def test_a_malformed_split_is_refused_naming_the_tensor(split: Any) -> None:
    """A split is user code run over every tensor of the model: whatever goes wrong in it or in what it returns
    is a ValueError that names the tensor it was dividing, never an unpacking or comparison error from inside
    the walk, nor a part of negative dims (whose element count can still come out right) reaching the snapshot."""
    from fsdp_hotload.fsdp import full_tensor_specs

    with pytest.raises(ValueError, match=r"split\('model\.layers\.0\.mlp\.experts\.down_proj', \(4, 8, 4\)\)"):
        full_tensor_specs(FusedMoe(), split=split)


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
