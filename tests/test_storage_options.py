"""S3 storage options that s3fs would take the wrong way without a word: refused when the storage opens, naming
the option (a real moto server on loopback)."""
from __future__ import annotations

from typing import Any

import pytest

from fsdp_hotload.storage import Storage, StorageError
from tests.s3_fixture import S3Server


def test_a_misspelt_s3_request_parameter_is_refused_with_a_suggestion(s3_server: S3Server) -> None:
    """s3fs passes each request only the s3_additional_kwargs it takes: "ServerSideEncrytion" was dropped and
    every object written unencrypted."""
    options = {**s3_server.storage_options, "s3_additional_kwargs": {"ServerSideEncrytion": "AES256"}}
    with pytest.raises(StorageError, match=r"storage_options\.s3_additional_kwargs\.ServerSideEncrytion \(did you "
                                           r"mean ServerSideEncryption\?\) is not a parameter of the S3 requests"):
        Storage(s3_server.unique_uri("sse"), options)

    st = Storage(s3_server.unique_uri("sse"),
                 {**s3_server.storage_options, "s3_additional_kwargs": {"ServerSideEncryption": "AES256",
                                                                        "StorageClass": "STANDARD"}})
    st.put_bytes("a.bin", b"x")
    key = st.root.split(f"s3://{s3_server.bucket}/", 1)[1] + "/a.bin"
    assert s3_server.client().head_object(Bucket=s3_server.bucket, Key=key)["ServerSideEncryption"] == "AES256"


def test_s3_additional_kwargs_must_be_an_object(s3_server: S3Server) -> None:
    with pytest.raises(StorageError, match=r"storage_options\.s3_additional_kwargs must be an object"):
        Storage(s3_server.unique_uri("sse"), {**s3_server.storage_options, "s3_additional_kwargs": "AES256"})


@pytest.mark.parametrize(("key", "value"), [("anon", "false"), ("use_ssl", "false"), ("requester_pays", "true"),
                                            ("version_aware", 0), ("skip_instance_cache", "yes")])
def test_an_s3_flag_that_is_not_a_boolean_is_refused(s3_server: S3Server, key: str, value: Any) -> None:
    """``"anon": "false"`` (a string, as a JSON variable easily has it) is true to s3fs: it sent unsigned requests
    and dropped the key and secret given beside it."""
    with pytest.raises(StorageError, match=rf"storage_options\.{key} must be true or false \(a JSON boolean\), "
                                           rf"not {type(value).__name__} {value!r}"):
        Storage(s3_server.unique_uri("flag"), {**s3_server.storage_options, key: value})


def test_s3_flags_given_as_booleans_are_taken(s3_server: S3Server) -> None:
    import botocore

    st = Storage(s3_server.unique_uri("flag"), {**s3_server.storage_options, "anon": False, "use_ssl": False,
                                                 "version_aware": False, "skip_instance_cache": True})
    assert st.fs.s3.meta.config.signature_version is not botocore.UNSIGNED
    st.put_bytes("a", b"x")
    assert st.get_bytes("a") == b"x"


def test_the_options_s3fs_hands_to_its_botocore_session_are_taken() -> None:
    """s3fs passes the keywords it does not take itself to ``aiobotocore``'s session: its documented
    ``profile="<name>"`` was refused as not accepted by S3FileSystem. A misspelling of it still is, with a hint."""
    from fsdp_hotload.storage_paths import check_options

    check_options("s3://bucket/run", {"profile": "trainer", "endpoint_url": "http://127.0.0.1:9"})
    with pytest.raises(StorageError, match=r"'profil' \(did you mean 'profile'\?\)"):
        check_options("s3://bucket/run", {"profil": "trainer"})
