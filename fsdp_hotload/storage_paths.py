"""What a storage root, its options and a path under it may be: the checks :class:`~fsdp_hotload.storage.Storage`
runs before any call reaches a backend.

Kept apart from the storage layer so each refusal, and why it is one, reads in one place: every rule here
stopped a write from landing where no reader, commit check or retention pass would find it, or a delete from
reaching another run's snapshots.

Example::

    root = normalise_root("s3://bucket/runs/exp1/")       # 's3://bucket/runs/exp1'
    check_options(root, {"endpoint_url": "http://127.0.0.1:9000"})
    check_relpath("step-4-a1b2/config.json", root)         # 'step-4-a1b2/config.json'
"""
from __future__ import annotations

import difflib
import functools
import inspect
import os
from typing import Any

import fsspec
import fsspec.core

from .masking import mask_url, url_has_credentials
from .storage_errors import StorageError

__all__ = ["LOCAL_PROTOCOLS", "OBJECT_STORE_PROTOCOLS", "check_local_root", "check_options", "check_relpath",
           "normalise_root"]

#: Protocols whose files opened for writing only become visible when closed, so streaming into them is safe.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
LOCAL_PROTOCOLS = frozenset({"file", "local"})


def check_local_root(root: str) -> None:
    """A root without ``scheme://`` is a local folder: refuse what fsspec or the user would read otherwise."""
    shown = mask_url(root)
    head = root.split("/", 1)[0]
    scheme = head.split(":", 1)[0].lower() if ":" in head else None
    if scheme and scheme in fsspec.available_protocols():  # s3:/bucket/run, s3:bucket/run, gs:bucket
        rest = root.split(":", 1)[1].lstrip("/")
        meant = f"{scheme}:///{rest}" if scheme in LOCAL_PROTOCOLS else f"{scheme}://{rest}"
        raise ValueError(f"storage root {shown!r} is a local path that starts with {scheme}: - did you mean "
                         f"{mask_url(meant)}?")
    if "::" in root:  # fsspec would open '/x/a::b' as the chain 'b' over '/x/a', writing to /x/a
        raise ValueError(f"storage root {shown!r} holds '::', which fsspec reads as a chain of filesystems: "
                         "rename the folder, or give the chain with each link's scheme (simplecache::s3://b/p)")


def normalise_root(root: str) -> str:
    root = os.fspath(root).strip()
    if not root:
        raise ValueError("storage root is empty")
    protocol, _ = fsspec.core.split_protocol(root)
    if protocol is None:
        check_local_root(root)
        root = os.path.abspath(os.path.expanduser(root))
    stripped = root.rstrip("/")
    shown = mask_url(root)
    if not stripped or stripped.endswith(":") or stripped.endswith("::"):
        raise ValueError(f"storage root {shown!r} names no directory or bucket")
    for link in stripped.split("::"):
        protocol, path = fsspec.core.split_protocol(link)
        # s3fs/gcsfs read 'KEY:SECRET@b' (as Hadoop's s3a:// did) as a bucket name, and every error showed the keys
        if protocol and protocol.lower() in OBJECT_STORE_PROTOCOLS and url_has_credentials(link):
            raise ValueError(f"storage root {protocol}:// must not carry credentials ('KEY:SECRET@bucket'): pass "
                             "them in storage_options, or leave them to the provider's own credential chain")
        # fsspec's rm expands * ? [ on object stores (and memory://): a root "runs/exp[12]" would delete the
        # snapshots of "runs/exp1" and "runs/exp2" at the first retention pass, and none of its own.
        if protocol and protocol.lower() not in LOCAL_PROTOCOLS and any(c in path for c in "*?["):
            raise ValueError(f"storage root {shown!r} has a glob character (* ? [), which fsspec expands on "
                             f"{protocol}:// when deleting: rename that folder")
        # An object store keeps "a//b" as a key with an empty segment, which listings never return: every write
        # would land where no commit check or retention pass can see it.
        if protocol and protocol.lower() in OBJECT_STORE_PROTOCOLS and any(
                seg in ("", ".", "..") for seg in path.split("/")):
            raise ValueError(f"storage root {shown!r} has an empty, '.' or '..' segment after the bucket")
    return stripped


# Options every fsspec filesystem takes through ``**storage_options`` (instance and listings caches).
_FSSPEC_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"})


def check_options(root: str, options: dict[str, Any]) -> None:
    """Refuse ``storage_options`` an object-store backend does not take. s3fs accepts and ignores any keyword, so
    ``{"endpoint": ...}`` for ``endpoint_url`` would send a MinIO user's snapshots to AWS S3 without a word."""
    protocol, _ = fsspec.core.split_protocol(root)
    if "::" not in root and (protocol is None or protocol.lower() in LOCAL_PROTOCOLS | {"memory"}):
        unused = sorted(set(options) - _FSSPEC_OPTIONS - {"auto_mkdir"})
        if unused:  # e.g. "my-bucket/run" with an endpoint_url: the snapshots would land on the local disk
            raise ValueError(f"storage_options {unused} are for an object store, but the storage root "
                             f"{mask_url(root)!r} is a {protocol or 'local'} path: give the root its scheme (s3://, "
                             "gs://) or drop them")
        return
    if "::" in root or protocol is None or protocol.lower() not in OBJECT_STORE_PROTOCOLS or not options:
        return
    try:
        cls = fsspec.get_filesystem_class(protocol.lower())
    except (ImportError, ValueError):
        return  # the missing package is reported when the filesystem opens
    known = set(_FSSPEC_OPTIONS)
    flags = {"skip_instance_cache", "use_listings_cache"}  # the options whose default is True or False
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None:
            params = [p for n, p in inspect.signature(init).parameters.items()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"]
            known.update(p.name for p in params)
            flags.update(p.name for p in params if isinstance(p.default, bool))
    if protocol.lower() in ("s3", "s3a"):
        known.update(_session_options())
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        hints = [_did_you_mean(k, known) for k in unknown]
        raise StorageError(f"cannot open {mask_url(root)}: storage_options {', '.join(hints)} not accepted by "
                           f"{cls.__module__}.{cls.__name__}", uri=mask_url(root), op="open")
    if protocol.lower() in ("s3", "s3a"):
        _check_s3_options(root, options, flags)


def _session_options() -> set[str]:
    """The keywords s3fs hands on to ``aiobotocore.session.AioSession`` (its documented ``profile``, for one):
    s3fs passes every option it does not take itself there."""
    try:
        from aiobotocore.session import AioSession
    except ImportError:
        return {"profile"}
    return {n for n, p in inspect.signature(AioSession.__init__).parameters.items()
            if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _did_you_mean(key: str, known: set[str] | frozenset[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key)


#: The S3 requests hotload sends through s3fs (writes, reads, listings, deletes, multipart uploads).
_S3_OPERATIONS = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload",
                  "AbortMultipartUpload", "ListMultipartUploads", "GetObject", "HeadObject", "HeadBucket",
                  "ListObjectsV2", "DeleteObject", "DeleteObjects")


@functools.lru_cache(maxsize=1)
def _s3_request_members() -> frozenset[str]:
    """Every parameter any of :data:`_S3_OPERATIONS` takes, from botocore's model of S3 (imported here only: a
    root on another store never loads it); empty when botocore cannot say, and then nothing is checked."""
    try:
        import botocore.session

        model = botocore.session.get_session().get_service_model("s3")
        return frozenset(name for op in _S3_OPERATIONS for name in model.operation_model(op).input_shape.members)
    except Exception:  # noqa: BLE001 - an older botocore without one of the operations: check nothing
        return frozenset()


def _check_s3_options(root: str, options: dict[str, Any], flags: set[str]) -> None:
    """Refuse what s3fs would take the wrong way without a word.

    A flag given as a string: ``"anon": "false"`` (easily written in a JSON variable) is true to s3fs, which then
    sends unsigned requests and drops the key and secret given beside it. A key in ``s3_additional_kwargs`` that
    no request hotload sends takes: s3fs passes each request only the keys it takes, so a misspelt
    ``ServerSideEncryption`` wrote every object unencrypted."""
    shown = mask_url(root)
    not_flags = sorted(k for k in options if k in flags and not isinstance(options[k], bool))
    if not_flags:
        key = not_flags[0]
        raise StorageError(f"cannot open {shown}: storage_options.{key} must be true or false (a JSON boolean), not "
                           f"{type(options[key]).__name__} {options[key]!r}: s3fs takes any non-empty value for true",
                           uri=shown, op="open")
    extra = options.get("s3_additional_kwargs")
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise StorageError(f"cannot open {shown}: storage_options.s3_additional_kwargs must be an object of S3 "
                           f"request parameters (e.g. {{\"ServerSideEncryption\": \"aws:kms\"}}), not "
                           f"{type(extra).__name__}", uri=shown, op="open")
    members = _s3_request_members()
    unknown = sorted(str(k) for k in extra if members and k not in members)
    if unknown:
        names = [f"storage_options.s3_additional_kwargs.{k}" + (f" (did you mean {close[0]}?)" if (
            close := difflib.get_close_matches(k, members, n=1)) else "") for k in unknown]
        raise StorageError(f"cannot open {shown}: {', '.join(names)} {'is' if len(names) == 1 else 'are'} not a "
                           "parameter of the S3 requests hotload sends (PutObject, the multipart upload's, GetObject, "
                           "HeadObject, listings, deletes), so s3fs would drop it: spell it as botocore does "
                           "(ServerSideEncryption, SSEKMSKeyId, StorageClass, ACL, ...)", uri=shown, op="open")


def check_relpath(relpath: str, root: str, *, allow_empty: bool = False) -> str:
    """Reject paths that would escape the root or alias another object (``..``, ``//``, absolute paths)."""
    if not isinstance(relpath, str):
        raise TypeError(f"relpath under {root} must be str, got {type(relpath).__name__}")
    rel = relpath.rstrip("/") if allow_empty else relpath
    if not rel:
        if allow_empty:
            return ""
        raise ValueError(f"empty relpath under {root}")
    if rel.startswith("/") or "\\" in rel or "\x00" in rel:
        raise ValueError(f"bad relpath {relpath!r} under {root}: must be relative, '/'-separated")
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise ValueError(f"bad relpath {relpath!r} under {root}: empty, '.' or '..' segment")
    return rel


#: Protocols one backend serves under two names: the same store, whichever is written.
_SAME_BACKEND = {"s3a": "s3", "gcs": "gs"}


def root_key(url: str, options: dict[str, Any] | None = None) -> str:
    """A bucket as the storage layer reaches it: "bucket", "./bucket/", "file:///abs/bucket", a path through a
    symlink or "..", and "S3://b/run/" each name one root however they are written; an object store's root
    includes its endpoint (``storage_options``, or ``$AWS_ENDPOINT_URL``), so that one bucket path on two stores
    (a MinIO per region) is two roots. Why: two callbacks attached to one optimizer must not publish to one root
    (``HotloadCallback.attach``), and must both publish to two."""
    try:
        root = normalise_root(url)
    except ValueError:
        return url
    scheme, sep, rest = root.partition("://")
    if not sep:
        return os.path.realpath(root)
    scheme = scheme.lower()
    if scheme in ("file", "local"):
        return os.path.realpath(rest)
    scheme = _SAME_BACKEND.get(scheme, scheme)
    options = options or {}
    nested = options.get("client_kwargs") if isinstance(options.get("client_kwargs"), dict) else {}
    endpoint = options.get("endpoint_url") or nested.get("endpoint_url") or (
        os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") if scheme == "s3" else None)
    return f"{scheme}://{rest.rstrip('/')}" + (f" at {str(endpoint).rstrip('/')}" if endpoint else "")
