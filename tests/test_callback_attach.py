"""attach() over a callback's life: a second callback on the same optimizer, a watchdog's close(), optimizers
that miss parameters, and the memory a closed callback lets go of. One process, an unsharded module."""
from __future__ import annotations

import _thread
import gc
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_hotload import HotloadCallback, HotloadConfig
from tests.snapshots import rebuild_accepted
from tests.test_callback import Net, _expected, _setup, _slow_copies


def _train(model: Net, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randint(0, 40, (2, 8))).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_second_callback_on_the_same_optimizer_takes_the_place_of_the_first(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A notebook cell run again builds a second callback and attaches it to the same optimizer: both published
    every step (to one deployment, each failing the other's deltas). The first one's hooks are now removed."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait")
    first = HotloadCallback(model, cfg)
    first.attach(opt)
    _train(model, opt, 1)
    second = HotloadCallback(model, cfg)
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        second.attach(opt)
    assert "another HotloadCallback publishing to " in caplog.text and "was attached to this optimizer" in caplog.text
    assert len(opt._optimizer_step_post_hooks) == 1 and len(opt._optimizer_step_pre_hooks) == 1
    _train(model, opt, 2)
    second.wait()
    want = _expected(model)
    first.close()
    second.close()
    assert [m.step for m in first.metrics] == [0]
    assert [m.step for m in second.metrics] == [0, 1] and all(m.ok for m in second.metrics)
    rebuilt = rebuild_accepted(bucket, second.metrics)
    assert {k: t.digest() for k, t in rebuilt[second.metrics[-1].identity].items()} == want


def test_callbacks_with_their_own_buckets_and_fleets_share_an_optimizer(tmp_path: Path) -> None:
    """One optimizer, two callbacks publishing to two buckets (a policy and its draft model, or one model to two
    regions): the second attach() removed the first one's hooks, and its fleet got no snapshot at all. Only a
    callback on the same bucket, or signalling one of the same deployments, takes the other's place."""
    from fsdp_hotload.callback import _clash

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (bucket_a, hf), (bucket_b, _) = _setup(tmp_path / "a"), _setup(tmp_path / "b")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket_a), hf_config_dir=str(hf), busy_policy="wait"))
    two = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket_b), hf_config_dir=str(hf), busy_policy="wait"))
    one.attach(opt)
    two.attach(opt)
    _train(model, opt, 2)
    want = _expected(model)
    one.close()
    two.close()
    for hot, bucket in ((one, bucket_a), (two, bucket_b)):
        assert [m.step for m in hot.metrics] == [0, 1] and all(m.ok for m in hot.metrics)
        rebuilt = rebuild_accepted(bucket, hot.metrics)
        assert {k: t.digest() for k, t in rebuilt[hot.metrics[-1].identity].items()} == want

    def api(bucket: Path, deployments: list[str], account: str = "acct") -> HotloadConfig:
        return HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), hotload_api_url="https://api.example",
                             account_id=account, model_id="m", deployment_id=deployments, api_key="k")

    assert _clash(api(bucket_a, ["d1", "d2"]), api(bucket_b, ["d2"])) == "signalling deployment d2"
    assert _clash(api(bucket_a, ["d1"]), api(bucket_b, ["d2"])) is None
    assert _clash(api(bucket_a, ["d1"]), api(bucket_b, ["d1"], account="other")) is None
    assert _clash(api(bucket_a, ["d1"]), api(bucket_a, ["d2"])) == f"publishing to {bucket_a}"
    (tmp_path / "link").symlink_to(bucket_a)
    same = [str(bucket_a), f"{bucket_a}/", f"file://{bucket_a}", os.path.relpath(bucket_a), f"local://{bucket_a}",
            f"{bucket_a}/../{bucket_a.name}", str(tmp_path / "link")]
    assert all(_clash(api(x, ["d1"]), api(y, ["d2"])) for x in same for y in same)  # type: ignore[arg-type]
    assert _clash(api("s3://b/run/", ["d1"]), api("s3://b/run", ["d2"]))  # type: ignore[arg-type]
    assert _clash(api("s3://b/run", ["d1"]), api("s3://b/run2", ["d2"])) is None  # type: ignore[arg-type]
    assert _clash(api("s3a://b/run", ["d1"]), api("s3://b/run", ["d2"]))  # type: ignore[arg-type]  # one backend

    def at(url: str, endpoint: str) -> HotloadConfig:
        return HotloadConfig(bucket_url=url, storage_options={"endpoint_url": endpoint}, hf_config_dir=str(hf))

    # one bucket path on two stores (a MinIO per region) is two buckets: both callbacks stay attached
    assert _clash(at("s3://models/run", "http://minio-eu:9000"), at("s3://models/run", "http://minio-us:9000")) is None
    assert _clash(at("s3://models/run", "http://minio-eu:9000"), at("s3a://models/run/", "http://minio-eu:9000/"))


def test_a_watchdogs_close_leaves_the_optimizers_hooks_to_the_training_thread(tmp_path: Path) -> None:
    """close() on another thread removed the hooks while the trainer's optimizer.step() iterated over them
    ("OrderedDict mutated during iteration"). From another thread they now stay, as no-ops: no publish after it,
    and the trainer's steps run on without an error."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    hot.attach(opt)
    user_hook_calls: list[int] = []
    opt.register_step_post_hook(lambda *_: user_hook_calls.append(1))  # after ours: iterated while close() runs
    _train(model, opt, 2)
    closer = threading.Thread(target=hot.close)
    closer.start()
    closer.join(30)
    assert not closer.is_alive() and hot.engine.closed
    published = [m.step for m in hot.metrics]
    _train(model, opt, 3)  # the hooks are still registered, and do nothing
    assert len(opt._optimizer_step_post_hooks) == 2 and user_hook_calls == [1] * 5
    assert [m.step for m in hot.metrics] == published == [0, 1]


def _backward_on_a_foreign_thread(loss: torch.Tensor) -> None:
    """Run backward on a thread the threading module did not start (as autograd's device thread on CUDA, which
    runs the hooks of optimizers stepped inside backward), while this thread waits for it."""
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            loss.backward()
        except BaseException as exc:  # noqa: BLE001 - raised on the waiting thread
            errors.append(exc)
        finally:
            done.set()

    _thread.start_new_thread(run, ())
    assert done.wait(60)
    if errors:
        raise errors[0]


def test_optimizers_stepped_on_autograds_thread_publish_their_final_step_with_step_after_backward(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An optimizer per parameter stepped inside backward: on CUDA autograd runs those hooks on its device thread,
    so with attach() every publish came from there and close(), on the training thread, cannot know whether a step
    is under way: it leaves a skipped newest step out, and says to call step() after backward() instead, which
    publishes from the training thread, and then close() publishes the newest step."""
    model = Net()
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_in_backward(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    for p in opts:
        p.register_post_accumulate_grad_hook(step_in_backward)
    for attach in (True, False):
        (tmp_path / str(attach)).mkdir()
        bucket, hf = _setup(tmp_path / str(attach))
        cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait", publish_every=3)
        hot = HotloadCallback(model, cfg)
        if attach:
            hot.attach(*opts.values())
        for step in range(5):
            _backward_on_a_foreign_thread(model(torch.randint(0, 40, (2, 8))).sum())
            if not attach:
                hot.step(step)
        want = _expected(model)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            hot.close()
        if attach:
            assert [m.step for m in hot.metrics] == [0, 3] and all(m.ok for m in hot.metrics)
            assert "published from a thread Python did not start" in caplog.text
            assert "call hot.step(step) after backward() instead of attach()" in caplog.text
            continue
        assert [m.step for m in hot.metrics] == [0, 3, 4] and all(m.ok for m in hot.metrics)
        rebuilt = rebuild_accepted(bucket, hot.metrics)
        assert {k: t.digest() for k, t in rebuilt[hot.metrics[-1].identity].items()} == want


def test_close_on_the_attaching_thread_publishes_nothing_more_while_another_thread_trains(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A watchdog's close() on the thread that called attach(), while the trainer's own thread is in the middle of
    a step, publishes nothing more: the snapshot would mix two steps' weights under one step's name."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait",
                                               publish_every=3))
    hot.attach(opt)
    mid_step, closed = threading.Event(), threading.Event()

    def hold_step_5(*_: object) -> None:  # runs after the callback's pre-step hook: the trainer is mid-step
        if hot.engine.latest_step == 4:
            mid_step.set()
            closed.wait(60)

    opt.register_step_pre_hook(hold_step_5)
    with ThreadPoolExecutor(1) as trainer:
        trained = trainer.submit(_train, model, opt, 6)
        assert mid_step.wait(60)
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            hot.close()  # the watchdog, on the thread that attached
        closed.set()
        trained.result()
    assert [m.step for m in hot.metrics] == [0, 3] and all(m.ok for m in hot.metrics)
    assert "the newest step 4 is not published at close: close() runs on another thread" in caplog.text


def test_attach_names_trainable_parameters_no_given_optimizer_updates(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    bucket, hf = _setup(tmp_path)
    model = Net()
    head = torch.optim.SGD(model.lm_head.parameters(), lr=0.1)
    rest = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("lm_head")], lr=0.1)
    model.embed_tokens.weight.requires_grad_(False)  # frozen: nobody needs to update it
    with HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf))) as hot:
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            hot.attach(rest)
        assert "1 trainable parameter(s) are not updated by the optimizer(s) given to attach(), e.g. " \
               "lm_head.weight" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            hot.attach(rest, head)
        assert "not updated by the optimizer" not in caplog.text


def test_a_closed_callback_its_owner_still_holds_lets_the_model_memory_go(tmp_path: Path) -> None:
    """The callback's views and the stager's copy sources kept every parameter's old memory alive after close()
    (a whole shard on a GPU), for as long as the owner held the closed callback."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    hot.attach(opt)
    _train(model, opt, 1)
    hot.close()
    old = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()  # as an offload to another device does
    gc.collect()
    assert all(ref.expired() for ref in old), sum(not ref.expired() for ref in old)
    assert hot.engine.closed  # still held here


def test_detach_on_the_training_thread_still_removes_the_hooks(tmp_path: Path) -> None:
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf))) as hot:
        hot.attach(opt)
        t0 = time.monotonic()
        hot.detach()
        assert time.monotonic() - t0 < 10
        assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks


def test_an_attached_optimizer_that_is_freed_is_warned_about(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A loop that re-creates its optimizer without attaching the new one stopped publishing with no word: the
    hooks went with the old optimizer. Now a warning says so at the next optimizer step (no cycle keeps the
    optimizer alive until a collection). The right pattern, ``opt = AdamW(...); hot.attach(opt)``, frees the old
    one before it attaches the new one: it was warned about too, and is not any more; nor is an optimizer
    replaced by attach(), or freed after close()."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf),
                                              busy_policy="wait")) as hot:
        hot.attach(opt)
        _train(model, opt, 1)
        with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # the old one is freed here
            hot.attach(opt)
            _train(model, opt, 1)
            assert "was freed" not in caplog.text
            opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # not attached this time
            assert "was freed" not in caplog.text  # not yet: attach() may follow
            _train(model, opt, 1)
            assert caplog.text.count("the AdamW optimizer this HotloadCallback was attached to was freed") == 1
            caplog.clear()
            _train(model, opt, 1)  # said once
            hot.attach(opt)
            _train(model, opt, 1)
            sgd = torch.optim.SGD(model.parameters(), lr=0.1)
            hot.attach(sgd)
            opt = sgd  # the AdamW one is freed after attach() let it go: said nothing
            gc.collect()
            _train(model, opt, 1)
            hot.wait()
        assert "was freed" not in caplog.text
        assert [m.step for m in hot.metrics] == [0, 1, 2, 3] and all(m.ok for m in hot.metrics)
    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        del opt
        gc.collect()
    assert "was freed" not in caplog.text


@pytest.mark.parametrize("how", ["attach", "step"])
def test_optimizer_in_backward_publishes_each_step_bit_exact(how: str, tmp_path: Path) -> None:
    """An optimizer per parameter, stepped from its gradient hook during backward (to free each gradient at
    once): attach() takes all of them, and a snapshot is taken once every one has stepped, its background copy
    overlapping the next backward, whose first optimizer step waits for it; or step() is called after backward."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opts = {p: torch.optim.AdamW([p], lr=0.05) for p in model.parameters()}

    def step_in_backward(p: torch.Tensor) -> None:
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    _slow_copies(hot, 0.1)  # the copy still reads the weights while the next backward steps the optimizers
    if how == "attach":
        hot.attach(*opts.values())
    wants = []
    for step in range(4):
        model(torch.randint(0, 40, (2, 8))).sum().backward()
        if how == "step":
            hot.step(step)
        wants.append(_expected(model))
    hot.close()
    assert [(m.step, m.kind, m.ok) for m in hot.metrics] == [(0, "full", True)] + [(s, "delta", True)
                                                                                 for s in (1, 2, 3)]
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    for m, want in zip(hot.metrics, wants):
        assert {k: t.digest() for k, t in rebuilt[m.identity].items()} == want, m.step


def test_a_step_too_long_for_an_identity_is_refused_at_the_call(tmp_path: Path) -> None:
    """A step whose identity passes 128 characters failed on the publisher's thread, was logged as "a collective on
    the publisher's side group failed", and publishing stopped for the rest of the job without an error."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait", identity_prefix="x" * 41)
    with HotloadCallback(model, cfg) as hot:
        hot.step(10**76)
        with pytest.raises(ValueError, match="is 132 characters long"):
            hot.step(10**80)
        with pytest.raises(ValueError, match="is 132 characters long"):
            hot.attach(opt, first_step=10**80)
        hot.step(10**76 + 1)
        hot.wait()
    assert [m.step for m in hot.metrics] == [10**76, 10**76 + 1] and all(m.ok for m in hot.metrics)
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    assert {k: t.digest() for k, t in rebuilt[hot.metrics[-1].identity].items()} == _expected(model)


def test_hooks_detached_from_another_thread_stay_dead_after_a_new_attach(tmp_path: Path) -> None:
    """attach() again from another thread than the one that stepped the optimizer left the first attach's hooks on
    it, as no-ops keyed on one flag of the callback, which the new attach() turned back on: each optimizer step then
    published twice, under two step numbers. Each attach() has its own switch now."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    hot.attach(opt)
    _train(model, opt, 1)  # step 0, on this thread
    errors: list[BaseException] = []

    def worker() -> None:  # training moves to a worker thread, which attaches again
        try:
            hot.attach(opt)
            _train(model, opt, 3)
            hot.close()
        except BaseException as exc:  # noqa: BLE001 - told to the test's thread
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert [m.step for m in hot.metrics] == [0, 1, 2, 3] and all(m.ok for m in hot.metrics)
    # closed on the thread that stepped the optimizer last: the hooks left it
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks


def test_close_on_the_training_thread_removes_hooks_attached_on_another(tmp_path: Path) -> None:
    """attach() on a set-up thread, training and close() on the main thread: the hooks stayed on the optimizer for
    good, and kept the closed callback (its engine, buffers and views) alive with it. Whether they can be removed
    is decided by the thread that steps the optimizer, not by the one that attached."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    setup = threading.Thread(target=hot.attach, args=(opt,))
    setup.start()
    setup.join(30)
    _train(model, opt, 2)
    hot.close()
    assert [m.step for m in hot.metrics] == [0, 1]
    assert not opt._optimizer_step_post_hooks and not opt._optimizer_step_pre_hooks
    gone = weakref.ref(hot)
    del hot
    gc.collect()
    assert gone() is None


def test_callbacks_sharing_an_optimizer_each_count_a_step_another_ones_error_was_raised_at(tmp_path: Path) -> None:
    """Two callbacks on one optimizer (two buckets): the first one's post-step hook raised its stored publish
    error, torch skipped the later post-step hooks, and the second callback never counted that step: every later
    snapshot of its carried the step before the trainer's. Every attached callback now runs at every step, and the
    error is still raised from optimizer.step()."""
    import fsspec

    from fsdp_hotload.engine import PublishError
    from fsdp_hotload.storage import Storage
    from tests.test_close import _FailFirstWeightWrite

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (bucket_a, hf), (bucket_b, _) = _setup(tmp_path / "a"), _setup(tmp_path / "b")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    storage = Storage(str(bucket_a), fs=_FailFirstWeightWrite(fsspec.filesystem("file")), max_attempts=1)
    one = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket_a), hf_config_dir=str(hf), busy_policy="wait",
                                               storage_attempts=1), storage=storage)
    two = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket_b), hf_config_dir=str(hf), busy_policy="wait"))
    one.attach(opt)
    two.attach(opt)
    raised = []
    for step in range(4):
        try:
            _train(model, opt, 1)
        except PublishError as exc:
            raised.append((step, str(exc)))
        one.wait()
        two.wait()
    want = _expected(model)
    one.close()
    two.close()
    assert [s for s, _ in raised] == [1] and "injected" in raised[0][1], raised  # step 0's error, at step 1
    assert [(m.step, m.ok) for m in one.metrics] == [(0, False), (2, True), (3, True)]
    assert [m.step for m in two.metrics] == [0, 1, 2, 3] and all(m.ok for m in two.metrics)
    rebuilt = rebuild_accepted(bucket_b, two.metrics)
    assert {k: t.digest() for k, t in rebuilt[two.metrics[-1].identity].items()} == want


def test_a_watchdog_detach_during_the_post_hook_still_fences_the_next_step(tmp_path: Path) -> None:
    """A detach() on a watchdog thread that lands after the trainer's post-step hook decided to publish, and before
    it started its background copy: the detach's own fence found nothing staged, and taking the callback's part off
    the optimizer at once let the trainer's next optimizer.step() change the weights under that copy, so the snapshot
    held the next step's weights under this step's name. The part now stays until that next step has fenced."""
    bucket, hf = _setup(tmp_path)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hot = HotloadCallback(model, HotloadConfig(bucket_url=str(bucket), hf_config_dir=str(hf), busy_policy="wait"))
    _slow_copies(hot, 0.5)
    hot.attach(opt)
    in_publish, detached = threading.Event(), threading.Event()
    real_publish = hot.engine.publish
    expected: dict[int, dict] = {}

    def publish(step: int, *args: object, **kwargs: object) -> bool:
        if step == 1:  # the post-hook passed its live check; the watchdog's detach lands now
            in_publish.set()
            assert detached.wait(30)
        return real_publish(step, *args, **kwargs)

    hot.engine.publish = publish  # type: ignore[method-assign]
    opt.register_step_post_hook(lambda *_: expected.setdefault(len(expected), _expected(model)))  # after ours

    def watchdog() -> None:
        in_publish.wait(30)
        hot.detach()
        detached.set()

    threading.Thread(target=watchdog, daemon=True).start()
    _train(model, opt, 3)
    hot.wait()
    hot.close()
    ok = [m for m in hot.metrics if m.ok]
    assert [m.step for m in ok] == [0, 1]
    rebuilt = rebuild_accepted(bucket, hot.metrics)
    for m in ok:
        assert {k: t.digest() for k, t in rebuilt[m.identity].items()} == expected[m.step], m.step
