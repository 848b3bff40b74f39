"""Storage on gs:// roots (gcsfs) against a real GCS JSON API server on loopback (gcp-storage-emulator): the plain
operations, and what a silent endpoint or a live upload does to writes, reads and retention."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fsdp_hotload.storage import Storage
from tests.gcs_fixture import GcsServer

MiB = 2**20


def _storage(server: GcsServer, label: str, **kwargs: Any) -> Storage:
    return Storage(server.unique_uri(label), server.storage_options, **kwargs)


def test_round_trip(gcs_server: GcsServer, tmp_path: Path) -> None:
    """Small objects go in one request, a file above ``multipart_threshold`` as a resumable upload in chunks; both
    read back whole, list under their folder, and go with the folder."""
    st = _storage(gcs_server, "roundtrip", multipart_threshold=6 * MiB)
    big = os.urandom(13 * MiB)
    src = tmp_path / "shard.bin"
    src.write_bytes(big)
    st.put_bytes("snap/config.json", b'{"a": 1}')
    st.put_file("snap/model-00001-of-00001.safetensors", str(src))
    st.put_bytes("other/config.json", b"{}")
    assert st.get_bytes("snap/config.json") == b'{"a": 1}'
    assert st.get_bytes("snap/model-00001-of-00001.safetensors") == big
    assert st.list("snap") == ["snap/config.json", "snap/model-00001-of-00001.safetensors"]
    assert st.list_dirs() == ["other", "snap"]
    assert st.size("snap/model-00001-of-00001.safetensors") == len(big)
    assert st.stats.puts == 3 and st.stats.bytes_put == len(big) + 10
    st.delete_prefix("snap")
    assert st.list() == ["other/config.json"]
    assert not st.exists("snap/config.json")
    with pytest.raises(FileNotFoundError):
        st.get_bytes("snap/config.json")
