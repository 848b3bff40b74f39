"""Compiled-kernel caches kept in step with every source file they were built from, not only their own.

Why: numba's ``cache=True`` rebuilds a function when its own file changes, but compiled code includes the
functions it calls from other modules (``seq_delta``'s kernels call ``kernels``'s). After an edit of a callee's
file alone (a ``git pull`` on an editable install), callers kept running the old code from the cache, while the
block path, compiled from the new file, ran the new one. Here the caches of a package's kernels are emptied
whenever any of the package's sources differs from what they were built from (a digest kept beside them).

Example::

    from fsdp_hotload.arc import jit_cache, kernels, seq_delta
    jit_cache.refresh([kernels, seq_delta], Path(kernels.__file__).parent)   # at import, before any call
"""
from __future__ import annotations

import hashlib
import logging
import types
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger("fsdp_hotload")
MARKER = "hotload-jit-sources.sha256"
#: The modules :func:`refresh` has been given in this process, by name: what checks that none was left out read.
refreshed: set[str] = set()


def cached_kernels(modules: Iterable[types.ModuleType]) -> list[Any]:
    """The functions compiled with ``cache=True`` that ``modules`` define (not those they import)."""
    out = []
    for mod in modules:
        for value in vars(mod).values():
            cache = getattr(value, "_cache", None)
            py_func = getattr(value, "py_func", None)
            if (cache is not None and hasattr(cache, "flush") and getattr(cache, "cache_path", None)
                    and py_func is not None and py_func.__module__ == mod.__name__):
                out.append(value)
    return out


def refresh(modules: Iterable[types.ModuleType], sources: Path) -> int:
    """Empty the caches of ``modules``' kernels unless they were built from the ``*.py`` files of ``sources`` as
    they are now; returns how many were emptied. Best effort: a cache that cannot be read or written is left to
    numba, which then compiles as it would anyway."""
    modules = list(modules)
    refreshed.update(m.__name__ for m in modules)
    try:
        digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes()
                                         for p in sorted(sources.glob("*.py")))).hexdigest()
        by_path: dict[str, list[Any]] = {}
        for fn in cached_kernels(modules):
            by_path.setdefault(str(fn._cache.cache_path), []).append(fn)
    except Exception:  # noqa: BLE001 - numba's internals or an unreadable source: nothing to refresh
        log.debug("hotload: kernel caches not checked", exc_info=True)
        return 0
    emptied = 0
    for path, fns in by_path.items():
        marker = Path(path) / MARKER
        try:
            if marker.read_text() == digest:
                continue
        except OSError:
            pass
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            for fn in fns:
                fn._cache.flush()
                emptied += 1
            marker.write_text(digest)
        except Exception:  # noqa: BLE001 - a read-only cache folder: numba does not write there either
            log.debug("hotload: could not refresh the kernel caches in %s", path, exc_info=True)
    return emptied
