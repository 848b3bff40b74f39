"""The one-line errors of ``hotload`` with no command and of ``hotload emulate`` on a port already in use."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from fsdp_hotload.cli import main


def test_no_command_names_the_missing_argument_as_usage_shows_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "hotload: error: the following arguments are required: COMMAND", err
    assert "usage: hotload [-h] COMMAND" in err


def test_emulate_on_a_port_in_use_says_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["emulate", "--bucket", str(tmp_path), "--port", str(port)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"hotload emulate: error: cannot listen on 127.0.0.1:{port}: "), line
    assert "Address already in use" in line and line.endswith("; pick another --port, or 0 for a free one"), line
