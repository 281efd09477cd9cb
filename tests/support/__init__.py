"""Shared test support: real embedded PostgreSQL clusters, TLS material, helpers."""
