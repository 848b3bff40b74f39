"""The byte-format doc (which ``hotload diff --help`` users are pointed to) and the emulator's docstring cite only
files that exist in this repository: a reader following a citation must find it."""
from __future__ import annotations

import re
from pathlib import Path

import fsdp_hotload.emulator
import fsdp_hotload.fireworks

REPO = Path(__file__).resolve().parents[1]


def _cited_paths(text: str) -> set[str]:
    """Markdown link targets and backquoted names of files (``*.py``/``*.md``), with any ``::test`` suffix cut."""
    links = re.findall(r"\]\(([^)#\s]+)", text)
    quoted = re.findall(r"`+([\w./-]+\.(?:py|md))(?:::\w+)?`+", text)
    return {p for p in [*links, *quoted] if not p.startswith(("http://", "https://"))}


def test_format_doc_cites_only_files_in_the_repository() -> None:
    doc = REPO / "docs" / "FORMAT.md"
    cited = _cited_paths(doc.read_text())
    assert "fsdp_hotload/arc/zstd_seq.py" in cited  # the default arc_v2 encoder is the one described
    for path in sorted(cited):
        assert (doc.parent / path).exists() or (REPO / path).exists(), f"docs/FORMAT.md cites missing {path}"


def test_emulator_and_client_docstrings_cite_only_files_in_the_repository() -> None:
    for module in (fsdp_hotload.emulator, fsdp_hotload.fireworks):
        for path in sorted(_cited_paths(module.__doc__ or "")):
            assert (REPO / path).exists() or (REPO / "docs" / path).exists(), f"{module.__name__} cites {path}"
