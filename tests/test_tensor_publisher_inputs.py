"""TensorPublisher's inputs: views that flatten in place, other shapes and dtypes, 0-d arrays, and which tensors
it keeps alive. Every publish is rebuilt from the bucket and compared with the trainer's bytes."""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_hotload.arc.dtypes import RawTensor
from fsdp_hotload.publish import TensorPublisher
from tests.snapshots import rebuild_accepted
from tests.publisher_helpers import config


def bf16_digests(tensors: dict[str, Any]) -> dict[str, str]:
    out = {}
    for k, v in tensors.items():
        t = torch.as_tensor(v)
        out[k] = RawTensor.from_any(t.bfloat16() if t.is_floating_point() else t.contiguous()).digest()
    return out


def rebuilt_digests(bucket: str, pub: TensorPublisher) -> list[dict[str, str]]:
    rebuilt = rebuild_accepted(bucket, pub.metrics)
    return [{k: t.digest() for k, t in rebuilt[m.identity].items()} for m in pub.metrics]


@pytest.mark.parametrize("with_copy", [False, True])
def test_views_that_flatten_in_place_are_read_live(with_copy: bool, tmp_path: Path) -> None:
    """A strided 1-D view, a stride-0 expand and a column slice are not contiguous, but flattening them gives views of
    their memory, not copies. Each publish, with or without the tensors, and the final one of ``close()`` must serve
    the values they hold at that step; with a transposed view beside them (flattened into a copy) too. Alone, they
    made publish() and close() raise an AssertionError (they were taken for copies)."""
    bucket = str(tmp_path / "bucket")
    flat, one, wide, square = torch.zeros(64), torch.zeros(1), torch.zeros(16, 8), torch.zeros(12, 12)
    tensors: dict[str, Any] = {"model.norm.weight": flat[::2], "model.layers.0.input_layernorm.weight": one.expand(24),
                               "model.layers.0.mlp.gate.weight": wide[:, :1]}
    if with_copy:
        tensors["model.lm_head.weight"] = square.t()
    assert not any(v.is_contiguous() for v in tensors.values())
    expected: list[dict[str, str]] = []
    cfg = config(bucket, None, tmp_path, busy_policy="wait", full_every=3, publish_every=2)
    with TensorPublisher(tensors, cfg) as pub:
        for step in range(8):
            for base in (flat, one, wide, square):
                base.add_(torch.arange(base.numel()).reshape(base.shape) * 0.25 + step)
            # the construction tensors given again are still read live, as without them (step 7 is left to close)
            if pub.publish(step, tensors) if step % 4 == 2 else pub.publish(step):
                expected.append(bf16_digests(tensors))
            pub.wait()
        expected.append(bf16_digests(tensors))
    assert [m.step for m in pub.metrics] == [0, 2, 4, 6, 7] and all(m.ok for m in pub.metrics)
    assert {m.kind for m in pub.metrics} == {"full", "delta"}
    assert rebuilt_digests(bucket, pub) == expected


def test_another_shape_or_dtype_with_the_same_count_is_refused(tmp_path: Path) -> None:
    """Only the element count used to be compared: a transposed matrix was published under the construction's shape
    in its own order, and floats given to an int tensor were truncated, without an error."""
    bucket = str(tmp_path / "bucket")
    w, step_t = torch.arange(32, dtype=torch.float32).reshape(4, 8), torch.tensor([7], dtype=torch.int64)
    with TensorPublisher({"model.w": w, "model.step": step_t}, config(bucket, None, tmp_path)) as pub:
        with pytest.raises(ValueError, match=r"'model\.w' is torch\.float32 \[8, 4\], and was torch\.float32 \[4, 8\]"):
            pub.publish(0, {"model.w": w.t(), "model.step": step_t})
        with pytest.raises(ValueError, match=r"'model\.step' is torch\.float32 \[1\], and was torch\.int64 \[1\]"):
            pub.publish(0, {"model.w": w, "model.step": torch.tensor([7.9])})
        with pytest.raises(TypeError, match=r"tensor 'model\.step': expected a torch tensor or numpy array, got list"):
            pub.publish(0, {"model.w": w, "model.step": [7]})
        assert pub.publish(0, {"model.w": w.clone(), "model.step": step_t.clone()})
        pub.wait()
    assert [m.ok for m in pub.metrics] == [True]
    assert rebuilt_digests(bucket, pub) == [bf16_digests({"model.w": w, "model.step": step_t})]


def test_a_zero_dim_array_keeps_its_shape(tmp_path: Path) -> None:
    """``np.ascontiguousarray`` returns at least one dimension: a 0-d numpy scalar was published as shape [1], which
    the fleet refuses against the base model's []."""
    bucket = str(tmp_path / "bucket")
    tensors = {"model.scale": np.array(2.5, dtype=np.float32), "model.bias": torch.tensor(1.5)}
    with TensorPublisher(tensors, config(bucket, None, tmp_path)) as pub:
        assert pub.publish(0)
        pub.wait()
    (rebuilt,) = rebuild_accepted(bucket, pub.metrics).values()
    assert {k: (list(t.shape), t.digest()) for k, t in rebuilt.items()} == \
        {k: ([], d) for k, d in bf16_digests(tensors).items()}


def test_a_big_endian_array_is_published_by_value(tmp_path: Path) -> None:
    """An array read from a big-endian file was refused by torch with no tensor named; it is its values that
    matter. A dtype torch has no counterpart for is refused naming its tensor."""
    bucket = str(tmp_path / "bucket")
    values = np.linspace(-3, 3, 48, dtype=np.float32).reshape(6, 8)
    tensors = {"model.norm.weight": values.astype(">f4"), "model.bias": torch.ones(3)}
    with TensorPublisher(tensors, config(bucket, None, tmp_path)) as pub:
        assert pub.publish(0)
        pub.wait()
    (rebuilt,) = rebuild_accepted(bucket, pub.metrics).values()
    assert {k: t.digest() for k, t in rebuilt.items()} == bf16_digests({**tensors, "model.norm.weight": values})
    with pytest.raises(TypeError, match="tensor 'model.names'"):
        TensorPublisher({"model.names": np.array(["a", "b"])}, config(str(tmp_path / "b2"), None, tmp_path))


def gathered(step: int) -> dict[str, torch.Tensor]:
    """A state dict gathered into new tensors at each step, as a trainer that gathers its shards would."""
    g = torch.Generator().manual_seed(step)
    return {"model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g),
            "model.norm.weight": torch.full((32,), float(step))}


def test_the_construction_tensors_are_let_go_once_publish_brings_others(tmp_path: Path) -> None:
    """A publisher built on a gathered state dict and then given a new one at every publish kept the first alive (a
    whole copy of the weights) until close(). Once given others, ``publish(step)`` without tensors is refused: it
    would read tensors let go of."""
    bucket = str(tmp_path / "bucket")
    first = gathered(0)
    memory = StorageWeakRef(first["model.layers.0.mlp.up_proj.weight"].untyped_storage())
    expected = []
    with TensorPublisher(first, config(bucket, None, tmp_path, busy_policy="wait", full_every=2)) as pub:
        assert pub.publish(0, first)  # the construction tensors themselves: kept, and read in place
        expected.append(bf16_digests(first))
        del first
        pub.wait()
        gc.collect()
        assert not memory.expired()
        for step in range(1, 4):
            tensors = gathered(step)
            assert pub.publish(step, tensors)
            expected.append(bf16_digests(tensors))
            del tensors
            pub.wait()
        gc.collect()
        assert memory.expired()
        with pytest.raises(ValueError, match=r"publish\(4\) without tensors .* let go when publish\(1\) was given"):
            pub.publish(4)
    assert [m.step for m in pub.metrics] == [0, 1, 2, 3] and all(m.ok for m in pub.metrics)
    assert [m.kind for m in pub.metrics] == ["full", "delta", "full", "delta"]
    assert rebuilt_digests(bucket, pub) == expected


def test_close_lets_go_of_the_construction_tensors(tmp_path: Path) -> None:
    """A closed publisher its owner still holds (a ``with`` block's name, read for its metrics) must not keep the
    tensors it was built on alive."""
    tensors = gathered(0)
    memory = StorageWeakRef(tensors["model.norm.weight"].untyped_storage())
    with TensorPublisher(tensors, config(str(tmp_path / "bucket"), None, tmp_path)) as pub:
        assert pub.publish(0)
    del tensors
    gc.collect()
    assert memory.expired() and [m.ok for m in pub.metrics] == [True]


def test_a_transposed_tensor_is_not_copied_and_kept(tmp_path: Path) -> None:
    """A transposed view (a gathered state dict's ``w.t()``) was flattened into a copy at construction, which the
    stager kept for the publisher's life though every publish read the caller's tensor again (and flattened it into
    another copy first): a whole extra copy of every such tensor. The stager reads strided views in place."""
    from fsdp_hotload.engine.copies import storage_ptr
    bucket = str(tmp_path / "bucket")
    square, flat = torch.randn(12, 12), torch.randn(8)
    tensors = {"model.lm_head.weight": square.t(), "model.norm.weight": flat}
    expected = []
    with TensorPublisher(tensors, config(bucket, None, tmp_path, busy_policy="wait", full_every=2)) as pub:
        held = {storage_ptr(t) for t in pub.engine.stager._own}
        assert held == {storage_ptr(square), storage_ptr(flat)}, "the stager holds a copy of a caller's tensor"
        for step in range(3):
            square.add_(1.0)
            assert pub.publish(step)
            expected.append(bf16_digests(tensors))
            pub.wait()
    assert rebuilt_digests(bucket, pub) == expected


def test_a_refused_publish_keeps_the_construction_tensors(tmp_path: Path) -> None:
    """A publish given other tensors that is refused (a repeated step, a tensor on another device, one whose memory
    was freed) publishes nothing: it must not let go of the construction tensors, after which every
    ``publish(step)`` was refused for good. A tensor on another device is refused before the step is taken (it was
    refused while staging, and the same step given again was then refused as a repeat), so the step is given again."""
    bucket = str(tmp_path / "bucket")
    tensors = gathered(0)
    with TensorPublisher(tensors, config(bucket, None, tmp_path, busy_policy="wait")) as pub:
        assert pub.publish(1)
        pub.wait()
        with pytest.raises(ValueError, match="step 1 does not follow step 1"):
            pub.publish(1, gathered(1))
        with pytest.raises(ValueError, match="tensor 'model.norm.weight' is on meta, and was on cpu at construction"):
            pub.publish(2, {**gathered(2), "model.norm.weight": torch.empty(32, device="meta")})
        freed = torch.ones(32)
        freed.untyped_storage().resize_(0)  # as FSDP frees a parameter's unsharded memory: a copy of it crashed
        with pytest.raises(ValueError, match="tensor 'model.norm.weight' has no memory behind it"):
            pub.publish(2, {**gathered(2), "model.norm.weight": freed})
        tensors["model.norm.weight"].add_(1.0)
        assert pub.publish(2)
        pub.wait()
    assert [m.step for m in pub.metrics] == [1, 2] and all(m.ok for m in pub.metrics)
    assert rebuilt_digests(bucket, pub)[-1] == bf16_digests(tensors)


def test_a_step_whose_tensors_fail_while_staging_can_be_given_again(tmp_path: Path) -> None:
    """Beside an array that must be copied (big-endian), the construction tensors are read again only when a step
    is staged, so a Parameter swapped to another dtype is found there, after the engine took the step: the same
    step given again, once the tensor is fixed, was refused as a repeat ("step 1 does not follow step 1"). Nothing
    was staged, so the step is not taken."""
    bucket = str(tmp_path / "bucket")
    weight = torch.nn.Parameter(torch.randn(16, 8))
    tensors: dict[str, Any] = {"model.embed_tokens.weight": weight,
                               "model.norm.weight": np.arange(8, dtype=">f4")}
    with TensorPublisher(tensors, config(bucket, None, tmp_path, busy_policy="wait")) as pub:
        assert pub._reread
        assert pub.publish(0)
        pub.wait()
        weight.data = weight.data.half()
        with pytest.raises(ValueError, match="tensor 'model.embed_tokens.weight' is torch.float16 \\[16, 8\\]"):
            pub.publish(1)
        weight.data = torch.randn(16, 8)
        assert pub.publish(1)
        pub.wait()
        expected = bf16_digests({**tensors, "model.norm.weight": tensors["model.norm.weight"].astype("=f4")})
    assert [m.step for m in pub.metrics] == [0, 1] and all(m.ok for m in pub.metrics)
    assert rebuilt_digests(bucket, pub)[-1] == expected


@pytest.mark.parametrize("change", ["trimmed", "resized", "reinterpreted"])
def test_a_tensor_changed_where_it_lies_is_refused_named(change: str, tmp_path: Path) -> None:
    """A Parameter trimmed (``p.data = p.data[:6]``, padded vocab rows cut), a tensor resized in place, or a
    Parameter reinterpreted as another dtype of the same size keeps its first element's address and its strides:
    ``publish(step)`` took it for the tensor it had read, and published the old rows in the old shape and dtype with
    no error. It is refused, naming the tensor, and nothing is published for that step."""
    bucket = str(tmp_path / "bucket")
    emb = torch.nn.Parameter(torch.arange(32, dtype=torch.float32).reshape(8, 4), requires_grad=False)
    head = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    tensors = {"model.embed_tokens.weight": emb, "lm_head.weight": head}
    with TensorPublisher(tensors, config(bucket, None, tmp_path, busy_policy="wait")) as pub:
        assert pub.publish(0)
        pub.wait()
        if change == "trimmed":
            emb.data, bad = emb.data[:6], "'model.embed_tokens.weight' is torch.float32 \\[6, 4\\]"
        elif change == "resized":
            head.resize_(6, 4)
            bad = "'lm_head.weight' is torch.float32 \\[6, 4\\]"
        else:
            emb.data, bad = emb.data.view(torch.int32), "'model.embed_tokens.weight' is torch.int32 \\[8, 4\\]"
        with pytest.raises(ValueError, match=f"tensor {bad}, and was torch.float32 \\[8, 4\\] at construction"):
            pub.publish(1)
    assert [m.step for m in pub.metrics] == [0]


def test_sparse_and_nested_tensors_are_refused_named(tmp_path: Path) -> None:
    """They failed with torch's "Cannot access data pointer of Tensor that doesn't have storage", naming none."""
    cfg = config(str(tmp_path / "bucket"), None, tmp_path)
    with pytest.raises(TypeError, match="tensor 'model.sparse' is of layout torch.sparse_coo: give a dense tensor"):
        TensorPublisher({"model.sparse": torch.eye(3).to_sparse()}, cfg)
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    with pytest.raises(TypeError, match="tensor 'model.nested' is a nested tensor"):
        TensorPublisher({"model.w": torch.ones(3), "model.nested": nested}, cfg)


def test_a_lower_step_and_a_publish_after_close_name_the_tensor_publisher(tmp_path: Path) -> None:
    """A lower step told a TensorPublisher user to create a new HotloadCallback; ``publish(step)`` after ``close()``
    said that the construction tensors were let go, not that the publisher is closed."""
    w = torch.randn(4, 4)
    pub = TensorPublisher({"model.w": w}, config(str(tmp_path / "bucket"), None, tmp_path, busy_policy="wait"))
    assert pub.publish(3, {"model.w": w.clone()})
    with pytest.raises(ValueError, match="to go back to an older step, create a new TensorPublisher$"):
        pub.publish(2, {"model.w": w.clone()})
    pub.close()
    with pytest.raises(RuntimeError, match="TensorPublisher is closed: create a new one"):
        pub.publish(10)
    with pytest.raises(RuntimeError, match="TensorPublisher is closed: create a new one"):
        pub.publish(10, {"model.w": w})


def test_a_transposed_array_is_read_where_it_lies(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A transposed (Fortran-order) or sliced numpy array was copied at construction and again at every publish,
    logged as another byte order or negative strides, though torch views it in place. Only an array torch cannot
    view is copied, and the log line says why."""
    base = np.arange(32, dtype=np.float32).reshape(4, 8)
    arrays = {"model.lm_head.weight": base.T, "model.norm.weight": base[0, ::2]}
    bucket = str(tmp_path / "viewed")
    with caplog.at_level("INFO", logger="fsdp_hotload"):
        with TensorPublisher(arrays, config(bucket, None, tmp_path, busy_policy="wait", full_every=2)) as pub:
            assert not pub._reread  # read where they lie, not copied at each publish
            expected = []
            for step in range(3):
                base += 1.0
                assert pub.publish(step)
                expected.append(bf16_digests(arrays))
                pub.wait()
        assert "had to be copied" not in caplog.text
        flipped = {"model.norm.weight": np.arange(8, dtype=np.float32)[::-1]}
        TensorPublisher(flipped, config(str(tmp_path / "flipped"), None, tmp_path)).close()
        assert "first: 'model.norm.weight', which has negative strides" in caplog.text
    assert rebuilt_digests(bucket, pub) == expected


def test_read_only_arrays_publish_without_torchs_not_writable_warning(tmp_path: Path) -> None:
    """A read-only array (``np.broadcast_to``, a ``writeable=False`` view) is viewed in place and only ever read,
    yet torch's "The given NumPy array is not writable" UserWarning came with it, an error under ``-W error``. Run
    in a child process: torch gives that warning once per process, so an earlier test may have spent it here."""
    import subprocess
    import sys

    code = f"""
import numpy as np
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.publish import TensorPublisher
row = np.arange(8, dtype=np.float32)
frozen = np.arange(32, dtype=np.float32).reshape(4, 8)
frozen.flags.writeable = False
arrays = {{"model.bias": np.broadcast_to(row, (4, 8)), "model.w": frozen.T, "model.v": frozen}}
with TensorPublisher(arrays, HotloadConfig(bucket_url={str(tmp_path / "bucket")!r})) as pub:
    assert pub.publish(0)
"""
    env_path = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=env_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_parameter_whose_storage_is_swapped_is_published_from_its_new_memory(tmp_path: Path) -> None:
    """``TensorPublisher(dict(model.named_parameters()))`` then ``p.data = new`` (a checkpoint loaded with
    ``assign=True``): the dict holds the same Parameter, while the stager read the memory it let go of, so every
    later ``publish(step)`` served the old weights without an error. Now it follows the swap, at close too, and
    a swap to another dtype is refused, naming the tensor."""
    bucket = str(tmp_path / "bucket")
    model = torch.nn.Linear(8, 16)
    params = dict(model.named_parameters())
    expected = []
    with TensorPublisher(params, config(bucket, None, tmp_path, busy_policy="wait", publish_every=2)) as pub:
        for step in range(3):
            if step:
                model.weight.data = torch.randn(16, 8)  # a new storage under the same Parameter
            pub.publish(step)
            expected.append(bf16_digests(params))
            pub.wait()
        model.weight.data = torch.randn(16, 8)
        pub.publish(3)  # not a publishing step: close() publishes it, from the newest memory
        expected.append(bf16_digests(params))
    assert [m.step for m in pub.metrics] == [0, 2, 3] and all(m.ok for m in pub.metrics)
    assert rebuilt_digests(bucket, pub) == [expected[0], expected[2], expected[3]]
    with TensorPublisher(params, config(bucket, None, tmp_path)) as pub:
        model.bias.data = model.bias.data.half()
        with pytest.raises(ValueError, match="tensor 'bias' is torch.float16 \\[16\\], and was torch.float32"):
            pub.publish(0)


def test_a_comm_over_several_ranks_is_refused_at_construction(tmp_path: Path) -> None:
    """TensorPublisher makes whole-tensor chunks: given a comm over two ranks, every publish was staged, exchanged
    and then failed ("chunks cover 32 elements of a 16-element tensor"), or construction failed on a hash of the
    tensor specs. It is refused at once, saying what to do."""
    from tests.thread_comm import Meeting, ThreadComm

    with pytest.raises(ValueError, match="whole tensors from one process, and comm= spans 2 ranks: build it on rank 0"):
        TensorPublisher(gathered(0), config(str(tmp_path / "bucket"), None, tmp_path),
                        comm=ThreadComm(Meeting(2), 0, 2), ctrl=ThreadComm(Meeting(2), 0, 2))
    with pytest.raises(ValueError, match="tensor names must be non-empty strings, got 0"):
        TensorPublisher({0: torch.ones(2)}, config(str(tmp_path / "bucket"), None, tmp_path))
