"""FSDP training jobs under torchrun (gloo, CPU) publishing into the emulator: bit-exact every step, faults."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fsdp_hotload.emulator import HotLoadEmulator
from tests.dist_util import SCRIPTS, run_torchrun

pytestmark = pytest.mark.slow


def run_job(tmp_path: Path, nproc: int, mode: str, *extra: str) -> tuple[list[dict], dict]:
    """Runs the job; returns rank 0's records and its summary: how often its callback walked the model for chunk
    views (``walks``), and its open file descriptors before the first callback and after the last close."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    out = tmp_path / "records.json"
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)  # a test may have put base weights there
    (hf / "config.json").write_text('{"model_type": "tiny", "tie_word_embeddings": true}')
    with HotLoadEmulator(str(bucket), replicas=2, api_key="test-key") as emu:
        run_torchrun(str(SCRIPTS / "train_publish.py"), nproc,
                     ["--mode", mode, "--bucket", str(bucket), "--url", emu.url, "--out", str(out), "--hf-dir", str(hf),
                      *extra],
                     timeout=300)
    *recs, tail = json.loads(out.read_text())
    return recs, tail


def test_encode_threads_on_every_rank_stay_bit_exact(tmp_path: Path) -> None:
    recs, tail = run_job(tmp_path, 2, "fsdp2", "--steps", "12", "--full-every", "6", "--encode-workers", "3")
    assert tail["encode_workers"] == 3
    assert [r["kind"] for r in recs] == (["full"] + ["delta"] * 5) * 2
    assert all(r["ok"] and r["serves_current"] and r["bit_exact"] for r in recs), recs


@pytest.mark.parametrize("nproc,mode", [(2, "fsdp2"), (4, "fsdp2"), (2, "fsdp1"), (4, "fsdp1-orig")])
def test_forty_steps_bit_exact(tmp_path: Path, nproc: int, mode: str) -> None:
    recs, tail = run_job(tmp_path, nproc, mode, "--steps", "40", "--full-every", "10")
    assert [r["kind"] for r in recs] == (["full"] + ["delta"] * 9) * 4
    assert tail["walks"] == 1  # chunk views taken once stay valid: the framework keeps its storage across steps
    assert all(r["ok"] and r["serves_current"] and r["bit_exact"] for r in recs), recs
    # config.json says tie_word_embeddings: the shared weight is published once, under the embedding's name
    assert "model.embed_tokens.weight" in recs[-1]["tensors"] and "lm_head.weight" not in recs[-1]["tensors"]


def test_base_tensors_the_model_lacks_are_carried_bit_exact(tmp_path: Path) -> None:
    """carry_base_tensors in a real FSDP2 job: two MTP-like layers of the base checkpoint, which the model does not
    have, are served as the checkpoint stores them beside the trained tensors, through fulls and deltas; rank 0
    reads them and writes their files."""
    from fsdp_hotload.arc import save_file
    from fsdp_hotload.arc.dtypes import RawTensor

    hf = tmp_path / "hf"
    hf.mkdir()
    g = torch.Generator().manual_seed(3)
    files = {"model-00001-of-00002.safetensors": {"model.layers.8.eh_proj.weight": torch.randn(40, 20, generator=g),
                                                  "model.layers.8.norm.weight": torch.randn(20, generator=g)},
             "model-00002-of-00002.safetensors": {"model.layers.9.eh_proj.weight": torch.randn(8, 20, generator=g)}}
    digests, weight_map = {}, {}
    for fname, tensors in files.items():
        raw = {k: RawTensor.from_any(v.bfloat16()) for k, v in tensors.items()}
        (hf / fname).write_bytes(save_file(raw))
        digests.update((k, t.digest()) for k, t in raw.items())
        weight_map.update(dict.fromkeys(raw, fname))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "carried.json").write_text(json.dumps(digests))
    recs, tail = run_job(tmp_path, 2, "fsdp2", "--steps", "8", "--full-every", "4",
                         "--carry", '["model.layers.8.*", "model.layers.9.*"]',
                         "--carried-digests", str(tmp_path / "carried.json"))
    assert [r["kind"] for r in recs] == (["full"] + ["delta"] * 3) * 2
    assert all(r["ok"] and r["serves_current"] and r["bit_exact"] for r in recs), recs
    assert set(digests) <= set(recs[-1]["tensors"])
    assert tail["carried_owners"] == [0]  # rank 0 reads them, so it writes their files


def test_fsdp_over_tensor_parallelism_is_served_bit_exact(tmp_path: Path) -> None:
    """4 ranks, a 2 x 2 (data parallel x tensor parallel) mesh: see dist_scripts/tp_publish.py."""
    bucket, hf, out = tmp_path / "bucket", tmp_path / "hf", tmp_path / "records.json"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "tiny", "tie_word_embeddings": false}')
    with HotLoadEmulator(str(bucket), replicas=2, api_key="test-key") as emu:
        run_torchrun(str(SCRIPTS / "tp_publish.py"), 4, ["--bucket", str(bucket), "--url", emu.url,
                                                         "--out", str(out), "--hf-dir", str(hf)], timeout=300)
    *recs, tail = json.loads(out.read_text())
    assert tail["placements"] == ["_StridedShard", "Shard"]
    # the norms, sharded over dp alone, are held alike by both TP ranks of a dp rank: published by the first
    # (TP rank 0: ranks 0 and 2), which also publishes the row-wise biases (replicated over TP)
    assert tail["chunks"] == [12, 6, 12, 6]
    assert [r["kind"] for r in recs] == ["full", "delta", "delta", "delta"] * 2
    assert all(r["ok"] and r["bit_exact"] for r in recs), recs
    assert "layers.0.norm.weight" in recs[-1]["tensors"]


def test_a_side_group_timeout_stops_publishing_and_training_goes_on(tmp_path: Path) -> None:
    """Rank 1 waits for the outcome longer than collective_timeout_s (the replicas load slowly): the group breaks,
    both ranks end the snapshot and stop publishing instead of hanging, and every training step still runs."""
    (tmp_path / "bucket").mkdir()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "tiny", "tie_word_embeddings": true}')
    out = tmp_path / "result"
    with HotLoadEmulator(str(tmp_path / "bucket"), replicas=1, api_key="test-key", load_delay_s=6) as emu:
        run_torchrun(str(SCRIPTS / "side_group_timeout.py"), 2,
                     ["--bucket", str(tmp_path / "bucket"), "--url", emu.url, "--hf-dir", str(hf), "--out", str(out),
                      "--timeout", "2"], timeout=120)
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        assert res["started"] == [True, False, False, False], res
        assert res["stopped"], res
        # the broken snapshot has no outcome: never recorded as served, but rank 0 records that it failed
        assert res["metrics"] == ([["full", False]] if rank == 0 else []), res


def test_ranks_that_staged_different_steps_commit_nothing(tmp_path: Path) -> None:
    """Rank 1 skips a step (as after an error caught on that rank alone): every snapshot that would pair two
    different steps fails on rank 0's check, and nothing but the first, consistent snapshot is committed."""
    bucket, hf, out = tmp_path / "bucket", tmp_path / "hf", tmp_path / "result"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "tiny", "tie_word_embeddings": true}')
    run_torchrun(str(SCRIPTS / "mismatched_steps.py"), 2,
                 ["--bucket", str(bucket), "--hf-dir", str(hf), "--out", str(out)], timeout=120)
    metrics = json.loads(Path(f"{out}.0").read_text())["metrics"]
    assert [(step, ok) for step, ok, _ in metrics] == [(0, True), (1, False), (2, False), (3, False)], metrics
    assert all("ranks staged different steps" in error for _, ok, error in metrics[1:]), metrics
    committed = sorted(p.parent.name for p in bucket.glob("*/hotload.commit.json"))
    assert len(committed) == 1 and committed[0].startswith("step-000000-"), committed
    # and no rank left its files of a failed snapshot behind (rank 1's were under its own step's name)
    assert sorted(p.name for p in bucket.iterdir() if not p.name.startswith(".")) == committed


def test_one_rank_upload_failure_is_never_served(tmp_path: Path) -> None:
    recs, _ = run_job(tmp_path, 2, "fsdp2", "--steps", "6", "--fail-step", "2", "--fail-rank", "1")
    assert [(r["kind"], r["ok"]) for r in recs] == [("full", True), ("delta", True), ("delta", False),
                                                   ("full", True), ("delta", True), ("delta", True)]
    failed = recs[2]
    assert not failed["serves_current"] and not failed["signalled"]  # nobody signalled it
    assert all(r["signalled"] for r in recs if r["ok"])
    assert all(r["bit_exact"] for r in recs)  # whatever is served is exactly a snapshot's bytes


def test_restarted_trainer_starts_with_full(tmp_path: Path) -> None:
    recs, tail = run_job(tmp_path, 2, "fsdp2", "--steps", "5", "--restart-at", "3")
    assert [r["kind"] for r in recs] == ["full", "delta", "delta", "full", "delta"]
    assert all(r["ok"] and r["bit_exact"] for r in recs)
    # Both callbacks' side groups (gloo sockets and threads) are gone once each is closed.
    assert tail["fds_after"] <= tail["fds_before"], tail


def test_skip_policy_overlaps_training(tmp_path: Path) -> None:
    """Publishing in the background while training goes on, from the optimizer hooks: the CPU copy of the
    shard overlaps the next forward/backward, ranks agree on skipping without blocking (a disagreement would
    hang the side group), every publish succeeds, every accepted snapshot rebuilt from the bucket is exactly
    the state after its step (a copy racing the next optimizer step would break this), and the fleet ends on
    the last step, odd, which ``close`` publishes (publishing every second step)."""
    recs, tail = run_job(tmp_path, 2, "fsdp2", "--steps", "12", "--busy-policy", "skip", "--no-wait", "--attach",
                         "--publish-every", "2")
    assert recs and all(r["ok"] for r in recs) and recs[0]["kind"] == "full"
    # How many steps between the first and the last are skipped depends on the machine's load (on a busy one the
    # full snapshot's publish outlasts every step); close's delta of step 11 always follows step 0's full.
    assert len(recs) >= 2 and recs[-1]["kind"] == "delta", recs
    assert all(r["rebuilt_exact"] for r in recs), recs
    steps = [r["step"] for r in recs]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[-1] == 11
    assert recs[-1]["serves_current"] and recs[-1]["bit_exact"]
    assert tail["walks"] == 1


def test_attach_publishes_every_step_when_the_publisher_keeps_up(tmp_path: Path) -> None:
    """With the optimizer hooks, ranks agree on "previous snapshot finished?" in the pre-step hook, so a
    publisher that has finished (here: each rank waits for it between steps) publishes the very next step;
    agreeing at the end of the previous publish, as ``cb.step()`` must, would skip every second step."""
    recs, _ = run_job(tmp_path, 2, "fsdp2", "--steps", "6", "--busy-policy", "skip", "--attach")
    assert [r["published_step"] for r in recs] == list(range(6)), recs
    assert all(r["ok"] and r["serves_current"] and r["bit_exact"] for r in recs)
    assert [r["kind"] for r in recs][:2] == ["full", "delta"]


def test_dtype_overrides_publish_chosen_tensors_in_their_own_dtype(tmp_path: Path) -> None:
    """Per-tensor dtypes through fulls and deltas: lin1 keeps its fp32 master, the bf16 ``proj`` weight is
    published widened to fp32, the rest as bf16; every replica serves the gathered state cast the same way."""
    overrides = '{"*.lin1.*": "keep", "*.proj.weight": "float32"}'
    recs, _ = run_job(tmp_path, 2, "fsdp2", "--steps", "6", "--full-every", "3", "--dtype-overrides", overrides)
    assert [r["kind"] for r in recs] == ["full", "delta", "delta"] * 2
    assert all(r["ok"] and r["serves_current"] and r["bit_exact"] for r in recs), recs
    dtypes = recs[-1]["dtypes"]
    wide = sorted(n for n, d in dtypes.items() if d == "float32")
    assert wide and all(".lin1." in n or n.endswith(".proj.weight") for n in wide), dtypes
    assert any(n.endswith(".proj.weight") for n in wide) and any(".lin1." in n for n in wide), dtypes
    assert all(d in ("bfloat16", "int64") for n, d in dtypes.items() if n not in wide), dtypes


def test_close_gives_up_on_every_rank_when_one_rank_s_write_hangs(tmp_path: Path) -> None:
    """Rank 1's weight-file write never returns: without close_timeout_s both ranks' close() waited for ever
    (rank 0 in a side-group collective, up to collective_timeout_s). Now each raises after the deadline, and the
    job still tears its process groups down and exits."""
    bucket, out = tmp_path / "bucket", tmp_path / "result"
    bucket.mkdir()
    run_torchrun(str(SCRIPTS / "hung_close.py"), 2, ["--bucket", str(bucket), "--out", str(out), "--timeout", "2"],
                 timeout=120)
    for rank in range(2):
        res = json.loads(Path(f"{out}.{rank}").read_text())
        assert Path(f"{out}.{rank}.done").exists()
        assert res["abandoned"] and 2 <= res["took"] < 20, res
        assert f"close() gave up after 2 s (close_timeout_s) with 1 snapshot(s) still publishing on rank {rank}" \
            in res["error"], res
    assert json.loads(Path(f"{out}.1").read_text())["owned"], "rank 1 must own a file for its write to hang"
    assert "uploading" in json.loads(Path(f"{out}.1").read_text())["error"]
    committed = sorted(p.parent.name for p in bucket.glob("*/hotload.commit.json"))
    assert len(committed) == 1 and committed[0].startswith("step-000000-"), committed


def test_parts_published_transposed_or_joined_from_fsdp2_shards_are_bit_exact(tmp_path: Path) -> None:
    """Fused experts (transpose_fused_experts, 3 experts split 2 + 1), a ``Shard(1)`` weight transposed whole (boxes
    of columns), row blocks transposed, one cut mid-row by the ranks' boundary, q/k/v joined into one tensor (q's
    rows regrouped as for RoPE) and two transposed row blocks joined: every accepted snapshot, full and delta,
    rebuilt from the bucket is the gathered state, split, permuted and joined, bit for bit (transposed_publish.py)."""
    bucket, hf, out = tmp_path / "bucket", tmp_path / "hf", tmp_path / "result.json"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text("{}")
    run_torchrun(str(SCRIPTS / "transposed_publish.py"), 2,
                 ["--bucket", str(bucket), "--out", str(out), "--hf-dir", str(hf), "--steps", "6", "--full-every", "3"],
                 timeout=120)
    res = json.loads(out.read_text())
    snaps = res["snapshots"]
    assert [(s["kind"], s["ok"]) for s in snaps] == [("full", True), ("delta", True), ("delta", True)] * 2, snaps
    for s in snaps:
        assert s["names_match"] and not s["shape_mismatch"] and not s["byte_mismatch"], s
    assert res["placements"]["model.layers.0.mlp.cols.weight"] == ["Shard(dim=1)"], res["placements"]
    module, layer = res["module_shapes"], "model.layers.0.mlp."
    assert module[layer + "experts.gate_up_proj"] == [3, 6, 5] and module[layer + "cols.weight"] == [6, 4]
    # published in the permuted order, not the model's: a permutation ignored would fail here
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert all(s["shapes"] == {layer + "experts.gate_up_proj": [3, 5, 6], layer + "experts.down_proj": [3, 3, 5],
                               layer + "cols.weight": [4, 6], layer + "gate.weight": [3, 5],
                               layer + "rows.ends": [6, 2], layer + "rows.1.weight": [6, 4],
                               qkv: [12, 4]} for s in snaps), snaps[0]["shapes"]
    boxes = [{(name, json.dumps(box)) for name, _space, box in chunks} for chunks in res["chunks"]]
    # the Shard(1) weight: each rank's columns are rows of the published tensor (the box path)
    assert (layer + "cols.weight", json.dumps({"start": [0, 0], "length": [2, 6]})) in boxes[0], boxes
    assert (layer + "cols.weight", json.dumps({"start": [2, 0], "length": [2, 6]})) in boxes[1], boxes
    # row block 1 ((4, 6) before its dims are swapped) is cut by the ranks' boundary inside its row 2: rank 0 holds
    # rows 0-1 and the start of row 2, rank 1 the rest of row 2 and row 3, as boxes of the published (6, 4) tensor
    # (range_boxes: whole rows, a partial last row, a partial first row)
    cut = [sorted(json.loads(b)["start"] + json.loads(b)["length"] for n, b in rank if n == layer + "rows.1.weight")
           for rank in boxes]
    assert cut == [[[0, 0, 6, 2], [0, 2, 2, 1]], [[0, 3, 6, 1], [2, 2, 4, 1]]], cut
    # q (6 rows, regrouped: rank 0's model rows 0-2 are its rows 0, 2 and 4), k and v (3 each) joined: dim-0 shards
    # of 3 + 3, 2 + 1 and 2 + 1 rows, each moved down by the blocks before it, as ranges of the (12, 4) tensor
    ranges = [sorted(json.loads(b)["start"] + json.loads(b)["length"] for n, b in rank if n == qkv) for rank in boxes]
    assert ranges == [[[0, 4], [8, 4], [16, 4], [24, 8], [36, 8]], [[4, 4], [12, 4], [20, 4], [32, 4], [44, 4]]], \
        ranges
    # row blocks 2 (first) and 0, each (3, 2) once transposed: boxes of the joined (6, 2), block 0's moved down 3
    ends = [sorted(json.loads(b)["start"] + json.loads(b)["length"] for n, b in rank if n == layer + "rows.ends")
            for rank in boxes]
    assert ends == [[[3, 0, 3, 2]], [[0, 0, 3, 2]]], ends


def test_replicated_dtensor_buffers_of_tensor_parallel_modules_are_published(tmp_path: Path) -> None:
    """``parallelize_module`` turns the buffers of the modules it parallelises into replicated DTensors, whose
    storage cannot be read: the callback failed to start. See dist_scripts/tp_buffers.py."""
    bucket, hf, out = tmp_path / "bucket", tmp_path / "hf", tmp_path / "result.json"
    bucket.mkdir(), hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "tiny"}')
    run_torchrun(str(SCRIPTS / "tp_buffers.py"), 2, ["--bucket", str(bucket), "--hf-dir", str(hf), "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["buffer_types"] == ["DTensor"]
    assert res["buffered"] == 2  # rank 0 publishes both buffers, cloned at the hook before the next forward
    assert res["steps"] == [0, 1, 2, 3, 4] and all(res["ok"]), res
    assert all(res["exact"]), res
