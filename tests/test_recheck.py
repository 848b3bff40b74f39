"""The ranks' comparisons of their copies once training has started (``fsdp_recheck.RecheckReplicas``), with four
ranks as threads of one process meeting over a real in-process comm (``tests.thread_comm``): one max-reduction per
comparison, and a second round that names the ranks only where something differs. The torchrun cases (what a
callback does with the verdict, over real gloo groups) are in test_fsdp_chunks.py."""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.fsdp import LocalChunk, storage_fingerprint
from fsdp_hotload.fsdp_recheck import RecheckReplicas
from fsdp_hotload.fsdp_verify import WHOLE_ELEMENTS, Agreed
from tests.thread_comm import Meeting, ThreadComm, run_ranks

WORLD = 4


def plain_model() -> nn.Module:
    torch.manual_seed(0)  # every rank alike
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def build(rank: int, model: nn.Module, comm: ThreadComm, every: int = 5,
          chunks: list[LocalChunk] | None = None, shared: list[tuple[int, int]] | None = None,
          groups: list[tuple[str, Box]] | None = None) -> RecheckReplicas:
    plain = dict(model.named_parameters())
    agreed = Agreed([], shared or [], True, (groups or []) if rank == 0 else [], len(groups or []))
    return RecheckReplicas(agreed, chunks or [], plain, storage_fingerprint(model), comm, every=every)


def run_all(target: Any) -> dict[int, Any]:
    out: dict[int, Any] = {}
    run_ranks(lambda r: out.__setitem__(r, target(r)), WORLD)
    return out


def test_a_copy_that_drifts_on_one_rank_of_four_is_named_with_that_rank_on_every_rank() -> None:
    """Every rank agrees at the first comparison; then rank 2 alone changes one element of '1.weight' and
    '0.bias': every rank learns which tensor (the first path, and how many more) and which two ranks differ, and
    stops comparing."""
    meeting = Meeting(WORLD)
    models = [plain_model() for _ in range(WORLD)]
    rechecks = run_all(lambda r: build(r, models[r], ThreadComm(meeting, r, WORLD)))  # collective

    def ranks(r: int) -> tuple[Any, ...]:
        first = rechecks[r].run(models[r], {}, step=0)
        if r == 2:
            with torch.no_grad():
                models[r][1].weight[1, 3] += 1.0
                models[r][0].bias[0] += 1.0
        second = rechecks[r].run(models[r], {}, step=1)
        return first, second, rechecks[r].active, rechecks[r].made

    out = run_all(ranks)
    for r in range(WORLD):
        first, second, active, made = out[r]
        assert first is None and made == 2 and not active, out[r]
        assert second.startswith("ranks 0 and 2 held plain tensor '0.bias' and 1 more"), second
        assert "different values at step 1" in second, second


def test_a_group_rank_0_does_not_hold_is_named_from_rank_0s_list() -> None:
    """A box that ranks 1 and 3 hold alike at construction (group 0) and rank 3 changes: rank 0, which holds no
    copy of it, names it from the groups it numbered, with the ranks that differ."""
    meeting = Meeting(WORLD)
    models = [nn.Module() for _ in range(WORLD)]  # no plain tensor: only the box is compared
    sources = [torch.arange(6, dtype=torch.float32) for _ in range(WORLD)]
    box = Box((0,), (6,))

    def construct(r: int) -> RecheckReplicas:
        held = r in (1, 3)
        chunks = [LocalChunk("w", (12,), "F32", "flat", box, sources[r])] if held else []
        return build(r, models[r], ThreadComm(meeting, r, WORLD), chunks=chunks, shared=[(0, 0)] if held else [],
                     groups=[("w", box)])

    rechecks = run_all(construct)

    def ranks(r: int) -> tuple[Any, ...]:
        first = rechecks[r].run(models[r], {}, step=3)
        if r == 3:
            sources[r][5] = 7.0
        return first, rechecks[r].run(models[r], {}, step=4)

    out = run_all(ranks)
    for r in range(WORLD):
        first, second = out[r]
        assert first is None, out[r]
        assert second.startswith("ranks 1 and 3 held the same part of tensor 'w' ({'start': [0], 'length': [6]})"), \
            second


def test_copies_that_change_alike_settle_and_are_then_compared_once_per_span(caplog: pytest.LogCaptureFixture) -> None:
    """Every rank changes every tensor alike at each call: after the first comparison and three changes the first
    phase ends on every rank (decided alike from the reduced digests, with no broadcast), and the next comparison is
    ``every`` calls later. A parameter frozen on rank 1 alone is left out there, and still compared among the
    others. Then rank 1 cannot read its copies: every rank logs it, names rank 1, and stops comparing."""
    meeting = Meeting(WORLD)
    models = [plain_model() for _ in range(WORLD)]
    models[1][1].bias.requires_grad_(False)
    rechecks = run_all(lambda r: build(r, models[r], ThreadComm(meeting, r, WORLD), every=3))

    def ranks(r: int) -> tuple[Any, ...]:
        trail = []
        for step in range(8):
            with torch.no_grad():
                for p in models[r].parameters():
                    p.add_(0.5)
            if rechecks[r].due():
                assert rechecks[r].run(models[r], {}, step) is None
            trail.append((rechecks[r].made, rechecks[r].left))
        if r == 1:  # its storage changed: read again from a walk, which fails here (a bad keyword)
            models[r][0].weight.data = models[r][0].weight.data.clone()
        kwargs = {"no_such_option": True}
        assert rechecks[r].run(models[r], kwargs, 8) is None
        return trail, rechecks[r].active

    with caplog.at_level(logging.WARNING, logger="fsdp_hotload"):
        out = run_all(ranks)
    for r in range(WORLD):
        trail, active = out[r]
        # compared at calls 0-3 (settled at the fourth), then at 6 (every 3 calls)
        assert [m for m, _left in trail] == [1, 2, 3, 4, 4, 4, 5, 5], trail
        assert trail[3][1] == 0 and not active, trail
    assert caplog.text.count("rank 1 could not read its copies: TypeError") == WORLD, caplog.text


def test_ranks_whose_compared_tensors_do_not_line_up_are_refused_at_construction() -> None:
    """Each tensor has a slot in the reduced vector, numbered alike on every rank from its plain parameters' paths.
    A rank with one more would reduce a longer vector (gloo fails or hangs on that) or line one tensor's digest up
    with another's: the ranks compare their slots' layout once, at construction, and every rank refuses it."""
    from fsdp_hotload.fsdp import OwnershipError

    meeting = Meeting(WORLD)
    models = [plain_model() for _ in range(WORLD)]
    models[3].register_parameter("extra", nn.Parameter(torch.zeros(2)))

    def ranks(r: int) -> str:
        with pytest.raises(OwnershipError) as info:
            build(r, models[r], ThreadComm(meeting, r, WORLD))
        return str(info.value)

    out = run_all(ranks)
    for r in range(WORLD):
        assert out[r].startswith("ranks 0 and 3 hold different plain parameters (4 and 5 tensors to compare as "
                                 "copies, e.g. 'extra')"), out[r]


def test_a_copy_frozen_on_rank_0_alone_is_still_compared() -> None:
    """Plain tensors are read only while they train, each rank deciding by its own ``requires_grad``: a tensor
    frozen on rank 0 alone, which the others train alike, was never read on rank 0, whose copy is the one
    published, and the others agreed among themselves. Whether each rank trains a tensor goes into the reduction,
    and from the next comparison every rank reads what any rank trains: the stale copy on rank 0 is found."""
    meeting = Meeting(WORLD)
    models = [plain_model() for _ in range(WORLD)]
    models[0][1].bias.requires_grad_(False)
    rechecks = run_all(lambda r: build(r, models[r], ThreadComm(meeting, r, WORLD)))

    def ranks(r: int) -> list[Any]:
        verdicts = []
        for step in range(3):
            with torch.no_grad():
                for p in models[r].parameters():
                    if p.requires_grad:
                        p.add_(0.25)
            verdicts.append(rechecks[r].run(models[r], {}, step))
            if verdicts[-1] is not None:
                break
        return verdicts

    out = run_all(ranks)
    for r in range(WORLD):
        assert out[r][0] is None and out[r][1].startswith("ranks 0 and 1 held plain tensor '1.bias' ("), out[r]


@pytest.mark.parametrize("rows", [64, WHOLE_ELEMENTS // 4 + 2])
def test_a_change_outside_the_sample_changes_the_whole_digest_whatever_the_layout(rows: int) -> None:
    """The digests the ranks compare: a few sampled elements, and with ``whole`` every element's bits, read whole
    up to ``WHOLE_ELEMENTS`` elements and summed beyond. A change in a row the sample skips (row 1) changes the
    whole digest either way, and equal values give equal digests whatever their memory layout."""
    from fsdp_hotload.fsdp_verify import _crcs

    base = torch.randn(rows, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    changed = base.clone()
    changed[1, 2] += 1.0
    transposed = base.t().contiguous().t()  # the same values, column-major
    sampled = _crcs([(0, base), (1, changed), (2, transposed)])
    assert sampled[0] == sampled[1] == sampled[2]  # row 1 is outside the sample
    digests = _crcs([(0, base), (1, changed), (2, transposed)], whole=True)
    assert digests[0] != digests[1] and digests[0] == digests[2], digests


def test_small_tensors_are_read_whole_whatever_their_strides() -> None:
    """Every byte of a small tensor counts, in any layout: two elements swapped outside the sample (which a bit sum
    cannot see) change its digest, and strided views (a column, one element of stride 3, a transposed part taken
    flat) digest as their contiguous copies. Those views raised "self.stride(-1) must be 1 to view ... as Byte",
    which failed construction on every rank, or ended the comparisons for the rest of the job."""
    from fsdp_hotload.fsdp_verify import _crcs

    base = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    swapped = base.clone()
    swapped[1, [1, 2]] = swapped[1, [2, 1]]
    assert base[1, 1] != base[1, 2]
    digests = _crcs([(0, base), (1, swapped)], whole=True)
    assert digests[0] != digests[1], digests
    wide = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    views = [wide[:, 0], torch.ones(1, 3)[:, 0], wide.t().reshape(-1)[::2], wide.t()[1:], wide[:1, ::3]]
    assert [v.reshape(-1).stride(0) for v in views[:2]] == [3, 3]
    strided = _crcs(list(enumerate(views)), whole=True)
    copies = _crcs([(i, torch.empty(v.shape, dtype=v.dtype).copy_(v)) for i, v in enumerate(views)], whole=True)
    assert strided == copies


def test_digests_do_not_depend_on_how_the_host_copies_are_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples and small tensors are copied to the host in runs of at most ``JOIN_BYTES`` (so that many tensors of
    up to 128 KiB each do not take one host copy of their whole size): runs of any length give the same digests."""
    import fsdp_hotload.fsdp_verify as verify

    g = torch.Generator().manual_seed(1)
    tensors = [(i, torch.randn(shape, generator=g)) for i, shape in
               enumerate([(3,), (300, 7), (WHOLE_ELEMENTS // 7 + 1, 7), (2, 2), (WHOLE_ELEMENTS,), ()])]
    tensors.append((6, tensors[1][1].t()))  # a transposed view, read in its logical order
    one_run = verify._crcs(tensors, whole=True)
    monkeypatch.setattr(verify, "JOIN_BYTES", 100)  # most items alone, some over the limit
    assert verify._crcs(tensors, whole=True) == one_run
    assert len(set(one_run.values())) == len(tensors)
