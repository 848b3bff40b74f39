"""Snapshot identities: the directory name of a snapshot under the bucket, and the name it is signalled by.

An identity becomes ``<bucket>/<identity>/`` on every storage backend and on Windows receivers, so it must be one
path segment no backend interprets; every snapshot needs a new one, also across trainer restarts, so the names
carry a random session part.

Example::

    validate_identity("step-000040-a1b2c3d4")     # returns it; raises ValueError naming the rule otherwise
    new_identity(41, session="a1b2c3d4")          # 'step-000041-a1b2c3d4'
"""
from __future__ import annotations

import os
import re
import secrets
import threading

MAX_IDENTITY_LEN = 128

_SEGMENT_CHARS = re.compile(r"[A-Za-z0-9._-]+")
# Device names Windows reserves in every folder, also with an extension ("nul.txt" opens the NUL device).
_WINDOWS_DEVICES = frozenset({"CON", "PRN", "AUX", "NUL", *(f"{p}{d}" for p in ("COM", "LPT") for d in range(10))})
_session_lock = threading.Lock()
_session: tuple[int, str] | None = None  # (pid that made it, 8 hex digits)


def _segment_problem(value: object, max_len: int = MAX_IDENTITY_LEN) -> str | None:
    if not isinstance(value, str):
        return f"must be a string, not {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > max_len:
        return f"is {len(value)} characters long, the limit is {max_len}"
    if value in (".", ".."):
        return "must not be '.' or '..'"
    if "/" in value:
        return "must be a single path segment (no '/')"
    if "\\" in value:
        return "must not contain '\\'"
    if value.startswith("."):
        return "must not start with '.'"
    if not _SEGMENT_CHARS.fullmatch(value):
        bad = next(c for c in value if not _SEGMENT_CHARS.fullmatch(c))
        return f"may only use A-Z a-z 0-9 '.' '_' '-' (found {bad!r})"
    return None


def _windows_problem(value: str) -> str | None:
    """What makes a name Windows cannot store as a folder of that exact name (None if nothing)."""
    if value.endswith("."):
        return "must not end with '.' (Windows drops trailing dots)"
    device = value.split(".", 1)[0].upper()
    if device in _WINDOWS_DEVICES:
        return f"must not be the Windows device name {device}, with or without an extension"
    return None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def validate_identity(identity: str, *, what: str = "identity") -> str:
    """Return ``identity`` if it is a safe snapshot directory name, else raise ValueError naming the rule.

    The identity becomes ``<bucket>/<identity>/`` on every storage backend and on Windows receivers, so it must
    be one path segment that no backend interprets: non-empty, at most 128 characters of ``[A-Za-z0-9._-]``,
    not starting with ``.`` (hidden files, ``.``, ``..``), not ending with ``.`` and not a Windows device name
    (``CON``, ``PRN``, ``AUX``, ``NUL``, ``COM0``-``COM9``, ``LPT0``-``LPT9``, also as in ``nul.txt``).
    """
    problem = _segment_problem(identity)
    if problem is None:
        problem = _windows_problem(identity)
    if problem is not None:
        raise ValueError(f"{what} {_short(identity)}: {problem}")
    return identity


def process_session() -> str:
    """The random 8-hex-digit session id of this process, made on first use (and again after a fork).

    In a multi-rank job every rank is its own process: make identities on one rank and broadcast them, or pass
    the same ``session`` to :func:`new_identity` on every rank.
    """
    global _session
    with _session_lock:
        if _session is None or _session[0] != os.getpid():
            _session = (os.getpid(), secrets.token_hex(4))
        return _session[1]


def new_identity(step: int, *, prefix: str = "step", session: str | None = None) -> str:
    """A fresh identity such as ``step-000040-a1b2c3d4``: prefix, zero-padded step, trainer session id.

    The session part keeps a reused deployment (or bucket) from ever seeing an earlier run's names again; it
    defaults to :func:`process_session`. Zero padding keeps identities of one session sorted by step.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    for label, value in (("prefix", prefix), ("session", session)):
        problem = None if value is None else _segment_problem(value)
        if problem is None and label == "session" and value is not None and "-" in value:
            # retention reads a snapshot's session back as its identity's last "-" field
            problem = "must not contain '-' (the identity's last '-' field is the session)"
        if problem is not None:
            raise ValueError(f"{label} {_short(value)}: {problem}")
    return validate_identity(f"{prefix}-{step:06d}-{session if session is not None else process_session()}")
