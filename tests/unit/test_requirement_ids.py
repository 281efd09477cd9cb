"""The repository explains itself: every requirement id the code, tests, deployment or
benchmarks cite is listed in docs/requirements.md (ranges such as R-LC-1…7 and
wildcards such as R-CONV-* are written by their prefix)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITED_IN = ("services", "proto/qinglong_protocol", "clients", "tests", "deploy", "bench", "docs")
SUFFIXES = {".py", ".md", ".sql", ".yaml", ".proto"}
REQUIREMENT = re.compile(r"\b[RB]-[A-Z]+(?:-[0-9]+)?\b")


def _cited() -> dict[str, Path]:
    cited: dict[str, Path] = {}
    for folder in CITED_IN:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in SUFFIXES and ".venv" not in path.parts and path.is_file():
                for found in REQUIREMENT.findall(path.read_text(errors="replace")):
                    cited.setdefault(found, path)
    return cited


def test_every_cited_requirement_is_listed() -> None:
    listed_text = (ROOT / "docs" / "requirements.md").read_text()
    listed = set(REQUIREMENT.findall(listed_text))
    prefixes = {name.rsplit("-", 1)[0] for name in listed if name.count("-") == 2}
    missing = {
        name: str(path.relative_to(ROOT))
        for name, path in _cited().items()
        if name not in listed and name not in prefixes
    }
    assert not missing, f"cited but not in docs/requirements.md: {missing}"
