"""How large PostgreSQL's text of a jsonb value is, for tests of bounds that measure it."""

from __future__ import annotations

import json
from collections.abc import Mapping


def jsonb_text_bytes(labels: Mapping[str, str]) -> int:
    """The size of PostgreSQL's jsonb text of ``labels`` (``", "`` and ``": "``
    separators; ``"`` and ``\\`` escaped, other printable characters as they are)."""
    return len(json.dumps(dict(labels), ensure_ascii=False, separators=(", ", ": ")).encode())
