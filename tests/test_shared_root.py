"""With several ranks, ``bucket_url`` must be one place for every rank: each rank writes the files it owns there,
and rank 0 checks them and commits. A root each rank sees on its own (``memory://``, a node's local disk) failed
every publish with "<file> is missing" for the whole run; now every rank's construction fails at once, naming
``bucket_url`` and the ranks that could not see it. The probe it writes is never taken for a snapshot."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from fsdp_hotload.engine.root_check import PROBE_PREFIX, probe_name
from fsdp_hotload.retention import apply_retention, list_committed
from fsdp_hotload.storage import Storage
from tests.dist_util import SCRIPTS, run_torchrun


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
