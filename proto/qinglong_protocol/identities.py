"""The SAN URIs that name QingLong identities, written once for every package.

Certificates name their holder with a SPIFFE-style URI under one trust domain; ingress
maps a Worker's certificate to its worker id by this URI, control records it when it
enrolls a Worker (AdminService.CreateWorker), and the development PKI issues it:

- ``spiffe://<td>/service/<service>`` -- a QingLong service (ingress, control);
- ``spiffe://<td>/worker/<worker_id>`` -- one Worker;
- ``spiffe://<td>/operator/<name>`` -- one operator.
"""

from __future__ import annotations

from typing import Final

#: The trust domain of a deployment that names none (ingress, control, the dev PKI).
DEFAULT_TRUST_DOMAIN: Final = "qinglong.local"


def service_uri(trust_domain: str, service: str) -> str:
    return f"spiffe://{trust_domain}/service/{service}"


def worker_uri(trust_domain: str, worker_id: str) -> str:
    return f"spiffe://{trust_domain}/worker/{worker_id}"


def operator_uri(trust_domain: str, name: str) -> str:
    return f"spiffe://{trust_domain}/operator/{name}"
