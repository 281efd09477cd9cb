"""`<service> probe`: a liveness/readiness probe that speaks mutual TLS.

Kubelet's built-in gRPC probe cannot present a client certificate, and both servers
require one. So the pod runs this command, which asks its own server's health service
over mTLS with the pod's own certificate (read from the same `<PREFIX>TLS_*` variables
as the server). Exit 0 on SERVING, 1 otherwise, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from qinglong_protocol.health import health_status
from qinglong_protocol.tls import TlsFiles


def run_probe(
    argv: Sequence[str],
    *,
    program: str,
    env_prefix: str,
    default_listen_address: str,
    environ: Mapping[str, str] | None = None,
) -> int:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=f"{program} probe")
    listen = env.get(f"{env_prefix}LISTEN_ADDRESS", default_listen_address)
    port = listen.rsplit(":", 1)[-1]
    parser.add_argument(
        "--address",
        action="append",
        help=f"a listener to ask; repeat for several, all must serve [127.0.0.1:{port}]",
    )
    parser.add_argument("--server-name", default="localhost")
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout", type=float, default=2.0)
    for name in ("ca", "cert", "key"):
        variable = f"{env_prefix}TLS_{name.upper()}"
        parser.add_argument(f"--tls-{name}", default=env.get(variable), help=f"[{variable}]")
    args = parser.parse_args(argv)
    if not (args.tls_ca and args.tls_cert and args.tls_key):
        parser.error("the server's TLS files are required (the same variables as the server)")
    tls = TlsFiles(ca_cert=Path(args.tls_ca), cert=Path(args.tls_cert), key=Path(args.tls_key))
    serving = True
    for address in args.address or [f"127.0.0.1:{port}"]:
        status = asyncio.run(
            health_status(
                address, tls, args.timeout, service=args.service, server_name=args.server_name
            )
        )
        print(f"{program} {address}: {status}")
        serving = serving and status == "SERVING"
    return 0 if serving else 1
