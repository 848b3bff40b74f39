"""Copies that agree when ``HotloadCallback`` is created and drift apart once training starts: the ranks compare
them again at each step until they have changed, then once per full snapshot's span (``full_every=2`` here where
that is tested), and publishing stops on every rank where they differ. Run under
torchrun (gloo, CPU, 2 ranks). Each rank's loss is scaled by its rank, so what nothing syncs drifts at the first
optimizer step that changes it. Cases:

* ``seeded``: each rank's own experts under one name, initialised from one seed (FSDP2 over a size-1 mesh dim
  leaves them whole on each rank): alike at construction, so the first comparison passed them as copies.
* ``unsynced``: a module left out of ``fully_shard`` (only the first layer is wrapped): a plain parameter whose
  gradients no rank shares.
* ``before``: as ``seeded``, with a first ``step(0)`` before any optimizer step (publishing the initial weights):
  the second comparison finds them.
* ``keep``: as ``unsynced`` with ``keep_training_on_error``: nothing raises, publishing stops, training goes on.
* ``skip_keep``, ``attach_keep`` and ``catch``: the same under ``busy_policy="skip"`` (the default), from
  ``step()`` or ``attach()``, and with a loop that catches the error and goes on: the skip policy's agreement,
  taken before the stop, let the stopped step (or the next one) be published.
* ``warmup``: as ``unsynced``, with a first ``step(0)`` before training and a first optimizer step at a learning
  rate of 0: the first two comparisons see the values of construction, and the third finds the drift.
* ``ddp`` and ``hsdp``: copies that DistributedDataParallel and FSDP2's replicate mesh dim keep equal pass, with
  every step published; DDP's are compared until they have changed (the first optimizer step changes them all),
  and then at every second call (eight steps, ``full_every=2``), still agreeing.
* ``decay``: a head left out of ``fully_shard`` whose first gradient is zero: AdamW's weight decay changes it
  alike on every rank at the first step, and it drifts from the second on (one change proved nothing).
* ``sparse``: an embedding left out of ``fully_shard`` whose trained rows are none of the sampled ones: the sum
  of all its bits tells the ranks apart.
* ``frozen``: as ``unsynced`` with the left-out module frozen: it stays equal, so it is not compared, and the
  comparisons end at the first step instead of going on while it stays unchanged.
* ``fsdp``: FSDP2 over both ranks holds no copy: nothing is compared, no collective runs.
* ``unfrozen``: as ``frozen``, unfrozen before the third step (``full_every=2``): the first phase ended at the
  first call, and the comparison two calls later finds the drift.
* ``late``: a head left out of ``fully_shard`` that gets no gradient for eight steps, so it is unchanged through the
  whole first phase, and drifts from the ninth step (``full_every=2``): found at the tenth.

Each rank writes per case what ``step()`` raised (or None), the steps published, the comparisons planned at
construction, those left at the end, those made, and why publishing stopped, to --out/rank<r>.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_util import finish, start_rank  # noqa: E402


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank alike: its own experts, seeded from one seed
        self.experts = nn.Parameter(torch.randn(2, 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.experts).sum(0)


def seeded(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = Experts()
    fully_shard(model, mesh=mesh["edp"])
    return model


def unsynced(_mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])  # the second layer is left out: a plain parameter that nothing syncs
    return model


class Headed(nn.Module):
    """A body FSDP2 shards and a head left out of it: plain, and nothing syncs it."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 4), head
        fully_shard(self.body)
        self.head_weight = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.head, nn.Embedding):  # rows 1-8 only: the sampled rows are 0, 9, 18, ..., 63
            return self.body(x).sum() + self.head(torch.arange(1, 9)).sum()
        return self.body(x).sum() + self.head_weight * self.head(x).sum()


def frozen(mesh: Any) -> nn.Module:
    model = unsynced(mesh)
    model[1].requires_grad_(False)  # plain, and no optimizer step changes it
    return model


def ddp(_mesh: Any) -> nn.Module:
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))


def hsdp(_mesh: Any) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    return model


def fsdp(_mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model)
    return model


def run(case: str, model: nn.Module, bucket: str, rank: int) -> dict[str, Any]:
    """Four optimizer steps (five calls where a first ``step(0)`` comes before any; ``ddp`` eight and ``late``
    ten), scaled per rank."""
    keep, catch = case in ("keep", "skip_keep", "attach_keep"), case == "catch"
    before = case in ("before", "warmup")
    config = HotloadConfig(bucket_url=f"{bucket}/{case}", keep_training_on_error=keep,
                           full_every=2 if case in ("ddp", "unfrozen", "late") else 20,
                           busy_policy="skip" if case in ("skip_keep", "attach_keep", "catch") else "wait")
    opt = (torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01) if case == "decay"
           else torch.optim.SGD(model.parameters(), lr=0.1))
    hot = HotloadCallback(model, config)
    found: dict[str, Any] = {"planned": hot._recheck.left, "raised": None, "raised_at": None}
    if case == "attach_keep":
        hot.attach(opt)
    if before:
        hot.step(0)
    for step in range(int(before), int(before) + {"ddp": 8, "late": 10}.get(case, 4)):
        for group in opt.param_groups:  # warmup: the first optimizer step changes nothing
            group["lr"] = 0.0 if case == "warmup" and step == 1 else 0.1
        if case == "decay":  # the head's first gradient is zero: weight decay alone changes it, alike
            model.head_weight = 0.0 if step == 0 else 1.0
        if case == "late":  # no gradient through the first phase; SGD without decay leaves it as it was
            model.head_weight = 0.0 if step < 8 else 1.0
        if case == "unfrozen" and step == 2:
            model[1].requires_grad_(True)
        x = torch.ones(3, 4) * (1 - 2 * rank if case == "decay" else 1)  # Adam's updates ignore a loss scale
        loss = model(x).sum() * (rank + 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        try:
            if case != "attach_keep":
                hot.step(step)
        except Exception as exc:  # noqa: BLE001 - written for the test to read
            found["raised"], found["raised_at"] = f"{type(exc).__name__}: {exc}", step
            if not catch:  # a loop that catches it goes on training
                break
    found["stopped"] = hot.engine.stopped
    found["left"], found["active"], found["made"] = hot._recheck.left, hot._recheck.active, hot._recheck.made
    hot.close(raise_errors=False)
    # a closed callback its owner still holds keeps none of the model's tensors for the comparisons
    found["held_after_close"] = hot._recheck.active or bool(hot._recheck._all_plain or hot._recheck._shared)
    found["published"] = [m.step for m in hot.metrics]
    return found


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    bucket, out, rank = start_rank()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "edp"))
    found = {}
    for case, build in (("seeded", seeded), ("unsynced", unsynced), ("before", seeded), ("keep", unsynced),
                        ("skip_keep", unsynced), ("attach_keep", unsynced), ("catch", unsynced), ("warmup", unsynced),
                        ("decay", lambda _m: Headed(nn.Linear(4, 4))),
                        ("sparse", lambda _m: Headed(nn.Embedding(64, 4))),
                        ("frozen", frozen), ("ddp", ddp), ("hsdp", hsdp), ("fsdp", fsdp), ("unfrozen", frozen),
                        ("late", lambda _m: Headed(nn.Linear(4, 4)))):
        found[case] = run(case, build(mesh), bucket, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(found))
    torch.distributed.barrier()
    finish()


if __name__ == "__main__":
    main()
