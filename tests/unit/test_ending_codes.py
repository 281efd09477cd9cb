"""The ending codes are written once (domain/ending_codes.py) and explained once, in
docs/protocol.md's "Ending codes" table: the two hold the same codes."""

from __future__ import annotations

import re
from pathlib import Path

from qinglong_control.domain import ending_codes
from qinglong_protocol.bounds import is_error_code

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def declared_codes() -> set[str]:
    return {
        value
        for name, value in vars(ending_codes).items()
        if name.isupper() and isinstance(value, str)
    }


def documented_codes() -> set[str]:
    section = PROTOCOL.read_text().split("### Ending codes", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", section, flags=re.MULTILINE))


def test_every_ending_code_is_explained_and_every_explained_code_exists() -> None:
    declared = declared_codes()
    assert len(declared) >= 7
    assert documented_codes() == declared


def test_each_code_is_its_own_name_and_fits_the_contract() -> None:
    for name, value in vars(ending_codes).items():
        if name.isupper() and isinstance(value, str):
            assert value == name
            assert is_error_code(value)
