"""What `configure_telemetry` installs, by environment: each case in a fresh interpreter
(OpenTelemetry's global providers can be set once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
from opentelemetry import metrics, trace
from qinglong_protocol.telemetry import configure_telemetry
configure_telemetry("probe")
print(type(trace.get_tracer_provider()).__module__, type(metrics.get_meter_provider()).__module__)
"""


def _installed(env: dict[str, str]) -> tuple[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    output = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    return output[0], output[1]


@pytest.mark.parametrize(
    ("env", "traces_sdk", "metrics_sdk"),
    [
        ({}, False, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, True, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True, False),
        ({"OTEL_METRICS_EXPORTER": "otlp"}, False, True),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4317", "OTEL_SDK_DISABLED": "true"},
            False,
            False,
        ),
    ],
    ids=["nothing", "endpoint", "traces", "metrics", "disabled"],
)
def test_an_sdk_provider_is_installed_only_for_what_is_exported(
    env: dict[str, str], traces_sdk: bool, metrics_sdk: bool
) -> None:
    """Without an exporter nothing is recorded to be thrown away: the API's no-op
    providers stay (they still pass a caller's trace context on)."""
    tracer, meter = _installed(env)
    assert tracer.startswith("opentelemetry.sdk") == traces_sdk, tracer
    assert meter.startswith("opentelemetry.sdk") == metrics_sdk, meter
