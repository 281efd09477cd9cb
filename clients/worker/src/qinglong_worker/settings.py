"""Worker settings from flags over `QINGLONG_WORKER_*` environment variables."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from qinglong_protocol.tls import TlsFiles

ENV_PREFIX = "QINGLONG_WORKER_"


@dataclass(frozen=True)
class WorkerSettings:
    worker_id: str
    ingress_address: str
    tls: TlsFiles


def parse_worker_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[str, WorkerSettings]:
    """(command, settings). A dev stack file may stand in for every connection flag."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="qinglong-worker", description="QingLong Worker: pulls, starts and reports Runs."
    )
    parser.add_argument("command", choices=["check"], help="check: is ingress serving us?")
    parser.add_argument("--stack", type=Path, help="read everything below from a stack.json")
    for name in ("worker-id", "ingress-address", "tls-ca", "tls-cert", "tls-key"):
        variable = ENV_PREFIX + name.upper().replace("-", "_")
        parser.add_argument(f"--{name}", default=env.get(variable), help=f"or ${variable}")
    args = parser.parse_args(argv)
    if args.stack is not None:
        stack = json.loads(args.stack.read_text())
        args.worker_id = args.worker_id or stack["worker"]["worker_id"]
        args.ingress_address = args.ingress_address or stack["ingress"]["address"]
        args.tls_ca = args.tls_ca or stack["ca_cert"]
        args.tls_cert = args.tls_cert or stack["worker"]["cert"]
        args.tls_key = args.tls_key or stack["worker"]["key"]
    missing = [
        name
        for name in ("worker_id", "ingress_address", "tls_ca", "tls_cert", "tls_key")
        if not getattr(args, name)
    ]
    if missing:
        parser.error("missing " + ", ".join("--" + m.replace("_", "-") for m in missing))
    tls = TlsFiles(ca_cert=Path(args.tls_ca), cert=Path(args.tls_cert), key=Path(args.tls_key))
    return args.command, WorkerSettings(args.worker_id, args.ingress_address, tls)
