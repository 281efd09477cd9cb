"""Ingress's SQL catalogue: the statements of the worker-ingress role, by name."""

from __future__ import annotations

from typing import Final

from qinglong_protocol.sql_catalogue import SqlCatalogue

SQL: Final = SqlCatalogue(__name__)
