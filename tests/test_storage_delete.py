"""Storage.delete_prefix with ``last`` (a snapshot's shards go after everything else) while another deleter
removes the same files: the shards are still deleted, on a local folder and on gs:// (a GCS emulator)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec

from fsdp_hotload.retention import _is_shard
from fsdp_hotload.storage import Storage
from tests.gcs_fixture import GcsServer

IDENT = "step-000001-aaaaaaaa"
NAMES = ("config.json", "tokenizer.json", "model-00001-of-00001.safetensors")


class RacingDeleter:
    """A real filesystem where another deleter removes the folder's files that are not shards right after each
    listing (``find``): what the listing named is gone by the time the caller deletes it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        names = self.inner.find(path, *args, **kwargs)
        for name in names:
            if not _is_shard(str(name).rsplit("/", 1)[-1]):
                self.inner.rm(name)
        return names

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _check(st: Storage) -> None:
    for name in NAMES:
        st.put_bytes(f"{IDENT}/{name}", b"x")
    st.delete_prefix(IDENT, last=_is_shard)
    assert st.list(IDENT) == []  # the shard went too, though the files before it were gone already


def test_shards_go_when_the_other_files_are_gone_already_local(tmp_path: Path) -> None:
    """The error of the first delete (every file it named was gone) was caught around both deletes, so the
    shards stayed while the call reported success; the folder then looked like a publisher's crashed upload."""
    _check(Storage(str(tmp_path), fs=RacingDeleter(fsspec.filesystem("file"))))


def test_shards_go_when_the_other_files_are_gone_already_gcs(gcs_server: GcsServer) -> None:
    inner = fsspec.filesystem("gs", **gcs_server.storage_options)
    _check(Storage(gcs_server.unique_uri("racing-delete"), fs=RacingDeleter(inner)))
