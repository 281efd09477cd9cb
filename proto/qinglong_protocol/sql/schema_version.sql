-- Statements of qinglong_protocol/schema_version.py.

-- name: applied
-- The highest migration the database has applied (migration 0014's function; the
-- runtime role may call it since 0014, the worker-ingress role since 0024).
SELECT qinglong.schema_version()
