"""TLS 1.3 only on the public endpoint: a cipher-suite restriction plus a per-call check.

grpcio has no option for a minimum TLS version, so ingress combines two measures:

1. **No TLS 1.2 handshake can complete.** The ingress server certificate carries an
   RSA key (qinglong_cli.pki issues RSA server certificates on purpose). A TLS 1.2
   cipher suite is bound to the type of the server key, a TLS 1.3 suite is not, and
   BoringSSL (grpcio's TLS library) takes its TLS 1.2 suites from the
   ``GRPC_SSL_CIPHER_SUITES`` variable while its TLS 1.3 suites are fixed. Naming
   only ECDSA TLS 1.2 suites there leaves a TLS 1.2 client nothing it can agree on
   with an RSA server key: the server logs ``NO_SHARED_CIPHER`` and closes the
   connection, while TLS 1.3 handshakes are unaffected. This is a configuration
   trick, not an API; tests/integration/test_ingress_tls.py pins it on real sockets.
   It is void with an ECDSA server key, which is why measure 2 exists.

2. **No call is served over anything but TLS 1.3.** `is_acceptable_transport` reads
   the negotiated version from the call's ``auth_context()``; ingress answers
   UNAUTHENTICATED (reason TLS_VERSION_REJECTED) when it is false.

When grpc reads the variable (measured with grpcio 1.85.3): exactly once, while
``import grpc`` runs. gRPC core keeps its configuration variables in a process-wide
object filled on first use (``grpc_core::ConfigVars``), and loading grpc's native
module uses it. Setting the variable after ``import grpc``, even before any server,
credentials or channel exists, has no effect at all. So
`apply_tls12_cipher_restriction` must run before anything in the process imports
grpc, and it refuses to run afterwards. It therefore lives in this module, which
imports nothing of grpc (keep it that way).

The restriction is process-wide: it applies to the process's client channels too
(ingress's channel to control). Those negotiate TLS 1.3 with any grpc server and
keep working; only a peer limited to TLS 1.2 with an RSA key would be refused.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping, MutableMapping

CIPHER_SUITES_VARIABLE = "GRPC_SSL_CIPHER_SUITES"

# The TLS 1.2 suites ingress allows: forward-secret AEAD suites authenticated by an
# ECDSA server key. With the RSA server certificate none of them can be negotiated.
ECDSA_TLS12_CIPHER_SUITES = (
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
)
RESTRICTED_CIPHER_SUITES = ":".join(ECDSA_TLS12_CIPHER_SUITES)

# TLS 1.3 suite names are harmless in the variable (grpc's own default lists them;
# BoringSSL does not let them be configured), so an operator value may carry them.
# The list must still name at least one TLS 1.2 suite: grpc refuses to create server
# credentials from a list of TLS 1.3 names only ("Invalid cipher list").
TLS13_CIPHER_SUITES = (
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
)

# OpenSSL and BoringSSL accept ":", "," and " " between the entries of a cipher list.
_CIPHER_LIST_SEPARATORS = re.compile(r"[:, ]+")

# Key of the negotiated protocol version in grpc's auth context; the same key as
# qinglong_protocol.tls.AUTH_KEY_TLS_VERSION, repeated so that this module stays
# free of grpc imports.
AUTH_KEY_TLS_VERSION = "ssl_tls_version"
TLS_VERSION_REQUIRED = "TLSv1.3"


class TransportSecurityError(RuntimeError):
    """The TLS 1.2 restriction cannot be put in place; the process must not serve."""


def apply_tls12_cipher_restriction(
    environ: MutableMapping[str, str] = os.environ,
) -> str:
    """Limit grpc's TLS 1.2 cipher suites to ECDSA ones and return the value in force.

    Call it first thing in the ingress process, before any module imports grpc (see
    the module docstring). An operator may preset ``GRPC_SSL_CIPHER_SUITES``; a value
    that names only ECDSA AEAD TLS 1.2 suites (optionally plus TLS 1.3 suite names) is
    kept, anything else raises rather than silently serving weaker than intended.
    Raises `TransportSecurityError` when grpc has already been imported, because the
    variable would then be ignored.
    """
    current = environ.get(CIPHER_SUITES_VARIABLE)
    if current is not None:
        check_cipher_suites(current)
    if "grpc" in sys.modules:
        raise TransportSecurityError(
            f"{CIPHER_SUITES_VARIABLE} must be in place before grpc is imported: grpc reads "
            "it once, during `import grpc`, and this process has already imported grpc. "
            "Call apply_tls12_cipher_restriction() before any import of grpc or of a "
            "module that imports it."
        )
    if current is None:
        environ[CIPHER_SUITES_VARIABLE] = RESTRICTED_CIPHER_SUITES
        return RESTRICTED_CIPHER_SUITES
    return current


def check_cipher_suites(value: str) -> None:
    """Raise `TransportSecurityError` unless `value` would keep TLS 1.2 impossible with
    the RSA server certificate while still being a list grpc accepts."""
    entries = [entry for entry in _CIPHER_LIST_SEPARATORS.split(value.strip()) if entry]
    allowed = {*ECDSA_TLS12_CIPHER_SUITES, *TLS13_CIPHER_SUITES}
    rejected = [entry for entry in entries if entry not in allowed]
    if rejected:
        raise TransportSecurityError(
            f"{CIPHER_SUITES_VARIABLE} names {', '.join(map(repr, rejected))}: ingress "
            "accepts only the ECDSA TLS 1.2 suites "
            f"{', '.join(ECDSA_TLS12_CIPHER_SUITES)} (and TLS 1.3 suite names) there, "
            "so that no TLS 1.2 handshake can complete with its RSA certificate. "
            "Unset the variable to get the default."
        )
    if not any(entry in ECDSA_TLS12_CIPHER_SUITES for entry in entries):
        raise TransportSecurityError(
            f"{CIPHER_SUITES_VARIABLE} names no TLS 1.2 suite; grpc rejects such a list. "
            f"Name at least one of {', '.join(ECDSA_TLS12_CIPHER_SUITES)}, or unset it."
        )


def negotiated_tls_version(auth_context: Mapping[str, Iterable[bytes]]) -> str | None:
    """The TLS version of the call's connection (``"TLSv1.3"``, ``"TLSv1.2"``), read from
    `context.auth_context()`; None for an insecure call or an ambiguous entry."""
    values = list(auth_context.get(AUTH_KEY_TLS_VERSION) or ())
    if len(values) != 1:
        return None
    return values[0].decode("ascii", errors="replace")


def is_acceptable_transport(auth_context: Mapping[str, Iterable[bytes]]) -> bool:
    """True only when the call arrived over TLS 1.3; anything else is refused."""
    return negotiated_tls_version(auth_context) == TLS_VERSION_REQUIRED
