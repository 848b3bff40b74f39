"""With several ranks, ``bucket_url`` must be one place for every rank: each rank writes the files it owns there,
and rank 0 checks them and commits. A root each rank sees on its own (``memory://``, a node's local disk) failed
every publish with "<file> is missing" for the whole run; now every rank's construction fails at once, naming
``bucket_url`` and the ranks that could not see it. The probe it writes is never taken for a snapshot."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_hotload.arc.boxes import Box
from fsdp_hotload.config import HotloadConfig
from fsdp_hotload.engine.publisher import Publisher
from fsdp_hotload.engine.root_check import PROBE_PREFIX, probe_name
from fsdp_hotload.layout import TensorSpec
from fsdp_hotload.publish import WholeChunk
from fsdp_hotload.retention import apply_retention, list_committed
from fsdp_hotload.storage import Storage
from tests.dist_util import SCRIPTS, run_torchrun
from tests.s3_fault_proxy import S3FaultProxy
from tests.s3_fixture import S3Server
from tests.thread_comm import Meeting, ThreadComm, run_ranks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a per-process path needs /proc/self/cwd")
def test_a_root_that_is_not_shared_by_every_rank_fails_every_rank_at_construction(tmp_path: Path) -> None:
    """torchrun, 2 ranks (dist_scripts/unshared_root.py): memory://, a path that leads each rank to a folder of its
    own, and a folder both share."""
    shared = tmp_path / "shared"
    link = tmp_path / "scratch"
    link.symlink_to("/proc/self/cwd")
    run_torchrun(str(SCRIPTS / "unshared_root.py"), 2,
                 ["--shared", str(shared), "--per-rank", str(link), "--out", str(tmp_path)])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):
        kind, text, took = ranks[r]["memory"]
        assert kind == "ValueError" and "bucket_url 'memory://unshared-root/run'" in text, ranks[r]["memory"]
        assert "memory:// is for single-process use" in text and "object store" in text and took < 30
        kind, text, took = ranks[r]["per_rank"]  # the same message on both ranks: rank 1 did not see rank 0's file
        assert kind == "ValueError", ranks[r]["per_rank"]
        assert f"bucket_url '{link}/run' is not the same place on every rank: rank(s) 1 of 2" in text, text
        assert "shared root" in text and took < 60, ranks[r]["per_rank"]
        assert ranks[r]["shared"][0] == "ok", ranks[r]["shared"]
    # rank 0 deleted its probe; rank 1's folder holds nothing (it wrote nothing there)
    assert os.listdir(tmp_path / "node0" / "run") == []
    assert not (tmp_path / "node1" / "run").exists()
    assert [n for n in os.listdir(shared) if n.startswith(PROBE_PREFIX)] == []


def test_a_probe_left_behind_is_no_snapshot_and_retention_leaves_it(tmp_path: Path) -> None:
    """A probe a crash left at the root (a file with a hidden name) is listed as no snapshot folder, is not read as
    one, and no retention pass deletes it or fails on it."""
    storage = Storage(str(tmp_path / "bucket"))
    name = probe_name("0123456789abcdef")
    storage.put_bytes(name, b"x")
    assert storage.list_dirs() == [] and list_committed(storage) == []
    assert apply_retention(storage, keep_last=1, session="a1b2c3d4", delete_incomplete=True) == []
    assert storage.exists(name)


def _publishers(storages: list[Storage], bucket: str) -> tuple[list[Any], float]:
    """Two thread ranks' publishers over ``storages`` (one each), and how long the slower construction took."""
    names, n = ["a", "b"], 64
    specs = [TensorSpec(name, (n,), "BF16") for name in names]
    cfg = HotloadConfig(bucket_url=bucket, full_every=100)
    data, ctrl = Meeting(2, timeout_s=60.0), Meeting(2, timeout_s=60.0)
    pubs: list[Any] = [None, None]
    took: dict[int, float] = {}

    def make(rank: int) -> None:
        chunk = WholeChunk(names[rank], (n,), "BF16", "flat", Box.flat(0, n), torch.zeros(n, dtype=torch.bfloat16))
        t0 = time.monotonic()
        pubs[rank] = Publisher([chunk], specs, cfg, comm=ThreadComm(data, rank, 2), ctrl=ThreadComm(ctrl, rank, 2),
                               storage=storages[rank])
        took[rank] = time.monotonic() - t0

    run_ranks(make, 2, timeout_s=120)
    return pubs, max(took.values())


def test_a_store_that_does_not_answer_at_start_holds_construction_for_the_probes_budget_only(
        s3_server: S3Server, caplog: pytest.LogCaptureFixture) -> None:
    """A store that takes every request and never answers: the probe is written and read with 2 tries of at most
    30 s (here the storage's own 1 s), not a publish's whole retry budget (6 tries here), and the check is skipped
    with a warning, as the first publish reports what is wrong; the other ranks do not look for it. Before the
    check, construction sent no request."""
    with S3FaultProxy(s3_server.endpoint_url) as proxy:
        proxy.rule = lambda req: "silent"
        options = {**s3_server.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
        bucket = s3_server.unique_uri("silent-start")
        storages = [Storage(bucket, options, max_attempts=6, call_timeout_s=1.0, base_backoff_s=0.01)
                    for _ in range(2)]
        caplog.set_level(logging.WARNING, logger="fsdp_hotload")
        pubs, took = _publishers(storages, bucket)
        try:
            assert took < 15, took  # 6 tries would be 6 s for the write alone, and the read as many
            assert proxy.count("PutObject") == 2, proxy.count("PutObject")
            # rank 1 did not look for a probe rank 0 could not write (each look waited out the same budget)
            assert proxy.count("HeadObject") + proxy.count("GetObject") == 0
            assert [r for r in caplog.records if "could not check at start that every rank sees bucket_url"
                    in r.getMessage()], [r.getMessage() for r in caplog.records]
        finally:
            proxy.rule = lambda req: None
            run_ranks(lambda rank: pubs[rank].close(timeout=30), 2, timeout_s=60)  # close is collective


def test_a_bucket_that_does_not_exist_fails_construction_at_once(s3_server: S3Server) -> None:
    """A refusal for good (here no such bucket) is not skipped: no snapshot could be written there either."""
    bucket = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run"
    options = {**s3_server.storage_options, "skip_instance_cache": True}
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 0 raised RuntimeError.*rank 0 could not write a small file "
                                             r"there at start .*bucket does not exist") as info:
        _publishers([Storage(bucket, options) for _ in range(2)], bucket)
    assert isinstance(info.value.__cause__, RuntimeError) and time.monotonic() - t0 < 30
