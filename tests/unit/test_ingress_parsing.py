"""Ingress's request parsing: bounds before work. Bytes over a method's cap are never
parsed (the size stage refuses them, audited, as REQUEST_TOO_LARGE); bytes within it are
parsed, and bytes that do not parse become a violation, not a transport error."""

from __future__ import annotations

import pytest
from qinglong_ingress.handlers import _parser
from qinglong_ingress.routes import ROUTES, Route
from qinglong_ingress.validation import REQUEST_BYTE_CAPS


def route(name: str) -> Route:
    (found,) = [route for route in ROUTES if route.name == name]
    return found


@pytest.mark.parametrize("name", ["ControlLease", "CreateTask"])
def test_bytes_over_the_cap_are_not_parsed(name: str) -> None:
    chosen = route(name)
    cap = REQUEST_BYTE_CAPS[chosen.full_method]
    garbage = b"\xff" * (cap + 1)  # would not parse either: no violation is looked for
    over = _parser(chosen)(garbage)
    assert (over.message, over.size, over.undecodable) == (None, cap + 1, None)
    within = _parser(chosen)(b"\xff" * cap)
    assert within.message is None
    assert within.undecodable is not None, "bytes within the cap are parsed (and refused)"
    empty = _parser(chosen)(b"")
    assert empty.message == chosen.request_type()
