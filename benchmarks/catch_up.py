"""How stale a deployment left behind stays, with and without its catch-up (``deployments_required="any"``).

Two deployments read one bucket; one (``pool-eu``) fails during publishes ``--out-from`` to ``--out-to``
(inclusive), then recovers. ``--fault`` says how:

- ``refuse``: it refuses every signal (HTTP 400, as a region whose API is down or refuses requests);
- ``hang``: its loads take ``--hang-s``, longer than ``--ready-timeout-s`` (replicas hanging in a load);
- ``manager``: its hot-load manager is down (no replica reported; with ``--out-from 0``, down at the start).

Without a catch-up it serves its last snapshot until the next full one (``full_every`` publishes apart), and a
full snapshot's publish waits ``ready_timeout_s`` for replicas that hang; with it, it loads the snapshots it missed,
in order, on a thread of its own, which alone waits for one whose last load timed out. A TensorPublisher (one process) publishes ``--steps``
steps of a 4-tensor model to a local-folder bucket; the in-process emulator serves both deployments (2 replicas
each, every load delayed ``--load-s``), and the trainer steps ``--step-s`` apart. After each step's publish, and
its step time, the script reads which step each ``pool-eu`` replica serves and compares the bytes it serves with
the trainer's. It prints per run: the staleness of ``pool-eu`` (published step minus the step it serves) per
step, its sum and the steps behind, the publishes whose bytes it served, its loads, the bytes written, and the
median and the slowest hook-to-served time of the publishes, and the sum of their readiness waits (what the
healthy deployment waits, on the publisher's thread). The baseline, in the same run, is the same job without the
catch-up (and with the publishes waiting for a deployment whose last load timed out, as they used to). With
``--straggler-wait-s`` a third run sets ``straggler_wait_s``: each publish waits that long for pool-eu once pool-us
serves, then leaves pool-eu's load to its catch-up (``--fault hang`` with ``--hang-s`` below ``--ready-timeout-s``
is a slow region rather than a hung one).

    python benchmarks/catch_up.py [--fault refuse|hang|manager] [--steps 20] [--full-every 10] [--out-from 2]
        [--out-to 4] [--load-s 0.5] [--hang-s 30] [--ready-timeout-s 3] [--straggler-wait-s 0.5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_args import arg_float, arg_int, arg_positive  # noqa: E402  (the repository root is on sys.path)

EU = "accounts/acct/deployments/pool-eu"


class _Never(set):  # type: ignore[type-arg]
    """The baseline's record of timed-out deployments: never holds one, so every publish waits for them."""

    def add(self, item: object) -> None:
        pass


def fault(emu: Any, args: argparse.Namespace, on: bool) -> None:
    """Start (``on``) or end ``args.fault`` on pool-eu."""
    if args.fault == "refuse" and on:
        emu.reject_next_signals(1_000_000, status=400, message="region down", deployment=EU)
    elif args.fault == "refuse":
        emu._reject.clear()  # noqa: SLF001 - the outage ends
    elif args.fault == "hang":
        emu.set_load_delay(args.hang_s if on else args.load_s, deployment=EU)
    else:
        emu.set_manager_up(not on, EU)


def run(catch_up: bool, args: argparse.Namespace, straggler_wait_s: float | None = None) -> dict[str, Any]:
    from fsdp_hotload.config import HotloadConfig
    from fsdp_hotload.emulator import HotLoadEmulator
    from fsdp_hotload.engine.signal import Signaller
    from fsdp_hotload.arc.dtypes import RawTensor
    from fsdp_hotload.publish import TensorPublisher

    real = Signaller._catch_up
    if not catch_up:
        Signaller._catch_up = lambda self: set()  # type: ignore[method-assign]
    try:
        g = torch.Generator().manual_seed(0)
        model = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(512, 512, generator=g) for i in range(4)}
        stale: list[int] = []
        exact = 0
        with tempfile.TemporaryDirectory() as d, HotLoadEmulator(f"{d}/bucket", replicas=2, api_key="k3y") as emu:
            Path(d, "hf").mkdir()
            Path(d, "hf", "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 512}))
            Path(d, "hf", "tokenizer.json").write_text("{}")
            emu.set_load_delay(args.load_s)
            cfg = HotloadConfig(bucket_url=f"{d}/bucket", hf_config_dir=f"{d}/hf", hotload_api_url=emu.url,
                                account_id="acct", model_id="m", api_key="k3y", deployment_id=["pool-us", "pool-eu"],
                                deployments_required="any", full_every=args.full_every, keep_last=2,
                                poll_interval_s=0.02, ready_timeout_s=args.ready_timeout_s, publish_on_close=False,
                                progress_log_s=None, straggler_wait_s=straggler_wait_s)
            steps: dict[str, int] = {}
            with TensorPublisher(model, cfg) as pub:
                if not catch_up:
                    pub.engine.signaller._timed_out = _Never()  # noqa: SLF001
                for step in range(args.steps):
                    gen = torch.Generator().manual_seed(1000 + step)
                    for t in model.values():  # an RL-like update: ~3% of the values move
                        t.add_((torch.rand(t.shape, generator=gen) < 0.03) * torch.randn(t.shape, generator=gen))
                    want = {k: RawTensor.from_any(v.bfloat16()).digest() for k, v in model.items()}
                    if step in (args.out_from, args.out_to + 1):
                        fault(emu, args, step == args.out_from)
                    pub.publish(step, model)
                    pub.wait()
                    m = pub.metrics[-1]
                    if not m.ok:
                        raise SystemExit(f"step {step} failed: {m.error}")
                    steps[m.identity] = step
                    time.sleep(args.step_s)  # the next training step: a catch-up runs meanwhile
                    reps = emu.state()["deployments"][EU]["replicas"]
                    oldest = min(steps.get(r["identity"], -1) for r in reps)
                    stale.append(step - oldest)
                    exact += oldest == step and all(
                        {k: t["digest"] for k, t in r["tensors"].items()} == want for r in reps)
            loads = len(emu.state()["deployments"][EU]["ledger"])
        ok = [m for m in pub.metrics if m.ok]
        return dict(stale=stale, exact=exact, loads=loads, mb=sum(m.bytes_written for m in ok) / 1e6,
                    fulls=sum(m.kind == "full" for m in ok), total=statistics.median(m.total_s for m in ok),
                    slowest=max(m.total_s for m in ok), ready=sum(m.ready_s for m in ok))
    finally:
        Signaller._catch_up = real  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault", choices=("refuse", "hang", "manager"), default="refuse", help="how pool-eu fails")
    p.add_argument("--steps", type=arg_int(1), default=20, help="trainer steps, each published")
    p.add_argument("--full-every", type=arg_int(1), default=10, help="full_every")
    p.add_argument("--out-from", type=arg_int(0), default=2, help="first step at which pool-eu fails")
    p.add_argument("--out-to", type=arg_int(0), default=4, help="last step at which pool-eu fails")
    p.add_argument("--load-s", type=arg_float(0), default=0.5, help="seconds every load takes in the emulator")
    p.add_argument("--step-s", type=arg_float(0), default=1.0, help="seconds per trainer step after its publish")
    p.add_argument("--hang-s", type=arg_float(0), default=30.0, help="seconds pool-eu's loads take with --fault hang")
    p.add_argument("--ready-timeout-s", type=arg_positive(), default=3.0, help="ready_timeout_s")
    p.add_argument("--straggler-wait-s", type=arg_float(0), default=None,
                   help="a third run, with the catch-up and this straggler_wait_s")
    args = p.parse_args()
    if not 0 <= args.out_from <= args.out_to < args.steps - 1:
        p.error("--out-from <= --out-to < --steps - 1 (the fault ends before the last step)")
    from benchmarks.machine_info import machine

    print(f"machine: {machine()}")
    print(f"pool-eu fault: {args.fault}, steps {args.out_from}-{args.out_to} of {args.steps}")
    print("| catch-up | pool-eu staleness per step | sum | steps behind | served bit-exact | pool-eu loads | "
          "full snapshots | MB written | hook to served, median s | slowest s | readiness waits, sum s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    sums = {}
    runs: list[tuple[str, bool, float | None]] = [("off", False, None), ("on", True, None)]
    if args.straggler_wait_s is not None:
        runs.append((f"on, straggler_wait_s={args.straggler_wait_s:g}", True, args.straggler_wait_s))
    for name, catch_up, straggler in runs:
        r = run(catch_up, args, straggler)
        sums[name] = sum(r["stale"])
        print(f"| {name} | {' '.join(map(str, r['stale']))} | {sums[name]} | "
              f"{sum(1 for s in r['stale'] if s)} | {r['exact']}/{args.steps} | {r['loads']} | {r['fulls']} | "
              f"{r['mb']:.1f} | {r['total']:.3f} | {r['slowest']:.2f} | {r['ready']:.1f} |")
    print(f"ratio pool-eu staleness (sum) with catch-up / without: {sums['on'] / max(sums['off'], 1):.2f}")


if __name__ == "__main__":
    main()
