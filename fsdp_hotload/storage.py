"""Storage: a small protocol over URI strings, backed by fsspec, with retries tuned for object stores.

Why this layer exists: the publisher writes tens of large objects per snapshot from background threads, and
object stores fail in ways that need different answers. A dropped connection deserves a quick retry; an S3
``SlowDown`` means the prefix is over its request rate, and retrying fast only makes it worse, so throttling
backs off from a longer base; a permission error will not fix itself and must surface at once. Every operation
takes a path relative to one root URI (the deployment's bucket prefix), so callers never build URIs by hand.

Backends: local paths (``/tmp/x``, ``file://``), ``memory://``, ``s3://`` (s3fs; MinIO/Nebius through
``endpoint_url``) and ``gs://`` (gcsfs). s3fs and gcsfs are optional and imported only when a root needs them.

Local writes go to a hidden temporary name in the target directory and are renamed into place, so a reader
never sees a torn file. Object stores give the same guarantee natively (an object appears when its PUT or its
multipart upload completes); there is no rename there, which is why a snapshot is marked complete by writing
its commit marker last (see :mod:`fsdp_hotload.retention`).

Example::

    st = Storage("s3://bucket/acct/acct-dep", {"endpoint_url": "http://127.0.0.1:9000"})
    st.put_many({"step-4-a1b2/config.json": b"{}", "step-4-a1b2/model-00000.safetensors": payload})
    st.put_file("step-4-a1b2/model-00001.safetensors", "/scratch/shard1.safetensors")   # multipart when large
    assert st.list("step-4-a1b2") == ["config.json", ...]  # relpaths below the prefix, sorted
    print(st.stats.throttled, st.stats.bytes_put)
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import random
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, TypeVar

import fsspec
import fsspec.core

from .errors_storage import (  # noqa: F401  (re-exported: the public home of these names is this module)
    ErrorClass,
    MissingBackendError,
    StorageError,
    backend_install_hint,
    backoff_delay,
    classify_error,
)

if TYPE_CHECKING:
    from .retention import FileInfo

__all__ = [
    "Storage",
    "StorageStats",
    "StorageError",
    "MissingBackendError",
    "ErrorClass",
    "classify_error",
    "backoff_delay",
    "backend_install_hint",
    "TMP_PREFIX",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Hidden prefix of the temporary names used for atomic local writes; ``list`` never reports such files.
TMP_PREFIX = ".hotload-tmp-"
#: S3 rejects multipart parts under 5 MiB (except the last one).
MIN_PART_SIZE = 5 * 2**20
# Protocols whose writable files only become visible when closed, so streaming into them is safe.
_OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs"})
_MEMORY_PROTOCOLS = frozenset({"memory"})
_COPY_BLOCK = 8 * 2**20
