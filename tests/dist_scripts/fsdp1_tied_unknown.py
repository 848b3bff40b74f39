"""torchrun script for tests/test_tied_embeddings.py: FSDP1 units that untie an embedding, with tying unknown.

A model whose ``lm_head`` is its input embedding's weight, with the embedding wrapped in an FSDP1 unit of its own,
holds two tensors once wrapped, which train apart. With no config.json and no ``tie_word_embeddings=``, the model
decides, so ``lm_head.weight`` is published; rank 0 must warn about it once, at start. Said as False, or kept in one
unit (tied, left out), or untied by the model's own config, nothing is said. Each case's ``HotloadCallback`` logs to stderr with the rank in front, and a
``CASE <name> done`` line follows it; what each published goes to --out as JSON (one file per rank).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig  # noqa: E402
from tests.dist_scripts.fsdp1_tied_units import TiedLM  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(message)s", stream=sys.stderr)
    case_log = logging.getLogger("case")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    cpu = torch.device("cpu")

    def two_units() -> torch.nn.Module:
        model = TiedLM()
        model.embed_tokens = FSDP(model.embed_tokens, device_id=cpu)
        return FSDP(model, device_id=cpu)

    def two_units_config_untied() -> torch.nn.Module:
        model = TiedLM()
        model.lm_head.weight = torch.nn.Parameter(model.embed_tokens.weight.detach().clone())
        # as a transformers model carries it: its own config says the head is not tied
        model.config = SimpleNamespace(tie_word_embeddings=False)
        model.embed_tokens = FSDP(model.embed_tokens, device_id=cpu)
        return FSDP(model, device_id=cpu)

    cases = {"two_units": (two_units, None), "two_units_false": (two_units, False),
             "two_units_config_untied": (two_units_config_untied, None),
             "one_unit": (lambda: FSDP(TiedLM(), device_id=cpu), None)}
    results: dict[str, list[str]] = {}
    for name, (build, tie) in cases.items():
        cfg = HotloadConfig(bucket_url=f"{args.bucket}/{name}", full_every=1)
        cb = HotloadCallback(build(), cfg, tie_word_embeddings=tie)
        results[name] = [spec[0] for spec in cb._specs]
        cb.close()
        case_log.warning("CASE %s done", name)
        dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
    finish()


if __name__ == "__main__":
    main()
