"""`qinglong-ingress probe` works against the dev certificates (its own server identity is
also a client identity), as the Kubernetes probes use it."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tests.support.stack import Stack

QINGLONG_INGRESS = Path(sys.executable).with_name("qinglong-ingress")


async def test_ingress_probe_with_its_own_dev_certificate_reports_serving(stack: Stack) -> None:
    tls = stack.pki.ingress_server
    process = await asyncio.create_subprocess_exec(
        str(QINGLONG_INGRESS),
        "probe",
        "--address",
        stack.ingress_address,
        "--tls-ca",
        str(tls.ca_cert),
        "--tls-cert",
        str(tls.cert),
        "--tls-key",
        str(tls.key),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 0, err.decode()
    assert out.decode().strip().endswith(": SERVING")
