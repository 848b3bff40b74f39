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


@pytest.mark.parametrize("options, match", [
    ({"endpoint_url": "http://127.0.0.1:1", "client_kwargs": {"endpoint_url": "http://127.0.0.1:2"}},
     r"storage_options\.endpoint_url and client_kwargs\.endpoint_url are both given, with different values"),
    ({"key": "other", "client_kwargs": {"aws_access_key_id": "AK"}},
     r"storage_options\.key and client_kwargs\.aws_access_key_id are both given, with different values: "),
    ({"client_kwargs": {"verify": "False"}}, r"client_kwargs\.verify is the string 'False', which botocore reads as "
                                             r"the path of a CA bundle: give a JSON boolean"),
    ({"client_kwargs": {"verify": 0}}, r"client_kwargs\.verify must be true, false .* not int 0"),
    ({"config_kwargs": {"read_timeout": "30"}}, r"config_kwargs\.read_timeout must be a positive number \(seconds\)"),
    ({"config_kwargs": {"max_pool_connections": 2.5}}, r"config_kwargs\.max_pool_connections must be a positive "
                                                       r"whole number"),
    ({"max_concurrency": "4"}, r"storage_options\.max_concurrency must be a number, not str '4'"),
    ({"client_kwargs": "us-east-1"}, r"storage_options\.client_kwargs must be an object")])
def test_s3_options_botocore_cannot_use_are_refused_when_the_storage_opens(options: dict, match: str) -> None:
    """Each of these failed only inside the first request (or when s3fs built its client), with botocore's words
    ("multiple values for keyword argument 'endpoint_url'", "No such file or directory" for a ``verify`` of
    ``"false"``) and no option named. No store is needed: nothing is sent."""
    with pytest.raises(StorageError, match=match):
        Storage("s3://bucket/run", {"key": "AK", "secret": "SK", **options})


def test_one_endpoint_spelt_the_same_in_both_places_is_taken(s3_server: S3Server) -> None:
    """s3fs hands botocore the top-level value only where it differs from client_kwargs': the same endpoint in both
    (a flag and a variable that agree) writes and reads."""
    options = {**s3_server.storage_options, "client_kwargs": {"endpoint_url": s3_server.endpoint_url,
                                                              "verify": False},
               "config_kwargs": {"connect_timeout": 5, "read_timeout": 30.5, "max_pool_connections": 4}}
    st = Storage(s3_server.unique_uri("twice"), options)
    st.put_bytes("a", b"x")
    assert st.get_bytes("a") == b"x"


def test_hotload_callback_refuses_such_options_when_it_is_built() -> None:
    """The FSDP entry point opens its storage when it is built, on every rank, so the same options stop the
    training script at its start, not at the first step."""
    from torch import nn

    from fsdp_hotload import HotloadCallback, HotloadConfig

    cfg = HotloadConfig(bucket_url="s3://bucket/run", storage_options={
        "key": "AK", "secret": "SK", "endpoint_url": "http://127.0.0.1:1",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:2"}})
    with pytest.raises(StorageError, match=r"endpoint_url and client_kwargs\.endpoint_url are both given"):
        HotloadCallback(nn.Linear(4, 4), cfg)
