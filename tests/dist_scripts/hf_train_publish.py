"""Tiny Hugging Face causal LMs, built from their configs, trained under FSDP2 and published every step.

For each ``--case`` folder (holding ``hf/``: config.json, generation config, tokenizer) every rank builds the same
random model from the config (no download), wraps each decoder layer and then the root with ``fully_shard`` (the
fused experts along the dims ``<case>/fsdp.json`` gives, where there is one), trains
a few AdamW steps (fp32 masters) and publishes every step through ``HotloadCallback`` into ``<case>/bucket``,
without signalling (Mixtral with the README's ``split`` and ``rename``, Qwen3-MoE and HRM-Text, whose checkpoints
join the projections its model keeps apart, with the names derived from transformers, ``hf_names``). After each
publish rank 0 saves the framework's own gathered full state dict (``get_model_state_dict``) as ``save_pretrained`` would write it (its
``revert_weight_conversion``: fused experts split per expert), cast to bf16, as
``<case>/out/expected-<identity>.safetensors`` (a tied weight under every name the model registers it by), and at
the end the publish records as ``<case>/out/metrics.json``. The test then loads the snapshots with transformers'
loader and compares. Several cases share one job, so torchrun and the imports are paid once.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fsdp_hotload import HotloadCallback, HotloadConfig, split_fused_experts  # noqa: E402
from tests.dist_util import finish  # noqa: E402


def mixtral_names(name: str) -> str:
    """Mixtral's checkpoint names for what split_fused_experts gives (the README's recipe)."""
    name = name.replace(".mlp.", ".block_sparse_moe.")
    return re.sub(r"(experts\.\d+)\.(gate|up|down)_proj", lambda m: f"{m[1]}.w{W[m[2]]}", name)


W = {"gate": 1, "up": 3, "down": 2}


def expert_placement(model: torch.nn.Module, spec: Path) -> Callable[[torch.nn.Parameter], Shard | None] | None:
    """``shard_placement_fn`` from ``spec`` (``{"gate_up_proj": 2, ...}``: the dim FSDP shards each fused expert
    tensor of that name along, as torchtitan shards experts when there are fewer of them than ranks), if present."""
    if not spec.exists():
        return None
    dims = json.loads(spec.read_text())
    names = {id(p): n.rsplit(".", 1)[-1] for n, p in model.named_parameters()}
    return lambda p: Shard(dims[names[id(p)]]) if names.get(id(p)) in dims else None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every ``layers`` list's modules (``model.layers``; HRM-Text's ``L_module.layers`` and ``H_module.layers``)."""
    return [layer for name, mod in model.named_modules() if name.rsplit(".", 1)[-1] == "layers"
            and isinstance(mod, torch.nn.ModuleList) for layer in mod]


def run_case(case: Path, steps: int, full_every: int) -> None:
    """Train and publish one model; rank 0 writes the expected states and the publish records."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    rank = dist.get_rank()
    hf_dir, out = case / "hf", case / "out"
    torch.manual_seed(0)  # every rank builds the same weights
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    place = expert_placement(model, case / "fsdp.json")
    for layer in decoder_layers(model):
        fully_shard(layer, shard_placement_fn=place)
    fully_shard(model)
    if place is not None:  # the layout asked for is the layout FSDP made
        dims = json.loads((case / "fsdp.json").read_text())
        placed = {n: p.placements for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in dims}
        assert placed and all(pl == (Shard(dims[n.rsplit(".", 1)[-1]]),) for n, pl in placed.items()), placed
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = HotloadConfig(bucket_url=str(case / "bucket"), hf_config_dir=str(hf_dir), full_every=full_every,
                        busy_policy="wait")
    gen = torch.Generator().manual_seed(1 + rank)
    # Mixtral with the README's split and rename; Qwen3-MoE with neither: hf_names derives them from transformers
    explicit = dict(split=split_fused_experts, rename=mixtral_names) if config.model_type == "mixtral" else {}
    with HotloadCallback(model, cfg, **explicit) as hot:
        for step in range(steps):
            ids = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            hot.step(step)
            hot.wait()
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            full = revert_weight_conversion(model, full)  # what save_pretrained writes: the checkpoint's names
            if rank == 0:
                m = hot.metrics[-1]
                # safetensors refuses tensors that share memory: every name gets its own copy
                save_file({k: v.to(torch.bfloat16).clone().contiguous() for k, v in full.items()},
                          str(out / f"expected-{m.identity}.safetensors"))
        records = [{"step": m.step, "identity": m.identity, "kind": m.kind, "ok": m.ok} for m in hot.metrics]
    if rank == 0:
        (out / "metrics.json").write_text(json.dumps(records, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", action="append", required=True, help="folder with hf/, bucket/ and out/")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--full-every", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    for case in args.case:
        run_case(Path(case), args.steps, args.full_every)
        dist.barrier()
    finish()


if __name__ == "__main__":
    main()
