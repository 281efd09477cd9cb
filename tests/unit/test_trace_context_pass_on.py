"""What a hop that records no spans passes on of a caller's trace context (W3C only)."""

from __future__ import annotations

import pytest
from qinglong_protocol.telemetry import (
    TRACESTATE_MAX_CHARS,
    TRACESTATE_MAX_MEMBERS,
    trace_context_of,
)

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_w3c_trace_context_passes_on_unchanged() -> None:
    metadata = (
        ("authorization", "Bearer secret"),
        ("traceparent", PARENT),
        ("tracestate", "congo=t61rcWkgMzE,rojo@vendor=00f067aa0ba902b7"),
    )
    assert trace_context_of(metadata) == (
        ("traceparent", PARENT),
        ("tracestate", "congo=t61rcWkgMzE,rojo@vendor=00f067aa0ba902b7"),
    )


def test_bytes_values_and_a_missing_tracestate() -> None:
    assert trace_context_of((("traceparent", PARENT.encode()),)) == (("traceparent", PARENT),)
    assert trace_context_of((("other", "x"),)) == ()
    assert trace_context_of(None) == ()


@pytest.mark.parametrize(
    "parent",
    [
        PARENT.upper(),  # W3C ids are lowercase hex
        PARENT + "-extra",  # version 00 has exactly four fields
        PARENT[:-1],
        "01" + PARENT[2:],  # a version this hop does not know
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",  # all-zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",  # all-zero parent id
        PARENT + "\n" + "injected log line",
        "",
    ],
)
def test_a_malformed_traceparent_is_dropped_with_its_tracestate(parent: str) -> None:
    assert trace_context_of((("traceparent", parent), ("tracestate", "congo=t61rcWkgMzE"))) == ()


def test_two_traceparents_are_dropped() -> None:
    other = PARENT.replace("b7ad", "c7ad")
    assert trace_context_of((("traceparent", PARENT), ("traceparent", other))) == ()


@pytest.mark.parametrize(
    "state",
    [
        "congo=" + "x" * TRACESTATE_MAX_CHARS,  # longer than W3C asks anyone to carry
        ",".join(f"k{n}=v" for n in range(TRACESTATE_MAX_MEMBERS + 1)),
        "congo=a,congo=b",  # a key twice
        "Congo=a",  # keys are lowercase
        "congo=a=b",  # "=" is not allowed in a value
        "congo=tab\tinside",
        "congo=\x7f",
        "congo",
    ],
)
def test_a_malformed_tracestate_is_dropped_alone(state: str) -> None:
    assert trace_context_of((("traceparent", PARENT), ("tracestate", state))) == (
        ("traceparent", PARENT),
    )


def test_repeated_tracestate_fields_are_one_list() -> None:
    """RFC 9110: repeated fields are one list joined with ","; empty members are allowed
    and dropped; the bounds apply to the whole list."""
    metadata = (("traceparent", PARENT), ("tracestate", "a=1, ,"), ("tracestate", "b=2"))
    assert trace_context_of(metadata) == (("traceparent", PARENT), ("tracestate", "a=1,b=2"))
    many = [("tracestate", f"k{n}=v") for n in range(TRACESTATE_MAX_MEMBERS + 1)]
    assert trace_context_of((("traceparent", PARENT), *many)) == (("traceparent", PARENT),)
