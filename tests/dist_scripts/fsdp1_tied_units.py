"""torchrun script for tests/test_tied_embeddings.py: FSDP1 with a tied input embedding and ``lm_head``.

In one FSDP unit the two stay one tensor, and a tied config leaves ``lm_head.weight`` out. With the embedding
wrapped in a unit of its own (as a size-based auto-wrap policy does), FSDP1 flattens the tied weight into each
unit's own tensor and the copies train apart: the refusal must say that the FSDP units untied them, on every rank.
A head of its own beside the embedding in one unit (another unit elsewhere) is refused as before, FSDP not blamed.
Results go to --out as JSON (one file per rank).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload.fsdp import full_tensor_specs  # noqa: E402
from tests.dist_util import finish  # noqa: E402


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.proj(self.embed_tokens(ids)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cpu = torch.device("cpu")
    results: dict[str, object] = {}
    one_unit = FSDP(TiedLM(), device_id=cpu)
    results["one_unit"] = [name for name, _shape, _dtype in full_tensor_specs(one_unit, tie_word_embeddings=True)]
    model = TiedLM()
    model.embed_tokens = FSDP(model.embed_tokens, device_id=cpu)
    two_units = FSDP(model, device_id=cpu)
    try:
        full_tensor_specs(two_units, tie_word_embeddings=True)
        results["two_units"] = "accepted"
    except ValueError as exc:
        results["two_units"] = str(exc)
    untied = TiedLM()  # a head of its own, in the embedding's unit, with another unit beside them
    untied.lm_head.weight = nn.Parameter(untied.embed_tokens.weight.detach().clone())
    untied.proj = FSDP(untied.proj, device_id=cpu)
    try:
        full_tensor_specs(FSDP(untied, device_id=cpu), tie_word_embeddings=True)
        results["own_head"] = "accepted"
    except ValueError as exc:
        results["own_head"] = str(exc)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    finish()


if __name__ == "__main__":
    main()
