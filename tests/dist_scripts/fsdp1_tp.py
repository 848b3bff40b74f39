"""Run under torchrun (gloo, CPU, 2 ranks): FSDP1 over tensor parallelism (``FSDP(device_mesh=...)`` around a
``parallelize_module`` model) is refused on every rank, naming the tensor, rather than published as each TP rank's
local block: FSDP1 flattens a DTensor's local tensor, so its flat metadata describes the TP shard, not the tensor.
Cases: use_orig_params True and False with even blocks (every TP rank's block has the same shape, so nothing else
would notice), and uneven blocks. Prints "RANK r OK" when every walk raised as expected."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload.fsdp import full_tensor_specs, local_chunks  # noqa: E402
from fsdp_hotload.fsdp_verify import verify_ownership  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    for orig, rows in ((True, 6), (False, 6), (True, 5)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, rows), nn.Linear(rows, 3))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
        model = FSDP(model, device_mesh=mesh["dp"], use_orig_params=orig, device_id=torch.device("cpu"))
        for what, call in (("local_chunks", lambda: local_chunks(model)),
                           ("specs", lambda: full_tensor_specs(model)), ("verify", lambda: verify_ownership(model))):
            try:
                call()
            except NotImplementedError as exc:
                assert "'0.weight'" in str(exc) and "tensor parallel" in str(exc), f"{what}: {exc}"
            else:
                raise AssertionError(f"rank {dist.get_rank()}: {what} accepted FSDP1 over tensor parallelism "
                                     f"(use_orig_params={orig}, {rows} rows)")
    dist.barrier()
    print(f"RANK {dist.get_rank()} OK", flush=True)
    finish()


if __name__ == "__main__":
    main()
