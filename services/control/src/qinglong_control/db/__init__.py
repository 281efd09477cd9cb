"""Database access of the runtime service: migrations, role bootstrap and (later) the repository.

This package is the only place in the project that speaks SQL to the runtime schema.
"""
