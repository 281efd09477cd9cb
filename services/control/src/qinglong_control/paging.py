"""Opaque keyset page tokens: one encoding for every list this server pages through.

A token is the unpadded base64url of the cursor's parts joined by ``:`` (no part can
hold a ``:``: epoch milliseconds, canonical UUIDs and slugs). Parsing accepts exactly
the spelling :func:`page_token` produces: one cursor has one token, and a cursor no
server could have issued (a time outside 0..2^53-1 ms, which would overflow the query's
bigint; a UUID spelled another way) is refused here as FIELD_INVALID naming the field,
never by the database.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from qinglong_protocol import bounds

from qinglong_control.domain.refusals import Reason, Refused

#: Turns one part's text back into its value, or raises ValueError.
Part = Callable[[str], object]

Row = TypeVar("Row")
Key = TypeVar("Key")


def read_limit(page_size: int) -> int:
    """A list reads one row more than a page: whether it came says whether another page
    follows, so the last page's token is empty, as the contracts say (and a full last
    page does not hand out a token that leads to nothing)."""
    return page_size + 1


def keyset_page(
    rows: Sequence[Row], page_size: int, key: Callable[[Row], Key]
) -> tuple[list[Row], Key | None]:
    """``rows`` read with :func:`read_limit`: the page, and the key of its last row when
    another page follows (None on the last page)."""
    page = list(rows[:page_size])
    return page, key(page[-1]) if len(rows) > page_size and page else None


def epoch_ms(text: str) -> int:
    value = int(text)
    if not bounds.is_safe_non_negative(value):
        raise ValueError("not a time this server records")
    return value


def slug(text: str) -> str:
    if not bounds.is_slug(text):
        raise ValueError("not a slug")
    return text


def page_token(cursor: Sequence[object] | None) -> str:
    """The token of ``cursor`` (the last row of a page); "" when there is no next page."""
    if cursor is None:
        return ""
    text = ":".join(str(part) for part in cursor).encode()
    return base64.urlsafe_b64encode(text).decode("ascii").rstrip("=")


def parse_page_token(token: str, parts: Sequence[Part], field: str) -> tuple[object, ...] | None:
    """The cursor of a token this server issued, with ``parts`` as its shape; None for ""."""
    if not token:
        return None
    refused = Refused(Reason.FIELD_INVALID, f"{field} is not one this server issued", field=field)
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode("ascii")
        pieces = text.split(":", len(parts) - 1)
        if len(pieces) != len(parts):
            raise refused
        cursor = tuple(part(piece) for part, piece in zip(parts, pieces, strict=True))
    except (ValueError, UnicodeDecodeError):  # binascii.Error is a ValueError
        raise refused from None
    if page_token(cursor) != token:
        raise refused
    return cursor


def time_and_id(token: str, field: str = "page_token") -> tuple[int, uuid.UUID] | None:
    """A ``(created or occurred at ms, uuid)`` cursor: Runs, Tasks, principals, audit records."""
    cursor = parse_page_token(token, (epoch_ms, uuid.UUID), field)
    # The parts are what the converters above return.
    return None if cursor is None else cast(tuple[int, uuid.UUID], cursor)


def time_and_slug(token: str, field: str = "page_token") -> tuple[int, str] | None:
    """A ``(created at ms, slug)`` cursor: projects."""
    cursor = parse_page_token(token, (epoch_ms, slug), field)
    return None if cursor is None else cast(tuple[int, str], cursor)


def after_slug(token: str, field: str = "page_token") -> str | None:
    """A ``slug`` cursor: Workers, by worker id."""
    cursor = parse_page_token(token, (slug,), field)
    return None if cursor is None else cast(str, cursor[0])
