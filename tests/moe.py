"""A sparse MoE layer as transformers 5 builds it, for tests that publish fused experts."""
from __future__ import annotations

import torch
from torch import nn


def fused_moe_layer(experts: int, hidden: int, inter: int) -> nn.Module:
    """``layer.mlp``: a router (``gate``) and each projection of all experts fused into one 3-D parameter
    (``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I)), while checkpoints name each expert."""
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.gate = nn.Linear(hidden, experts, bias=False)
    layer.mlp.experts = nn.Module()
    layer.mlp.experts.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden))
    layer.mlp.experts.down_proj = nn.Parameter(torch.randn(experts, hidden, inter))
    return layer
