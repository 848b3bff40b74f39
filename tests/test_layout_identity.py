"""Snapshot identities: what validate_identity accepts and refuses (each accepted name one safe path segment on
POSIX and Windows), and new_identity's format and per-process session, a forked child's included."""
from __future__ import annotations

import ntpath
import os
import posixpath
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_hotload.identity import new_identity, process_session, validate_identity


WINDOWS_DEVICES = {"CON", "PRN", "AUX", "NUL", *(f"{p}{d}" for p in ("COM", "LPT") for d in range(10))}


def _windows_device(value: str) -> bool:
    return value.split(".")[0].upper() in WINDOWS_DEVICES


@pytest.mark.parametrize("good", ["step-000040-a1b2c3d4", "a", "x" * 128, "run_1.step-2", "A.B..C", "-x", "con-1",
                                  "console", "COM10", "x.nul", "aux_0"])
def test_validate_identity_accepts(good: str) -> None:
    assert validate_identity(good) == good


@pytest.mark.parametrize(
    "bad, rule",
    [
        ("", "must not be empty"),
        ("x" * 129, "the limit is 128"),
        (".", "'.' or '..'"),
        ("..", "'.' or '..'"),
        ("a/b", "single path segment"),
        ("a\\b", "must not contain"),
        (".hidden", "must not start with '.'"),
        ("step 1", "may only use"),
        ("step\n1", "may only use"),
        ("stép", "may only use"),
        ("a:b", "may only use"),
        (None, "must be a string"),
        ("step-1.", "must not end with '.'"),
        ("a..", "must not end with '.'"),
        ("CON", "Windows device name CON"),
        ("nul", "Windows device name NUL"),
        ("Aux.txt", "Windows device name AUX"),
        ("prn.tar.gz", "Windows device name PRN"),
        ("com1", "Windows device name COM1"),
        ("LPT9.step-1", "Windows device name LPT9"),
    ],
)
def test_validate_identity_rejects(bad: object, rule: str) -> None:
    with pytest.raises(ValueError, match=rf"^identity .*: .*{re.escape(rule)}"):
        validate_identity(bad)  # type: ignore[arg-type]


def _is_single_safe_segment(value: str) -> bool:
    root = "/srv/bucket/deployment"
    joined = posixpath.normpath(posixpath.join(root, value))
    return (
        PurePosixPath(value).parts == (value,)
        and PureWindowsPath(value).parts == (value,)
        and posixpath.dirname(joined) == root
        and ntpath.basename(ntpath.normpath(ntpath.join("C:\\b", value))) == value
        and value not in (".", "..")
        and not value.startswith(".")
        and not value.endswith(".")
        and not _windows_device(value)
        and value.isascii()
        and value.isprintable()
        and "%" not in value
    )


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.text(alphabet="./\\-_aZ9 \x00é:"), st.from_regex(r"[A-Za-z0-9._-]{1,130}"),
                 st.from_regex(r"(?i)(con|prn|aux|nul|com\d|lpt\d)(\.[a-z0-9.]{0,5})?", fullmatch=True)))
def test_anything_validate_identity_accepts_is_one_safe_path_segment(value: str) -> None:
    try:
        validate_identity(value)
    except ValueError:
        return
    assert _is_single_safe_segment(value), value


@settings(max_examples=200, deadline=None)
@given(st.from_regex(r"[A-Za-z0-9_-]([A-Za-z0-9._-]{0,126}[A-Za-z0-9_-])?", fullmatch=True)
       .filter(lambda v: not _windows_device(v)))
def test_every_well_formed_identity_is_accepted(value: str) -> None:
    assert validate_identity(value) == value


def test_new_identity_format_and_session() -> None:
    session = process_session()
    assert re.fullmatch(r"[0-9a-f]{8}", session)
    ident = new_identity(40)
    assert ident == f"step-000040-{session}"
    assert new_identity(41) == f"step-000041-{session}"
    assert new_identity(1234567, prefix="ckpt", session="run7") == "ckpt-1234567-run7"
    assert validate_identity(new_identity(0)) == f"step-000000-{session}"
    with pytest.raises(ValueError, match="step must be"):
        new_identity(-1)
    with pytest.raises(ValueError, match="step must be"):
        new_identity(True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix 'a/b': .*single path segment"):
        new_identity(1, prefix="a/b")
    with pytest.raises(ValueError, match="session '': must not be empty"):
        new_identity(1, session="")
    with pytest.raises(ValueError, match="session 'run-1': must not contain '-'"):
        new_identity(1, session="run-1")  # retention would take "1" for its session, and keep its snapshots
    with pytest.raises(ValueError, match="the limit is 128"):
        new_identity(1, prefix="p" * 120)


def test_new_identity_differs_between_processes() -> None:
    code = "from fsdp_hotload.identity import new_identity; print(new_identity(40))"
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    other = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    theirs = other.stdout.strip()
    assert re.fullmatch(r"step-000040-[0-9a-f]{8}", theirs)
    assert theirs != new_identity(40)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_makes_its_own_session() -> None:
    mine = process_session()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report its session and exit without running pytest teardown
        try:
            os.write(write_fd, process_session().encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        child = fh.read().decode()
    os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{8}", child) and child != mine
    assert process_session() == mine
