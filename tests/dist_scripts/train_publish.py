"""A real FSDP training job that publishes every step into the emulator; rank 0 checks what replicas serve.

After every publish, every rank gathers the full state dict (the framework's own path) and rank 0 checks that
every replica serves, bit for bit, the gathered bytes of the snapshot it reports. Results go to --out as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from pathlib import Path

import fsspec
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from fsdp_hotload.arc.dtypes import RawTensor  # noqa: E402
from fsdp_hotload.fsdp_verify import gather_full_state  # noqa: E402
from fsdp_hotload.storage import Storage  # noqa: E402
from tests.dist_scripts.check_chunks import IDS, fsdp1, fsdp2  # noqa: E402
from tests.dist_util import finish  # noqa: E402
from tests.snapshots import rebuild_accepted  # noqa: E402
from tests.s3_fixture import FaultyFileSystem  # noqa: E402


def deployment_state(url: str) -> dict:
    """The one deployment's state from the emulator: replicas with their identity and tensors."""
    req = urllib.request.Request(f"{url}/emulator/v1/state", headers={"Authorization": "Bearer test-key"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        (dep,) = json.load(resp)["deployments"].values()
    return dep


def served(url: str) -> list[tuple[str | None, dict[str, str]]]:
    return [(r["identity"], {k: t["digest"] for k, t in r["tensors"].items()})
            for r in deployment_state(url)["replicas"]]


def served_dtypes(url: str) -> dict[str, str]:
    """The first replica's tensor dtypes (torch names), as the emulator decoded them from the snapshot."""
    return {k: t["dtype"] for k, t in deployment_state(url)["replicas"][0]["tensors"].items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fsdp2", "fsdp1", "fsdp1-orig"], required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--full-every", type=int, default=10)
    p.add_argument("--bucket", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--fail-step", type=int, default=-1, help="this step's uploads fail on --fail-rank")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--busy-policy", default="wait", choices=["wait", "skip"])
    p.add_argument("--no-wait", action="store_true", help="do not wait for each publish (exercise skipping)")
    p.add_argument("--restart-at", type=int, default=-1, help="close the callback and make a new one here")
    p.add_argument("--attach", action="store_true", help="publish from the optimizer hooks (async CPU copy)")
    p.add_argument("--dtype-overrides", default="{}", help="HotloadConfig.dtype_overrides, as JSON")
    p.add_argument("--publish-every", type=int, default=1)
    p.add_argument("--encode-workers", type=int, default=None, help="HotloadConfig.encode_workers")
    p.add_argument("--carry", default="[]", help="HotloadConfig.carry_base_tensors, as JSON")
    p.add_argument("--carried-digests", default=None, help="JSON file: the digests replicas must serve for them")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = fsdp2(dist.get_world_size(), hsdp=False) if args.mode == "fsdp2" else fsdp1(
        args.mode == "fsdp1-orig", checkpointing=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = HotloadConfig(bucket_url=args.bucket, hotload_api_url=args.url, account_id="acct", model_id="tiny",
                        deployment_id="dep", api_key="test-key", hf_config_dir=args.hf_dir, full_every=args.full_every, poll_interval_s=0.02,
                        ready_timeout_s=60, keep_training_on_error=True, busy_policy=args.busy_policy,
                        dtype_overrides=json.loads(args.dtype_overrides), publish_every=args.publish_every,
                        encode_workers=args.encode_workers, carry_base_tensors=json.loads(args.carry))
    carried = json.loads(Path(args.carried_digests).read_text()) if args.carried_digests else {}
    def open_fds() -> int:  # gloo groups hold sockets: a callback that leaks its side groups shows here
        return len(os.listdir("/proc/self/fd"))

    fds_before = open_fds()
    faulty = FaultyFileSystem(fsspec.filesystem("file"))
    storage = Storage(args.bucket, fs=faulty, max_attempts=2, base_backoff_s=0.001, max_backoff_s=0.002)
    cb = HotloadCallback(model, cfg, storage=storage)
    if args.attach:
        cb.attach(opt)
    expected: dict[str, dict[str, str]] = {}
    by_step: dict[int, dict[str, str]] = {}
    records = []
    for step in range(args.steps):
        if step == args.restart_at:
            cb.close()
            cb = HotloadCallback(model, cfg, storage=storage)
            if args.attach:
                cb.attach(opt)
        loss = model(IDS).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == args.fail_step and rank == args.fail_rank:
            faulty.arm(1000, match=".safetensors")  # every weight upload of this rank fails, retries too
        if not args.attach:
            cb.step(step)
        if not args.no_wait:
            cb.wait()
        if step == args.fail_step and rank == args.fail_rank:
            faulty.arm(0)
        # as the job's config.json says, in the dtypes the config asks for
        full = gather_full_state(model, tie_word_embeddings=True, dtype_overrides=cfg.dtype_overrides)
        by_step[step] = {**{k: RawTensor.from_any(v).digest() for k, v in full.items()}, **carried} \
            if rank == 0 else {}
        if rank == 0 and not args.no_wait:
            m = cb.metrics[-1]
            expected[m.identity] = by_step[step]
            reps = served(args.url)
            records.append({"step": step, "published_step": m.step, "kind": m.kind, "ok": m.ok, "identity": m.identity,
                            "ratio": m.ratio, "changed": m.changed_fraction,
                            "serves_current": all(i == m.identity for i, _ in reps),
                            "signalled": m.identity in {r["identity"] for r in deployment_state(args.url)["ledger"]},
                            "bit_exact": all(expected.get(i) == shas for i, shas in reps),
                            "tensors": sorted(reps[0][1]), "dtypes": served_dtypes(args.url)})
    cb.close()
    if rank == 0 and args.no_wait:
        # Publishes overlapped training: every accepted snapshot, rebuilt from the bucket, must be exactly the
        # state after its step, and the fleet must serve the last one.
        reps = served(args.url)
        last = cb.metrics[-1]
        rebuilt = {identity: {k: t.digest() for k, t in tensors.items()}
                   for identity, tensors in rebuild_accepted(args.bucket, cb.metrics).items()}
        records = [{"step": m.step, "kind": m.kind, "ok": m.ok, "identity": m.identity,
                    "skipped_before": m.skipped_before, "blocking_ms": m.blocking_ms,
                    "rebuilt_exact": rebuilt.get(m.identity) == by_step[m.step]} for m in cb.metrics]
        records[-1].update(serves_current=all(i == last.identity for i, _ in reps),
                           bit_exact=all(shas == by_step[last.step] for _, shas in reps))
    fds_after = open_fds()
    if rank == 0:
        records.append({"walks": cb.walks, "fds_before": fds_before, "fds_after": fds_after,
                        "encode_workers": cb.engine.encoder.workers,
                        "carried_owners": sorted({cb.engine.owners[cb.engine.plan.file_of(t.name)]
                                                  for t in cb.engine.carried})})
        Path(args.out).write_text(json.dumps(records, indent=1))
    dist.barrier()
    finish()


if __name__ == "__main__":
    main()
