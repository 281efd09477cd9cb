"""Statements both services run (ingress and control read the same migration record)."""

from __future__ import annotations

from typing import Final

from qinglong_protocol.sql_catalogue import SqlCatalogue

SQL: Final = SqlCatalogue(__name__)
