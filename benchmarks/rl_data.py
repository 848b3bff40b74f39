"""Seeded generators of consecutive RL-like bf16 weight snapshots, for codec benchmarks and tests.

Why synthetic: what a delta codec sees is decided by three things only — the scale of the weights (which sets the
bf16 ulp of each element), the size of one optimizer step (RL fine-tuning uses AdamW at lr ~1e-6) and the
rounding of fp32 master weights to bf16 after each step. Both generators below reproduce exactly that path with
torch's own AdamW on CPU, so the changed fraction and the shape of the changes (mostly +-1 ulp, more changes
on small-magnitude weights) are those of a real trainer, without downloads.

* :func:`rl_snapshots` — a few transformer-shaped matrices (init std 0.02, norm gains at 1.0), noisy gradients
  with a weak persistent signal (RL gradients are mostly noise), any total size.
* :func:`tiny_gpt_snapshots` — a small GPT-style model built here from scratch, pretrained briefly on synthetic
  token data at a normal lr, then "fine-tuned" at an RL lr; weights are therefore trained, not just random.

Both yield ``steps + 1`` dicts of CPU bf16 tensors: the starting state, then the state after each optimizer step.

Example::

    snaps = list(rl_snapshots(total_params=1 << 20, steps=3, lr=1e-6, seed=0))
    prev, cur = snaps[0]["layers.0.mlp.up.weight"], snaps[1]["layers.0.mlp.up.weight"]
    frac = (prev.view(torch.int16) != cur.view(torch.int16)).float().mean().item()   # ~0.01-0.05
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn


def _matrix_shapes(total_params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Shapes of one or more transformer blocks (qkv, out, mlp up/down, norm gains) summing to ~total_params.

    A block of width d holds 12·d² + 2·d parameters; pick the width so that ``blocks`` blocks fit, keeping d a
    multiple of 16 like real models. Small totals give one small block (tests use a few 10k parameters).
    """
    if total_params < 12 * 16 * 16:
        raise ValueError(f"total_params={total_params} is too small (need at least {12 * 16 * 16})")
    blocks = 1 if total_params < (48 << 20) else 2
    d = max(16, int(math.sqrt(total_params / (12 * blocks))) // 16 * 16)
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for b in range(blocks):
        p = f"layers.{b}"
        shapes += [
            (f"{p}.input_norm.weight", (d,)),
            (f"{p}.attn.qkv.weight", (3 * d, d)),
            (f"{p}.attn.out.weight", (d, d)),
            (f"{p}.post_norm.weight", (d,)),
            (f"{p}.mlp.up.weight", (4 * d, d)),
            (f"{p}.mlp.down.weight", (d, 4 * d)),
        ]
    return shapes


def rl_snapshots(
    *,
    total_params: int,
    steps: int,
    lr: float,
    seed: int,
    weight_decay: float = 0.01,
    signal: float = 0.3,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``steps + 1`` bf16 snapshots of transformer-shaped weights trained by AdamW on noisy gradients.

    Master weights are fp32 (matrices ~ N(0, 0.02²), norm gains 1.0); each step's gradient per element is
    ``g_scale_row · (signal · s + noise)`` with a fixed random direction ``s`` and fresh Gaussian ``noise``
    (a low signal-to-noise ratio, as in policy-gradient updates), and per-row gradient scales that vary by ~10×
    (some rows see more tokens than others). AdamW uses betas (0.9, 0.999), eps 1e-8. After every step the
    master weights are rounded to bf16 (round-to-nearest-even, as ``Tensor.to`` does) and yielded as new tensors.
    """
    if steps < 0:
        raise ValueError("steps must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    params: list[nn.Parameter] = []
    names: list[str] = []
    directions: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    for name, shape in _matrix_shapes(total_params):
        if len(shape) == 1:
            w = torch.ones(shape)
        else:
            w = torch.randn(shape, generator=gen) * 0.02
        params.append(nn.Parameter(w))
        names.append(name)
        directions.append(torch.randn(shape, generator=gen))
        row_scale = torch.exp(torch.randn((shape[0],) + (1,) * (len(shape) - 1), generator=gen) * 0.8)
        scales.append(row_scale * 1e-3)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in zip(names, params)}

    yield snapshot()
    for _ in range(steps):
        for p, s, sc in zip(params, directions, scales):
            noise = torch.randn(p.shape, generator=gen)
            p.grad = (noise.add_(s, alpha=signal)).mul_(sc)
        opt.step()
        yield snapshot()


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """A small GPT-style language model (token + position embeddings, pre-norm blocks, tied output head).

    Example::

        model = TinyGPT(vocab=256, d=64, layers=2, heads=4, context=32)
        logits = model(torch.zeros(1, 32, dtype=torch.long))   # (1, 32, 256)
    """

    def __init__(self, *, vocab: int, d: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.tok.weight.T


def _markov_tokens(gen: torch.Generator, vocab: int, batch: int, length: int, table: torch.Tensor) -> torch.Tensor:
    """Sample token sequences from a sparse random first-order Markov chain (learnable structure, no downloads)."""
    out = torch.empty(batch, length, dtype=torch.long)
    cur = torch.randint(vocab, (batch,), generator=gen)
    for t in range(length):
        out[:, t] = cur
        cur = torch.multinomial(table[cur], 1, generator=gen).squeeze(1)
    return out


def tiny_gpt_snapshots(
    *,
    steps: int,
    lr: float,
    seed: int,
    vocab: int = 1024,
    d: int = 128,
    layers: int = 2,
    heads: int = 4,
    context: int = 64,
    batch: int = 8,
    pretrain_steps: int = 30,
    pretrain_lr: float = 1e-3,
    weight_decay: float = 0.01,
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield ``steps + 1`` bf16 snapshots of a tiny GPT fine-tuned at an RL learning rate.

    The model is first trained ``pretrain_steps`` steps at ``pretrain_lr`` (so weights and AdamW moments are
    those of a trained model, not of an initialisation), then the lr drops to ``lr`` and a snapshot is taken
    before and after each of ``steps`` further steps. fp32 master weights, bf16 snapshots, betas (0.9, 0.999).
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, context=context)
    # Each token has 8 likely successors: enough structure that the loss falls during pretraining.
    succ = torch.randint(vocab, (vocab, 8), generator=gen)
    table = torch.full((vocab, vocab), 1e-3)
    table.scatter_(1, succ, 1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=pretrain_lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=weight_decay)

    def step() -> None:
        tokens = _markov_tokens(gen, vocab, batch, context + 1, table)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}

    for _ in range(pretrain_steps):
        step()
    for group in opt.param_groups:
        group["lr"] = lr
    yield snapshot()
    for _ in range(steps):
        step()
        yield snapshot()


def changed_fraction(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> float:
    """Fraction of elements whose bf16 bits differ between two snapshots (all tensors together)."""
    changed = total = 0
    for name, a in prev.items():
        b = cur[name]
        changed += int((a.view(torch.int16) != b.view(torch.int16)).sum())
        total += a.numel()
    return changed / max(total, 1)
