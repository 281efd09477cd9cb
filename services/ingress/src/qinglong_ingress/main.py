"""`qinglong-ingress`: run the public ingress service until SIGTERM or SIGINT.

This module imports nothing that imports grpc: grpc reads GRPC_SSL_CIPHER_SUITES once,
while `import grpc` runs, so the TLS 1.2 restriction (transport_security.py) must be in
the environment before that. Everything else lives in `service.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from qinglong_ingress.transport_security import apply_tls12_cipher_restriction


def main(argv: Sequence[str] | None = None) -> None:
    apply_tls12_cipher_restriction()
    from qinglong_ingress.service import run

    run(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
