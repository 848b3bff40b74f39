"""Run under torchrun (gloo, CPU): every rank's chunks reproduce the framework's full state dict bit for bit.

For each wrapping (FSDP2, FSDP2 HSDP and FSDP2 over tensor parallelism on 4 ranks, FSDP1 with use_orig_params
False and True, DDP) of a small model with awkward shapes, every rank checks that:
  (a) the chunks of all ranks, each source cast to the chunk dtype and scattered at its box, rebuild exactly
      the tensors of ``gather_full_state`` (the framework's own full-state-dict path);
  (b) ``assign_chunks`` accepts the union of all ranks' chunks (every element owned exactly once, after
      dropping the copies of a box that several ranks hold, which only FSDP over tensor parallelism makes);
  (c) ``full_tensor_specs`` is identical on all ranks and lists the names the unwrapped model would have;
and that chunk sources are live views: after an in-place update of the parameters, the chunks taken before
it rebuild the new state. Prints "RANK r OK n" at the end; any failure raises (non-zero exit).
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fsdp_hotload.arc.boxes import scatter
from fsdp_hotload.arc.dtypes import RawTensor, itemsize, numel, torch_name
from fsdp_hotload.fsdp import full_tensor_specs, local_chunks, tensor_paths
from fsdp_hotload.fsdp_verify import assign_chunks, gather_full_state, verify_ownership
from tests.dist_util import finish

VOCAB, DIM, HID = 11, 6, 5
CHECKS = 0
IDS = torch.tensor([[1, 2, 3, 10]])
ORDER_WITHIN_MODULE_LOST = "fsdp1"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, HID)  # (5, 6) and (5,): uneven on 2 ranks, an empty shard on 4
        self.lin2 = nn.Linear(HID, DIM, bias=False)
        self.norm = nn.Parameter(torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x))) * self.norm


class Half(nn.Module):
    """A bf16 unit next to fp32 ones."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, 3).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(torch.bfloat16)).float().sum(-1, keepdim=True)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)  # 11 rows: never divisible by 2 or 4
        self.layers = nn.ModuleList([Block(), Block()])
        self.aux = Half()
        self.odd = nn.Parameter(torch.randn(3, 2))  # fewer rows than 4 ranks
        self.one = nn.Parameter(torch.randn(1))  # one element: one rank holds it, the rest are empty
        self.temp = nn.Parameter(torch.tensor(0.75))  # 0-d: FSDP cannot shard it, so it stays replicated
        self.register_buffer("step_count", torch.arange(5, dtype=torch.int64))
        self.register_buffer("rope_cache", torch.randn(4), persistent=False)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.embed_tokens(ids)
        for layer in m.layers:
            h = h + layer(h)
        h = h + m.aux(h) + m.odd.sum() * m.one * m.temp
        return self.lm_head(h)


def build() -> Tiny:
    torch.manual_seed(0)  # identical on every rank, like a real init followed by a broadcast
    return Tiny()


def reference_names() -> list[str]:
    return list(build().state_dict().keys())  # the unwrapped model's names and order


def gather(obj: Any, group: Any = None) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def chunk_bytes(chunks: list) -> list[tuple[str, str, Any, bytes]]:
    out = []
    for c in chunks:
        cast = c.source.to(getattr(torch, torch_name(c.dtype))).contiguous()  # a transposed part's is strided
        out.append((c.name, c.space, c.box, RawTensor.from_any(cast.cpu()).data.tobytes()))
    return out


def rebuild(everything: list[list[tuple[str, str, Any, bytes]]], specs: list) -> dict[str, np.ndarray]:
    spec = {name: (shape, dtype) for name, shape, dtype in specs}
    full = {name: np.zeros(numel(shape) * itemsize(dtype), np.uint8) for name, (shape, dtype) in spec.items()}
    for rank_chunks in everything:
        for name, space, box, data in rank_chunks:
            shape, dtype = spec[name]
            sp = (numel(shape),) if space == "flat" else shape
            scatter(full[name], np.frombuffer(data, dtype=np.uint8), box, sp, itemsize(dtype))
    return full


def expect(cond: bool, what: str) -> None:
    global CHECKS
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")
    CHECKS += 1


def verify(label: str, model: nn.Module, names: list[str] | None, chunks: list | None = None, **kw: Any) -> list:
    """Checks (a), (b), (c) for one model state; ``chunks`` taken earlier must still be live views."""
    if chunks is None:
        chunks = local_chunks(model, **kw)
    specs = full_tensor_specs(model, **kw)
    full = gather_full_state(model, **kw)
    # (c) same specs everywhere, the unwrapped model's names, and the reference agrees on shapes and dtypes
    expect(all(s == specs for s in gather(specs)), f"{label}: specs differ between ranks")
    if names is not None:
        got = [s[0] for s in specs]
        if ORDER_WITHIN_MODULE_LOST in label:  # FSDP1 re-registers what it flattens, after the params it ignores
            got, names = sorted(got), sorted(names)
        expect(got == names, f"{label}: names {got} != {names}")
    expect(list(full) == [s[0] for s in specs], f"{label}: gathered names {list(full)} differ from the specs")
    for name, shape, dtype in specs:
        ref = RawTensor.from_any(full[name])
        expect((ref.shape, ref.dtype) == (shape, dtype), f"{label}: {name}: {ref.dtype}{ref.shape}, not {dtype}{shape}")
    for c in chunks:
        expect(c.source.numel() == c.box.numel > 0  # N-D sources read in C order: a box's shape, or a range's
               and (c.source.dim() == 1 or c.space == "flat" or c.source.shape == c.box.length),
               f"{label}: bad source for {c.name}")
    # (b) every element owned exactly once, one copy of a box several ranks hold (FSDP over part of the ranks)
    kept = [chunks[i] for i in assign_chunks(gather([c.meta() for c in chunks]), specs)[dist.get_rank()]]
    if "tp" not in label:
        expect(len(kept) == len(chunks), f"{label}: {len(chunks) - len(kept)} chunks held twice")
    # (a) the chunks of all ranks rebuild the gathered state bit for bit
    rebuilt = rebuild(gather(chunk_bytes(kept)), specs)
    for name in full:
        same = np.array_equal(rebuilt[name], RawTensor.from_any(full[name]).data)
        expect(same, f"{label}: {name} differs from the gathered state")
    return chunks


def split_rows(path: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]] | None:
    """Parts of uneven rows, as a fused MoE tensor has its experts' parts: ranges that FSDP1's flat shards and
    FSDP2's row shards cut anywhere, and blocks of rows of lin2, whose columns tensor parallelism shards (fsdp+tp);
    each first part transposed. The second layer's lin1 is published regrouped (each row's two halves of columns
    apart: viewed as (5, 2, 3), permuted to (2, 5, 3) and published as (10, 3)), as ranges of it: a rank's rows are
    two ranges. ``shape`` (0, 0) asks for the names only."""
    if path == "model.layers.1.lin1.weight":  # (5, 6) as (5, 2, 3) -> (2, 5, 3), published as (10, 3)
        return [(f"{path}.mixed", 0, (5, 2, 3), (1, 0, 2), (10, 3))]
    rows = {"model.odd": [0, 2, 3], "model.layers.0.lin1.weight": [0, 2, 3, 5],
            "model.layers.0.lin2.weight": [0, 2, 3, 6]}.get(path)
    if rows is None:
        return None
    cols = shape[1]  # the first part is published transposed (a checkpoint storing it so): cut into boxes
    return [(f"{path}.part{i}", a * cols, (b - a, cols), (1, 0) if i == 0 else None)
            for i, (a, b) in enumerate(zip(rows, rows[1:]))]


# Tensors published as blocks of one, joined along dim 0 (``rename`` gives (name, position)), out of module order:
# flat ranges of every layout, boxes of a transposed part (and, under tensor parallelism, of the column-sharded
# lin2) and both in one tensor ("model.mixed": its flat blocks become boxes too).
JOINS = {"model.embed_tokens.weight": ("model.joined.weight", 1),
         "model.layers.0.lin1.weight.part2": ("model.joined.weight", 2),
         "model.layers.0.lin1.weight.part1": ("model.joined.weight", 3),
         "model.layers.0.lin1.weight.part0": ("model.mixed", 0), "model.odd.part1": ("model.mixed", 1),
         "model.layers.1.lin2.weight": ("model.rows", 0), "model.layers.0.lin2.weight.part2": ("model.rows", 1),
         "model.layers.0.lin2.weight.part1": ("model.rows", 2)}


def check_joined(label: str, model: nn.Module, split_names: list[str]) -> None:
    """Joined tensors (JOINS) rebuild the gathered state, which is itself the blocks' own tensors concatenated."""
    names: list[str] = []
    for n in split_names:
        joined = JOINS.get(n, (n, None))[0]
        if joined not in names:
            names.append(joined)
    kw: dict[str, Any] = dict(split=split_rows, tie_word_embeddings=False, rename=lambda n: JOINS.get(n, n))
    chunks = verify(f"{label}/joined", model, names, **kw)
    spaces = {c.name: c.space for c in chunks}
    expect(spaces.get("model.mixed", "shape") == "shape", f"{label}: model.mixed in {spaces.get('model.mixed')}")
    full = gather_full_state(model, **kw)
    parts = gather_full_state(model, split=split_rows, tie_word_embeddings=False)
    for joined in ("model.joined.weight", "model.mixed", "model.rows"):
        blocks = sorted((pos, n) for n, (j, pos) in JOINS.items() if j == joined)
        want = torch.cat([parts[n] for _pos, n in blocks])
        expect(torch.equal(full[joined], want), f"{label}: {joined} is not its blocks concatenated in order")
    expect(tuple(full["model.joined.weight"].shape) == (VOCAB + 2 + 1, DIM), f"{label}: joined shape")


def bump(model: nn.Module) -> None:
    """An in-place update of every parameter's local data, the way an optimizer step writes it."""
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.5)


def check_all(label: str, model: nn.Module, *, dtypes: dict[str, torch.dtype], unsharded_root: bool = False,
              forward: bool = True) -> None:
    names = reference_names()
    untied = [n for n in names if n != "lm_head.weight"]
    chunks = verify(f"{label}/tie=False", model, names, tie_word_embeddings=False)
    # the paths the adapter warning reads: every tensor's, also where FSDP1 lists only its flat parameter
    expect(sorted(tensor_paths(model)) == sorted(names), f"{label}: tensor paths {sorted(tensor_paths(model))}")
    verify(f"{label}/tie=None", model, untied)  # the config does not say: lm_head is the embedding's tensor
    for c in chunks:  # sources keep the framework's dtype (fp32 masters stay fp32; the engine casts)
        expect(c.source.dtype == dtypes[c.name], f"{label}: source of {c.name} is {c.source.dtype}")
        expect(c.dtype == ("I64" if c.name.endswith("step_count") else "BF16"), f"{label}: dtype of {c.name}")
    verify(f"{label}/tie=True", model, untied, tie_word_embeddings=True)
    no_buffers = [n for n in untied if "step_count" not in n]
    verify(f"{label}/F32-no-buffers", model, no_buffers, snapshot_dtype="F32", include_buffers=False)
    def rename(n: str) -> str | None:
        return None if n == "model.one" else n.replace("model.", "transformer.", 1)

    renamed = [rename(n) for n in untied if rename(n) is not None]
    verify(f"{label}/rename", model, renamed, rename=rename, tie_word_embeddings=True)
    split_names = [part[0] for n in names for part in (split_rows(n, (0, 0)) or [(n,)])]
    split = verify(f"{label}/split", model, split_names, split=split_rows, tie_word_embeddings=False)
    if "tp" in label:  # lin2 is row-wise parallel: its TP shards are column blocks, cut to each part's rows above
        held = [(c.space, c.box.length[0 if c.name.endswith("part0") else -1])  # its columns (part0: transposed)
                for c in split if c.name.startswith("model.layers.0.lin2.weight.part")]
        expect(held and all(h == ("shape", 3 - dist.get_rank() % 2) for h in held), f"{label}: lin2 parts {held}")
        for parts in ([(".a", 0, (15,)), (".b", 15, (15,))],  # rows 0-2, but not in their (3, 5) layout
                      [(".a", 0, (7,)), (".b", 7, (23,))]):  # not whole rows
            try:
                local_chunks(model, split=lambda p, shape, parts=parts: [(p + n, a, s) for n, a, s in parts]
                             if p == "model.layers.0.lin2.weight" else None)
                expect(False, f"{label}: the split {parts} of a column-sharded tensor was accepted")
            except NotImplementedError as exc:
                expect("must each be a slab" in str(exc) and "lin2" in str(exc), f"{label}: {exc}")
    check_joined(label, model, split_names)
    verify_ownership(model)
    before = {k: RawTensor.from_any(v).data.copy() for k, v in gather_full_state(model).items()}
    bump(model)
    # chunks taken before the update
    verify(f"{label}/live-views", model, names, chunks=chunks, tie_word_embeddings=False)
    after = gather_full_state(model)
    changed = not np.array_equal(before["model.odd"], RawTensor.from_any(after["model.odd"]).data)
    expect(changed, f"{label}: the update had no effect")
    if not forward:  # Tiny's forward is not written for tensor parallelism
        return
    # The first forward runs the framework's lazy init (FSDP1 sets up its local shard then); chunks taken
    # before it must still be views of the live data after it.
    model(IDS)
    if unsharded_root:  # FSDP2 with reshard_after_forward=False: the walk must look past the swapped-in tensors
        expect(not hasattr(model.lm_head.weight, "to_local"), f"{label}: root stayed sharded after forward")
    fresh = local_chunks(model, tie_word_embeddings=False)  # taken now, before gather_full_state reshards the root
    layout = [(c.name, c.space, c.box, c.source.data_ptr()) for c in chunks]
    expect([(c.name, c.space, c.box, c.source.data_ptr()) for c in fresh] == layout,
           f"{label}: chunks taken after forward differ from those taken before (not the same shards)")
    verify(f"{label}/after-forward", model, names, chunks=chunks, tie_word_embeddings=False)
    verify(f"{label}/after-forward-fresh", model, names, chunks=fresh, tie_word_embeddings=False)
    # A backward pass reshards everything (and reduce-scatters gradients); an update then writes the shards.
    model(IDS).float().pow(2).mean().backward()
    bump(model)
    verify(f"{label}/after-backward-update", model, names, chunks=chunks, tie_word_embeddings=False)


def train_and_publish(model: nn.Module, cb: Any, steps: int) -> None:
    """``steps`` steps that change every parameter, each published (or skipped) and waited for."""
    for step in range(steps):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
        cb.step(step)
        cb.wait()


def fsdp2(world: int, hsdp: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build()
    if hsdp:  # replicate over mesh dim 0, shard over mesh dim 1
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.model.aux, mesh=mesh)
    # Keep the root unsharded after forward, so the walk must look past the plain tensors FSDP2 swaps in.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params={model.model.temp})
    return model


def fsdp_tp(world: int) -> nn.Module:
    """FSDP2 over tensor parallelism, torchtitan's layout: TP first (lin1 column-wise: its rows, 5 over 2 ranks;
    lin2 row-wise: its columns), then ``fully_shard`` over the data-parallel mesh dim, which shards lin1's TP shard
    again on the same dim (``_StridedShard``): 3 rows split 2 + 1, 2 rows split 1 + 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], {"lin1": ColwiseParallel(), "lin2": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model.model.aux, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"], ignored_params={model.model.temp})
    strided = [p.placements for p in model.model.layers[0].lin1.parameters()]
    expect(all(type(pl[0]).__name__ == "_StridedShard" for pl in strided), f"fsdp+tp: placements {strided}")
    return model


def fsdp1(use_orig_params: bool, checkpointing: bool) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    model = build()
    cpu = torch.device("cpu")
    wrap = functools.partial(FSDP, device_id=cpu, use_orig_params=use_orig_params)
    layers = model.model.layers
    if checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        layers[0] = checkpoint_wrapper(layers[0])
    for i in range(len(layers)):
        layers[i] = wrap(layers[i])
    # NO_SHARD: every rank holds the whole unit; only rank 0 may publish it.
    model.model.aux = wrap(model.model.aux, sharding_strategy=ShardingStrategy.NO_SHARD)
    return wrap(model, ignored_states=[model.model.temp])


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtypes = {k: v.dtype for k, v in build().state_dict().items()}
    dtypes.update({k.replace("model.", "transformer.", 1): v for k, v in dtypes.items()})

    model = fsdp2(world, hsdp=False)
    check_all("fsdp2", model, dtypes=dtypes, unsharded_root=True)
    if world % 2 == 0 and world >= 4:
        check_all("hsdp", fsdp2(world, hsdp=True), dtypes=dtypes, unsharded_root=True)
        check_all("fsdp+tp", fsdp_tp(world), dtypes=dtypes, forward=False)
    check_all("fsdp1/orig=False", fsdp1(False, checkpointing=False), dtypes=dtypes)
    check_all("fsdp1/orig=True+ckpt", fsdp1(True, checkpointing=True), dtypes=dtypes)
    # DDP: every rank holds every tensor whole (rank 0 publishes them); its ``module.`` is not in the names
    check_all("ddp", nn.parallel.DistributedDataParallel(build()), dtypes=dtypes)
    check_all("ddp+compile", torch.compile(nn.parallel.DistributedDataParallel(build())), dtypes=dtypes, forward=False)
    dist.barrier()
    print(f"RANK {rank} OK {CHECKS}", flush=True)
    finish()


if __name__ == "__main__":
    main()
