"""Which storage roots hotload writes to, and which it refuses before any training step: a scheme other than a
local path, file://, local://, memory://, s3:// (s3a://) and gs:// (gcs://); every fsspec chain (dir::,
simplecache::, ...); a file:// URL naming a host; a gs:// root with a generation ('#', '?'). Each is refused by the
config (naming bucket_url, its variable or its flag) and by the storage layer alike; and the roots that name one
folder however they are written (file://localhost/abs, file://~/x, S3://) reach it."""
from __future__ import annotations

import argparse
import os
import re
import uuid
from pathlib import Path

import pytest

from fsdp_hotload import HotloadConfig
from fsdp_hotload.storage import Storage
from fsdp_hotload.storage_paths import root_key
from megatron_hotload import add_hotload_args, config_from_args
from tests.gcs_fixture import GcsServer
from tests.s3_fixture import S3Server


def _refused_everywhere(root: str, monkeypatch: pytest.MonkeyPatch, *needles: str) -> None:
    """``root`` is refused by Storage, by HotloadConfig (naming bucket_url), by from_env (naming
    HOTLOAD_BUCKET_URL) and by the Megatron flags (naming --hotload-bucket-url), each message holding ``needles``."""
    with pytest.raises(ValueError) as info:
        Storage(root)
    messages = {"Storage": str(info.value)}
    with pytest.raises(ValueError) as info:
        HotloadConfig(bucket_url=root)
    messages["HotloadConfig"] = str(info.value)
    assert re.search(r"^bucket_url$", messages["HotloadConfig"], re.M), messages["HotloadConfig"]
    monkeypatch.setenv("HOTLOAD_BUCKET_URL", root)
    with pytest.raises(ValueError) as info:
        HotloadConfig.from_env()
    messages["from_env"] = str(info.value)
    assert "HOTLOAD_BUCKET_URL:" in messages["from_env"], messages["from_env"]
    monkeypatch.delenv("HOTLOAD_BUCKET_URL")
    with pytest.raises(SystemExit) as exit_info:
        config_from_args(add_hotload_args(argparse.ArgumentParser()).parse_args(["--hotload-bucket-url", root]))
    messages["flags"] = str(exit_info.value)
    assert "--hotload-bucket-url:" in messages["flags"], messages["flags"]
    for where, text in messages.items():
        for needle in needles:
            assert needle in text, (where, text)


# ------------------------------------------------------------------------------------------------ file:// hosts


@pytest.mark.parametrize("scheme", ["file", "local"])
def test_file_localhost_writes_to_the_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    scheme: str) -> None:
    """fsspec reads file://localhost/abs as <cwd>/localhost/abs: the snapshots went under the working directory,
    where no reader started elsewhere looks. RFC 8089 names this machine so: it is /abs."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    target = tmp_path / "bucket"
    st = Storage(f"{scheme}://localhost{target}")
    st.put_bytes("step-1-ab/config.json", b"{}")
    assert (target / "step-1-ab" / "config.json").read_bytes() == b"{}"
    assert list(cwd.iterdir()) == []
    assert HotloadConfig(bucket_url=f"{scheme}://localhost{target}").bucket_url == f"{scheme}://localhost{target}"
    assert root_key(f"{scheme}://localhost{target}") == root_key(str(target))


def test_file_url_with_a_host_is_refused_with_the_folder_meant(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """file://tmp/x was the relative path tmp/x (under the working directory), written without a word."""
    monkeypatch.chdir(tmp_path)
    _refused_everywhere("file://tmp/run-x", monkeypatch, "names a host ('tmp')", "did you mean file:///tmp/run-x?")
    _refused_everywhere("local://files.internal/run", monkeypatch, "did you mean local:///files.internal/run?")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ chains


@pytest.mark.parametrize("link", ["simplecache", "filecache", "blockcache"])
def test_a_caching_link_is_refused_naming_the_plain_url(link: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """simplecache:: kept a local copy of every byte written for the life of the process (retention deleted only
    the store's), and the root was no object store to the storage layer: no per-part retries or deadlines, no
    multipart abort."""
    _refused_everywhere(f"{link}::s3://bucket/run", monkeypatch, f"{link} in front of the store", "local copy",
                        "give the plain URL s3://bucket/run")


def test_a_path_rewriting_chain_is_refused_and_writes_nothing(s3_server: S3Server,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """dir::s3://bucket/run rooted the filesystem at bucket/run, and the storage layer added the root again: every
    object landed under s3://bucket/run/bucket/run/, each publish reporting ok."""
    root = s3_server.unique_uri("dirfs")
    _refused_everywhere(f"dir::{root}", monkeypatch, "chain of fsspec filesystems (dir::)", f"plain URL {root}")
    with pytest.raises(ValueError, match="chain"):
        Storage(f"dir::{root}", {"s3": s3_server.storage_options})
    prefix = root.split(f"s3://{s3_server.bucket}/", 1)[1]
    assert s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix).get("KeyCount") == 0


# ------------------------------------------------------------------------------------------------ schemes


@pytest.mark.parametrize("root, scheme", [("http://127.0.0.1:1/bucket", "http"), ("https://files.example/run", "https"),
                                          ("hf://datasets/me/run", "hf"), ("bogus://b/run", "bogus"),
                                          ("sftp://files.internal/runs", "sftp")])
def test_a_scheme_hotload_does_not_write_to_is_refused_before_any_step(root: str, scheme: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """http(s)://, hf://, an unknown scheme passed the config and the publisher's construction, and failed at the
    first publish, after the step's tensors were gathered and encoded."""
    _refused_everywhere(root, monkeypatch, f"{scheme}:// is not a storage hotload writes to", "s3://", "gs://",
                        "file://", "memory://")


@pytest.mark.parametrize("root", ["az://runs/rl", "abfs://runs@acct.dfs.core.windows.net/rl", "adl://store/rl"])
def test_azure_is_refused_as_unsupported_not_as_a_missing_package(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error said to install adlfs, which led to a backend hotload never tested."""
    _refused_everywhere(root, monkeypatch, "Azure Blob Storage", "not a supported backend")
    with pytest.raises(ValueError) as info:
        Storage(root)
    assert "adlfs" not in str(info.value) and "pip install" not in str(info.value)


def test_an_upper_case_scheme_is_the_same_store(s3_server: S3Server) -> None:
    """S3://b/run passed the config and failed at open with fsspec's bare 'Protocol not known: S3'."""
    root = s3_server.unique_uri("upper")
    upper = "S3" + root[2:]
    assert HotloadConfig(bucket_url=upper, storage_options=s3_server.storage_options).bucket_url == upper
    st = Storage(upper, s3_server.storage_options)
    assert st.root == root
    st.put_bytes("step-1-ab/config.json", b"{}")
    assert Storage(root, s3_server.storage_options).get_bytes("step-1-ab/config.json") == b"{}"
    assert Storage("MEMORY://Upper-Case/Run").root == "memory://Upper-Case/Run"  # the scheme only


# ------------------------------------------------------------------------------------------------ hints, ~


@pytest.mark.parametrize("given, meant", [("file:~/run-z", "~/run-z"), ("file:runs/exp1", "runs/exp1"),
                                          ("local:runs/exp1", "runs/exp1")])
def test_a_file_scheme_without_slashes_suggests_the_folder_meant(given: str, meant: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """file:~/run suggested file:///~/run (the folder '/~/run'), file:runs/exp1 file:///runs/exp1 (at the top of the
    file system, not under the working directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ValueError) as info:
        Storage(given)
    hint = re.search(r"did you mean (\S+?)\?", str(info.value))
    assert hint is not None, str(info.value)
    assert Storage(hint[1])._fs_root == os.path.abspath(os.path.expanduser(meant))


def test_file_tilde_is_one_root_with_the_home_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """file://~/x writes where ~/x does, yet counted as another root: two callbacks on one optimizer could both
    publish there."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for url in ("file://~/run", "local://~/run"):
        assert Storage(url)._fs_root == Storage("~/run")._fs_root == str(tmp_path / "run")
        assert root_key(url) == root_key("~/run") == root_key(str(tmp_path / "run"))


# ------------------------------------------------------------------------------------------------ queries


@pytest.mark.parametrize("suffix", ["#5", "?generation=5"])
def test_a_gs_generation_in_the_root_is_refused(gcs_server: GcsServer, suffix: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """gcsfs reads gs://b/run#5 as the object 'run' at generation 5: the snapshots were written under 'run#5/', and
    a listing of the root (commit checks, retention) found none of them."""
    root = gcs_server.unique_uri("gen") + suffix
    with pytest.raises(ValueError, match="object generation") as info:
        Storage(root, gcs_server.storage_options)
    assert "rename that folder" not in str(info.value)
    _refused_everywhere(root, monkeypatch, "object generation", "give the bucket and folder path alone")


def test_an_s3_query_is_refused_saying_it_is_a_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """'?' was refused as a glob character, asking to rename a folder: in a URL it starts a query."""
    _refused_everywhere(f"s3://bucket/run-{uuid.uuid4().hex[:6]}?versionId=3", monkeypatch, "URL's query",
                        "give the bucket and folder path alone")
