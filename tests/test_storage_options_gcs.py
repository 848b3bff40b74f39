"""gs:// storage options that gcsfs would take the wrong way without a word: refused when the storage opens, naming
the option and saying what to give instead; the right spellings reach the real gcsfs filesystem. No request is
sent: a gcsfs filesystem with ``token="anon"`` opens without the network."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gcsfs")

from fsdp_hotload.storage import Storage, StorageError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
#: Options every test opens with: unauthenticated, so no credential lookup, and a project, so no warning.
BASE = {"token": "anon", "project": "hotload-tests", "skip_instance_cache": True}


def _open(**options: Any) -> Storage:
    return Storage("gs://bucket/run", {**BASE, **options})


@pytest.mark.parametrize(("key", "value"), [("version_aware", "false"), ("skip_instance_cache", "no"),
                                            ("use_listings_cache", 0), ("secure_serialize", "true")])
def test_a_gcs_flag_that_is_not_a_boolean_is_refused(key: str, value: Any) -> None:
    """``"version_aware": "false"`` (a string, as a JSON variable easily has it) turned version-aware mode on."""
    with pytest.raises(StorageError, match=rf"storage_options\.{key} must be true or false \(a JSON boolean\), "
                                           rf"not {type(value).__name__} {value!r}: gcsfs takes any non-empty"):
        _open(**{key: value})


@pytest.mark.parametrize("value", ["false", "true", "0", "1", "False"])
def test_requester_pays_given_as_a_flag_string_is_refused(value: str) -> None:
    """gcsfs takes any string as the project to bill: ``"false"`` sent ``userProject=false`` on every request."""
    with pytest.raises(StorageError, match=rf"storage_options\.requester_pays is the string {value!r}, which gcsfs "
                                           rf"would send as the project to bill \(userProject={value}\).*give a JSON "
                                           r"boolean"):
        _open(requester_pays=value)


def test_requester_pays_takes_a_boolean_or_the_project_to_bill() -> None:
    for bad in ("", "my project", 1, None):
        with pytest.raises(StorageError, match=r"storage_options\.requester_pays must be true, false \(JSON "
                                               r"booleans\) or the id of the project to bill"):
            _open(requester_pays=bad)
    assert _open(requester_pays="billing-project").fs._get_params({}) == {"userProject": "billing-project"}
    assert _open(requester_pays=True).fs._get_params({}) == {"userProject": "hotload-tests"}
    assert _open(requester_pays=False).fs._get_params({}) == {}


def test_an_unknown_consistency_is_refused_and_the_known_ones_are_taken() -> None:
    """gcsfs takes any value but 'size', 'md5' and 'crc32c' for no check: "crc32" wrote every object unchecked."""
    for bad, hint in (("crc32", " \\(did you mean 'crc32c'\\?\\)"), ("MD5", " \\(did you mean 'md5'\\?\\)"),
                      ("sha256", ""), (0, "")):
        with pytest.raises(StorageError, match=rf"storage_options\.consistency must be one of 'none', 'size', 'md5', "
                                               rf"'crc32c', not {bad!r}{hint}: gcsfs takes any other value for 'none'"):
            _open(consistency=bad)
    known = ["none", "size", "md5"] + (["crc32c"] if importlib.util.find_spec("crcmod") else [])
    for check in known:
        assert _open(consistency=check).fs.consistency == check
    # null (a JSON config's "unset") is gcsfs's default: no check, as "none"
    assert _open(consistency=None).fs.consistency is None


@pytest.mark.skipif(importlib.util.find_spec("crcmod") is not None, reason="crcmod is installed here")
def test_crc32c_without_crcmod_is_refused_with_what_to_install() -> None:
    """Without crcmod gcsfs fails only at the first write, after the step's tensors were gathered."""
    with pytest.raises(StorageError, match=r"storage_options\.consistency 'crc32c' needs the crcmod package.*"
                                           r"pip install crcmod"):
        _open(consistency="crc32c")


@pytest.mark.parametrize("value", [True, False, "true"])
def test_the_s3fs_anon_option_is_refused_with_the_gcsfs_spelling(value: Any) -> None:
    with pytest.raises(StorageError, match=r'storage_options\.anon is s3fs\'s option, which gcsfs does not take: '
                                           r'for unauthenticated access to gs:// give "token": "anon" instead'):
        _open(anon=value)


_RETRY_OPTIONS = r"""
import fsspec, pytest
from gcsfs.extended_gcsfs import ExtendedGcsFileSystem
from fsdp_hotload.storage import Storage, StorageError
from fsdp_hotload.storage_paths import check_options

assert issubclass(fsspec.get_filesystem_class("gs"), ExtendedGcsFileSystem)
st = Storage("gs://bucket/run", {**BASE, "retry_timeout": 30.0, "retry_initial": 0.5, "retry_maximum": 10,
                                 "retry_multiplier": 3, "memmove_max_workers": 2})
assert st.fs.retry_config == {"timeout": 30.0, "initial": 0.5, "maximum": 10, "multiplier": 3}
with pytest.raises(StorageError, match=r"'retry_timeot' \(did you mean 'retry_timeout'\?\) not accepted"):
    check_options("gs://bucket/run", {"retry_timeot": 30})
with pytest.raises(StorageError, match=r"storage_options\.retry_timeout must be a positive number.*not str '30'"):
    check_options("gs://bucket/run", {"retry_timeout": "30"})
"""


def test_the_retry_options_gcsfs_reads_from_its_keywords_are_taken() -> None:
    """gcsfs's default filesystem documents retry_timeout, retry_initial, retry_maximum and retry_multiplier (read
    from its ``**kwargs``): they were refused as not accepted. A misspelling, or a number given as a string, is.
    In a process of its own: conftest turns gcsfs's default class off (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT) for the
    GCS emulator, and that plain class reads none of them."""
    env = {k: v for k, v in os.environ.items() if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    code = _RETRY_OPTIONS.replace("**BASE", f"**{BASE!r}")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
