"""Named SQL statements kept as text in `.sql` files, loaded once and referenced by name.

A service keeps its statements in ``<package>/*.sql``, one file per area. In a file, each
statement starts at a header line ``-- name: <name>``; the comment lines right after the
header explain the statement, and the text up to the next header is the statement.
It is addressed as ``"<file stem>.<name>"``, e.g. ``SQL["authority.lock_authority"]``.

Statements are plain text with bound parameters (``%s`` / ``%(name)s``); nothing is ever
formatted into them. This module knows no driver (Workers install this package without
psycopg); it hands out ``LiteralString`` because the text comes only from files shipped
inside the package, never from input.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from importlib import resources
from typing import Final, LiteralString

_HEADER: Final = re.compile(r"^-- name: ([a-z][a-z0-9_]*)\s*$", re.MULTILINE)


class SqlCatalogue(Mapping[str, LiteralString]):
    """Every named statement of one package's ``.sql`` files."""

    def __init__(self, package: str) -> None:
        self._statements: dict[str, LiteralString] = {}
        for entry in sorted(resources.files(package).iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".sql"):
                self._load(entry.name.removesuffix(".sql"), entry.read_text(encoding="utf-8"))
        self._used: set[str] = set()

    def _load(self, area: str, text: str) -> None:
        headers = list(_HEADER.finditer(text))
        if not headers:
            raise ValueError(f"{area}.sql has no named statement")
        for header, following in zip(headers, [*headers[1:], None], strict=True):
            body = text[header.end() : following.start() if following else len(text)]
            statement = _strip_comments(body)
            name = f"{area}.{header[1]}"
            if not statement:
                raise ValueError(f"{name} is empty")
            if name in self._statements:
                raise ValueError(f"{name} is defined twice")
            self._statements[name] = statement  # mypy reads LiteralString as str

    def __getitem__(self, name: str) -> LiteralString:
        statement = self._statements[name]  # a KeyError names a statement that does not exist
        self._used.add(name)
        return statement

    def __iter__(self) -> Iterator[str]:
        return iter(self._statements)

    def __len__(self) -> int:
        return len(self._statements)

    def unused(self) -> set[str]:
        """Statements nobody looked up (so far): a test asserts none after importing all."""
        return set(self._statements) - self._used


def _strip_comments(body: str) -> str:
    """The statement without whole-line ``--`` comments and surrounding blank lines."""
    lines = [line for line in body.splitlines() if not line.lstrip().startswith("--")]
    return "\n".join(lines).strip() + "\n"
