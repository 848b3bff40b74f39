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
import importlib
import inspect
import os
import re
from typing import Any

import fsspec
import fsspec.core

from .masking import mask_url, url_has_credentials
from .storage_errors import StorageError

__all__ = ["LOCAL_PROTOCOLS", "OBJECT_STORE_PROTOCOLS", "SUPPORTED_PROTOCOLS", "SUPPORTED_ROOTS", "check_local_root",
           "check_options", "check_relpath", "normalise_root"]

#: Protocols whose files opened for writing only become visible when closed, so streaming into them is safe.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
LOCAL_PROTOCOLS = frozenset({"file", "local"})
#: What hotload writes snapshots to, and its tests cover end to end: every other scheme is refused when the config
#: is validated and when the storage opens, since another fsspec backend was found out only at the first publish
#: (after the step's tensors were gathered), or wrote somewhere no reader looks.
SUPPORTED_PROTOCOLS = LOCAL_PROTOCOLS | OBJECT_STORE_PROTOCOLS | {"memory"}
#: The supported roots, as refusals name them.
SUPPORTED_ROOTS = ("a local path, file:// (or local://), s3:// (or s3a://; S3-compatible stores through "
                   "storage_options.endpoint_url), gs:// (or gcs://), or memory:// (one process's memory, for "
                   "single-process tests)")
_AZURE_PROTOCOLS = frozenset({"az", "abfs", "abfss", "adl", "wasb", "wasbs"})
#: fsspec's caching links: each keeps a local copy of what passes through it.
_CACHING_PROTOCOLS = frozenset({"simplecache", "filecache", "blockcache", "cached"})
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*(?=://)")


def check_local_root(root: str) -> None:
    """A root without ``scheme://`` is a local folder: refuse what fsspec or the user would read otherwise."""
    shown = mask_url(root)
    head = root.split("/", 1)[0]
    scheme = head.split(":", 1)[0].lower() if ":" in head else None
    if scheme and scheme in fsspec.available_protocols():  # s3:/bucket/run, s3:bucket/run, gs:bucket, file:~/run
        rest = root.split(":", 1)[1]
        if scheme not in SUPPORTED_PROTOCOLS:
            raise ValueError(f"storage root {shown!r} is a local path that starts with {scheme}:, and {scheme}:// "
                             f"is not a storage hotload writes to: give {SUPPORTED_ROOTS}")
        if scheme in LOCAL_PROTOCOLS:  # the folder meant: file:~/run is ~/run, file:runs/exp1 is ./runs/exp1
            meant = f"{scheme}://{os.path.abspath(os.path.expanduser(rest))}"
        else:
            meant = f"{scheme}://{rest.lstrip('/')}"
        raise ValueError(f"storage root {shown!r} is a local path that starts with {scheme}: - did you mean "
                         f"{mask_url(meant)}?")
    if "::" in root:  # fsspec would open '/x/a::b' as the chain 'b' over '/x/a', writing to /x/a
        raise ValueError(f"storage root {shown!r} holds '::', which fsspec reads as a chain of filesystems: rename "
                         "the folder")


def _check_scheme(root: str) -> None:
    """Refuse a root whose scheme hotload does not write to, and every fsspec chain (``a::b://...``).

    A chain's links change what a write does: ``dir::s3://b/run`` roots the filesystem at ``b/run`` and hotload
    adds the root again (every object, commit marker included, landed under ``s3://b/run/b/run/``, and every publish
    reported ok); a caching link (``simplecache::``) keeps a local copy of every byte written for the life of the
    process (retention deletes only the store's copy) and hides the object store from the storage layer, so a large
    file loses its per-part retries and deadlines and an open multipart upload is never aborted."""
    shown = mask_url(root)
    links = root.split("::")
    protocol = fsspec.core.split_protocol(links[-1])[0]  # the store a chain ends on: its plain URL's
    protocol = protocol.lower() if protocol else None
    if protocol in _AZURE_PROTOCOLS:
        raise ValueError(f"storage root {shown!r}: Azure Blob Storage ({protocol}://) is not a supported backend; "
                         f"give {SUPPORTED_ROOTS}")
    if protocol is not None and protocol not in SUPPORTED_PROTOCOLS:
        raise ValueError(f"storage root {shown!r}: {protocol}:// is not a storage hotload writes to; give "
                         f"{SUPPORTED_ROOTS}")
    if len(links) > 1:
        plain = mask_url(links[-1])
        names = [(fsspec.core.split_protocol(link)[0] or link).lower() for link in links[:-1]]
        caching = [n for n in names if n in _CACHING_PROTOCOLS]
        if caching:
            raise ValueError(f"storage root {shown!r} puts fsspec's {caching[0]} in front of the store: it keeps a "
                             "local copy of every byte written for the life of the process (retention deletes only "
                             "the store's copy, so the trainer's disk fills), and the store's per-part retries, "
                             f"deadlines and multipart aborts would not apply: give the plain URL {plain}")
        raise ValueError(f"storage root {shown!r} is a chain of fsspec filesystems ({'::'.join(names)}::), which "
                         "hotload does not write through: a link changes where or how each write lands (dir:: roots "
                         "the store at the path and hotload added the path again, so objects landed under "
                         f"<root>/<root>/): give the plain URL {plain}")


def _local_host(root: str) -> str:
    """``file://localhost/abs`` (RFC 8089: this machine) as ``file:///abs``; any other host refused. Why: fsspec
    reads ``file://tmp/x`` as the relative path ``tmp/x`` and ``file://localhost/abs`` as ``<cwd>/localhost/abs``,
    so snapshots landed under the working directory, where no reader started elsewhere looks."""
    scheme, sep, rest = root.partition("://")
    if not sep or scheme not in LOCAL_PROTOCOLS or not rest or rest.startswith(("/", "~")):
        return root
    host, _, path = rest.partition("/")
    if host.lower() == "localhost":
        return f"{scheme}:///{path}"
    shown = mask_url(root)
    if "@" in host:  # user:password@host: no hint that would show them
        raise ValueError(f"storage root {shown!r} names a host, which fsspec reads as a folder under the working "
                         f"directory: a {scheme}:// root is a path on this machine ({scheme}:///abs/path)")
    meant = os.path.abspath(rest) if host in (".", "..") else f"/{rest}"
    raise ValueError(f"storage root {shown!r} names a host ({host!r}), which fsspec reads as a folder under the "
                     f"working directory: did you mean {scheme}://{meant}?")


def normalise_root(root: str) -> str:
    """``root`` as the storage layer opens it (a local path made absolute, the scheme in lower case, no trailing
    ``/``), or ValueError saying why hotload refuses it: an unsupported scheme, an fsspec chain, or a path that
    would write where no reader, commit check or retention pass looks. The config's ``bucket_url`` runs this
    check too, so a bad root is refused before any training step."""
    root = os.fspath(root).strip()
    if not root:
        raise ValueError("storage root is empty")
    scheme = _SCHEME.match(root)
    if scheme:  # S3://b/run: fsspec knows no "S3" ("Protocol not known"); only the scheme, never the bucket
        root = scheme[0].lower() + root[scheme.end():]
    protocol, _ = fsspec.core.split_protocol(root)
    if protocol is None:
        check_local_root(root)
        root = os.path.abspath(os.path.expanduser(root))
    _check_scheme(root)
    root = _local_host(root)
    stripped = root.rstrip("/")
    shown = mask_url(root)
    if not stripped or stripped.endswith(":"):
        raise ValueError(f"storage root {shown!r} names no directory or bucket")
    protocol, path = fsspec.core.split_protocol(stripped)
    # s3fs/gcsfs read 'KEY:SECRET@b' (as Hadoop's s3a:// did) as a bucket name, and every error showed the keys
    if protocol in OBJECT_STORE_PROTOCOLS and url_has_credentials(stripped):
        raise ValueError(f"storage root {protocol}:// must not carry credentials ('KEY:SECRET@bucket'): pass "
                         "them in storage_options, or leave them to the provider's own credential chain")
    if protocol and protocol not in LOCAL_PROTOCOLS and "?" in path:
        raise ValueError(f"storage root {shown!r} has a '?', which starts a URL's query (s3fs reads ?versionId= as "
                         "an object version, gcsfs ?generation= as an object generation) and which fsspec expands "
                         "as a glob when deleting: give the bucket and folder path alone")
    # gcsfs reads 'gs://b/run#5' as the object 'run' at generation 5 (and turns version-aware mode on): the root's
    # listings (commit checks, retention) would look at 'run', while writes land under 'run#5/'.
    if protocol in ("gs", "gcs") and "#" in path:
        raise ValueError(f"storage root {shown!r} has a '#', which gcsfs reads as the start of an object generation "
                         "(gs://b/run#5 lists the object run at generation 5, not the folder run#5): give the bucket "
                         "and folder path alone")
    # fsspec's rm expands * and [ on object stores (and memory://): a root "runs/exp[12]" would delete the
    # snapshots of "runs/exp1" and "runs/exp2" at the first retention pass, and none of its own.
    if protocol and protocol not in LOCAL_PROTOCOLS and any(c in path for c in "*["):
        raise ValueError(f"storage root {shown!r} has a glob character (* or [), which fsspec expands on "
                         f"{protocol}:// when deleting, reaching other folders: rename that folder")
    # An object store keeps "a//b" as a key with an empty segment, which listings never return: every write
    # would land where no commit check or retention pass can see it.
    if protocol in OBJECT_STORE_PROTOCOLS and any(seg in ("", ".", "..") for seg in path.split("/")):
        raise ValueError(f"storage root {shown!r} has an empty, '.' or '..' segment after the bucket")
    return stripped


# Options every fsspec filesystem takes through ``**storage_options`` (instance and listings caches).
_FSSPEC_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"})


def check_options(root: str, options: dict[str, Any]) -> None:
    """Refuse ``storage_options`` an object-store backend does not take, or would take the wrong way. s3fs (and
    gcsfs) accept and ignore any keyword, so ``{"endpoint": ...}`` for ``endpoint_url`` would send a MinIO user's
    snapshots to AWS S3 without a word."""
    protocol, _ = fsspec.core.split_protocol(root)
    if protocol is None or protocol.lower() in LOCAL_PROTOCOLS | {"memory"}:
        unused = sorted(set(options) - _FSSPEC_OPTIONS - {"auto_mkdir"})
        if unused:  # e.g. "my-bucket/run" with an endpoint_url: the snapshots would land on the local disk
            raise ValueError(f"storage_options {unused} are for an object store, but the storage root "
                             f"{mask_url(root)!r} is a {protocol or 'local'} path: give the root its scheme (s3://, "
                             "gs://) or drop them")
        return
    if protocol.lower() not in OBJECT_STORE_PROTOCOLS or not options:
        return
    try:
        cls = fsspec.get_filesystem_class(protocol.lower())
    except (ImportError, ValueError):
        return  # the missing package is reported when the filesystem opens
    known = set(_FSSPEC_OPTIONS)
    flags = {"skip_instance_cache", "use_listings_cache"}  # the options whose default is True or False
    numbers: set[str] = set()  # those whose default is a number (s3fs's max_concurrency)
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None:
            params = [p for n, p in inspect.signature(init).parameters.items()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"]
            known.update(p.name for p in params)
            flags.update(p.name for p in params if isinstance(p.default, bool))
            numbers.update(p.name for p in params
                           if isinstance(p.default, (int, float)) and not isinstance(p.default, bool))
    scheme = protocol.lower()
    if scheme in ("s3", "s3a"):
        known.update(_session_options())
    else:
        known.update(_gcs_kwargs_options(cls))
        if "anon" in options and "anon" not in known:
            raise StorageError(f"cannot open {mask_url(root)}: storage_options.anon is s3fs's option, which gcsfs does "
                               "not take: for unauthenticated access to gs:// give \"token\": \"anon\" instead, "
                               "otherwise drop it", uri=mask_url(root), op="open")
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        hints = [_did_you_mean(k, known) for k in unknown]
        raise StorageError(f"cannot open {mask_url(root)}: storage_options {', '.join(hints)} not accepted by "
                           f"{cls.__module__}.{cls.__name__}", uri=mask_url(root), op="open")
    wrong = sorted(k for k in options if k in numbers - flags and options[k] is not None
                   and (isinstance(options[k], bool) or not isinstance(options[k], (int, float))))
    if wrong:
        key = wrong[0]
        raise StorageError(f"cannot open {mask_url(root)}: storage_options.{key} must be a number, not "
                           f"{type(options[key]).__name__} {options[key]!r} (write it without quotes in JSON)",
                           uri=mask_url(root), op="open")
    if scheme in ("s3", "s3a"):
        _check_s3_options(root, options, flags)
    else:
        _check_gcs_options(root, options, flags)


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
    _check_flags(root, options, flags, "s3fs")
    _check_s3_client_options(root, options)
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


#: s3fs's own options and the botocore client keyword each is handed on as, beside ``client_kwargs``.
_S3_CLIENT_TWINS = {"endpoint_url": "endpoint_url", "key": "aws_access_key_id", "secret": "aws_secret_access_key",
                    "token": "aws_session_token"}
#: botocore ``Config`` settings that are numbers: a JSON string there fails only inside the first request.
_S3_CONFIG_NUMBERS = {"connect_timeout": "seconds", "read_timeout": "seconds", "max_pool_connections": "a count"}


def _check_s3_client_options(root: str, options: dict[str, Any]) -> None:
    """Refuse what s3fs hands botocore and only the first request (or a client built then) trips over: the same
    setting given at the top level and in ``client_kwargs`` with two values (botocore is given both: "multiple
    values for keyword argument 'endpoint_url'"), a number written as a JSON string in ``config_kwargs``, and a
    ``client_kwargs.verify`` of ``"false"``/``"true"``, which botocore reads as the path of a CA bundle. Why: the
    options are often merged from two places (a cluster-wide variable and a job's flag), and the clash came out
    at the first publishing step, naming neither."""
    shown = mask_url(root)

    def refuse(message: str) -> StorageError:
        return StorageError(f"cannot open {shown}: {message}", uri=shown, op="open")

    for name in ("client_kwargs", "config_kwargs"):
        if options.get(name) is not None and not isinstance(options[name], dict):
            raise refuse(f"storage_options.{name} must be an object (a JSON dict), not {type(options[name]).__name__}")
    client = options.get("client_kwargs") or {}
    for top, nested in _S3_CLIENT_TWINS.items():
        a, b = options.get(top), client.get(nested)
        if a is not None and b is not None and a != b:
            values = f" ({mask_url(str(a))!r} and {mask_url(str(b))!r})" if top == "endpoint_url" else ""
            raise refuse(f"storage_options.{top} and client_kwargs.{nested} are both given, with different "
                         f"values{values}: s3fs would hand botocore both and fail to connect; keep one "
                         "(where the options are merged from a flag and a variable, spell it the same way in both)")
    verify = client.get("verify")
    if isinstance(verify, str) and verify.strip().lower() in _FLAG_WORDS:
        raise refuse(f"storage_options.client_kwargs.verify is the string {verify!r}, which botocore reads as the "
                     "path of a CA bundle: give a JSON boolean (false turns certificate checks off), or the path of "
                     "a CA bundle file")
    if verify is not None and not isinstance(verify, (bool, str)):
        raise refuse(f"storage_options.client_kwargs.verify must be true, false (JSON booleans) or the path of a CA "
                     f"bundle, not {type(verify).__name__} {verify!r}")
    config = options.get("config_kwargs") or {}
    try:  # botocore checks a Config's values (a retry mode it does not know) when it is built, offline
        from botocore.config import Config
    except ImportError:
        Config = None
    if config and Config is not None:
        try:
            Config(**config)
        except Exception as exc:  # noqa: BLE001 - botocore's own words name what is wrong
            raise refuse(f"storage_options.config_kwargs is refused by botocore: {type(exc).__name__}: {exc}") \
                from None
    for where, holder in (("", options), ("client_kwargs.", client), ("config_kwargs.", config)):
        region = holder.get("region_name")
        if region is not None and not isinstance(region, str):
            raise refuse(f"storage_options.{where}region_name must be a string (e.g. \"us-east-1\"), not "
                         f"{type(region).__name__} {region!r}")
    for key, unit in _S3_CONFIG_NUMBERS.items():
        value = config.get(key)
        whole = key == "max_pool_connections"
        if value is not None and (isinstance(value, bool) or not isinstance(value, int if whole else (int, float))
                                  or not value > 0):
            raise refuse(f"storage_options.config_kwargs.{key} must be a positive {'whole ' if whole else ''}number "
                         f"({unit}), not {type(value).__name__} {value!r}: botocore fails on it only at the first "
                         "request")


def _check_flags(root: str, options: dict[str, Any], flags: set[str], backend: str) -> None:
    """Refuse a true/false option given as anything but a bool: s3fs and gcsfs test it for truth, so the string
    ``"false"`` (easily written in a JSON variable) turns it on."""
    not_flags = sorted(k for k in options if k in flags and not isinstance(options[k], bool))
    if not_flags:
        key, shown = not_flags[0], mask_url(root)
        raise StorageError(f"cannot open {shown}: storage_options.{key} must be true or false (a JSON boolean), not "
                           f"{type(options[key]).__name__} {options[key]!r}: {backend} takes any non-empty value for "
                           "true", uri=shown, op="open")


def _gcs_kwargs_options(cls: type) -> set[str]:
    """The keywords gcsfs's default class (``ExtendedGcsFileSystem``) reads from its ``**kwargs`` rather than its
    signature: the documented ``retry_timeout``, ``retry_initial``, ``retry_maximum``, ``retry_multiplier`` (its
    Storage Control API retries) and ``memmove_max_workers``. The plain ``GCSFileSystem`` (with
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``) reads none of them, and fsspec would drop them without a word."""
    try:
        from gcsfs.extended_gcsfs import ExtendedGcsFileSystem
        from gcsfs.retry import DEFAULT_RETRY_CONFIG
    except ImportError:
        return set()
    if not (isinstance(cls, type) and issubclass(cls, ExtendedGcsFileSystem)):
        return set()
    return {f"retry_{k}" for k in DEFAULT_RETRY_CONFIG} | {"memmove_max_workers"}


#: The upload checks gcsfs knows; it takes any other ``consistency`` for "none" and checks nothing.
_GCS_CONSISTENCY = ("none", "size", "md5", "crc32c")
#: Strings a JSON variable carries for a flag: gcsfs would send them as the billing project of every request.
_FLAG_WORDS = frozenset({"true", "false", "0", "1", "yes", "no", "on", "off"})


def _gcs_crc32c_available() -> bool:
    """gcsfs's crc32c check needs ``crcmod``, which ``gcsfs.checkers`` imports when it loads; without it the
    first write fails, after the step's tensors were gathered. A gcsfs that no longer imports crcmod is trusted."""
    try:
        checkers = importlib.import_module("gcsfs.checkers")
    except ImportError:
        return True
    return getattr(checkers, "crcmod", True) is not None


def _check_gcs_options(root: str, options: dict[str, Any], flags: set[str]) -> None:
    """Refuse what gcsfs would take the wrong way without a word: a flag given as a string (``"version_aware":
    "false"`` turns version-aware mode on); a ``requester_pays`` of ``"false"``, which gcsfs sends as the billing
    project (``userProject=false``) of every request; a ``consistency`` it does not know (``"crc32"`` checks
    nothing) or cannot run (``"crc32c"`` without crcmod fails at the first write); a retry setting that is not a
    number, which fails only when a request is retried."""
    shown = mask_url(root)
    _check_flags(root, options, flags - {"requester_pays"}, "gcsfs")
    if "requester_pays" in options:
        pays = options["requester_pays"]
        if isinstance(pays, str) and pays.strip().lower() in _FLAG_WORDS:
            raise StorageError(f"cannot open {shown}: storage_options.requester_pays is the string {pays!r}, which "
                               f"gcsfs would send as the project to bill (userProject={pays}) on every request: give "
                               "a JSON boolean (true bills the credentials' project), or the id of the project to "
                               "bill", uri=shown, op="open")
        if not isinstance(pays, bool) and (not isinstance(pays, str) or not pays or any(c.isspace() for c in pays)):
            raise StorageError(f"cannot open {shown}: storage_options.requester_pays must be true, false (JSON "
                               "booleans) or the id of the project to bill (a string without spaces), not "
                               f"{type(pays).__name__} {pays!r}", uri=shown, op="open")
    if options.get("consistency") is not None:  # null: gcsfs's default, no check (as retry_* of null)
        check = options["consistency"]
        if not isinstance(check, str) or check not in _GCS_CONSISTENCY:
            close = difflib.get_close_matches(str(check).lower(), _GCS_CONSISTENCY, n=1)
            raise StorageError(f"cannot open {shown}: storage_options.consistency must be one of "
                               f"{', '.join(map(repr, _GCS_CONSISTENCY))}, not {check!r}"
                               + (f" (did you mean {close[0]!r}?)" if close else "")
                               + ": gcsfs takes any other value for 'none' and checks no upload", uri=shown, op="open")
        if check == "crc32c" and not _gcs_crc32c_available():
            raise StorageError(f"cannot open {shown}: storage_options.consistency 'crc32c' needs the crcmod package, "
                               "which gcsfs cannot import here (the first write would fail): pip install crcmod "
                               "(gcsfs's [crc] extra), or choose 'md5'", uri=shown, op="open")
    for key in sorted(k for k in options if k.startswith("retry_") and options[k] is not None):
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise StorageError(f"cannot open {shown}: storage_options.{key} must be a positive number (seconds, or "
                               f"the multiplier for retry_multiplier), not {type(value).__name__} {value!r}",
                               uri=shown, op="open")


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
    if scheme in LOCAL_PROTOCOLS:  # file://~/x writes where ~/x does: fsspec expands the ~
        return os.path.realpath(os.path.expanduser(rest))
    scheme = _SAME_BACKEND.get(scheme, scheme)
    options = options or {}
    nested = options.get("client_kwargs") if isinstance(options.get("client_kwargs"), dict) else {}
    endpoint = options.get("endpoint_url") or nested.get("endpoint_url") or (
        os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") if scheme == "s3" else None)
    return f"{scheme}://{rest.rstrip('/')}" + (f" at {str(endpoint).rstrip('/')}" if endpoint else "")
