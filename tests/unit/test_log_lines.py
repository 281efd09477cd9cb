"""A service's log line written inside a recorded span names the trace and span, so a
line found on one pod leads to the call's whole trace; outside one it names none."""

from __future__ import annotations

import io
import logging
import re

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from qinglong_protocol.serving import log_handler


def _logged(tracer_provider: TracerProvider | None) -> str:
    stream = io.StringIO()
    logger = logging.getLogger("qinglong.test.log_lines")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = log_handler(stream)
    logger.addHandler(handler)
    try:
        if tracer_provider is None:
            logger.info("outside")
        else:
            with tracer_provider.get_tracer("test").start_as_current_span("call") as span:
                logger.info("inside")
                context = span.get_span_context()
                stream.write(f"expected {context.trace_id:032x} {context.span_id:016x}\n")
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_a_line_inside_a_recorded_span_names_it() -> None:
    line, expected = _logged(TracerProvider()).splitlines()
    _, trace_id, span_id = expected.split()
    assert re.search(rf"qinglong\.test\.log_lines: trace={trace_id} span={span_id} inside$", line)


def test_a_line_outside_one_names_none() -> None:
    (outside,) = _logged(None).splitlines()
    assert outside.endswith("qinglong.test.log_lines: outside")
    unsampled, _ = _logged(TracerProvider(sampler=ALWAYS_OFF)).splitlines()
    assert "trace=" not in unsampled
