-- Statements of schema.py.

-- name: version
-- The highest migration applied (migration 0014's function; ingress may call it since 0024).
SELECT qinglong.schema_version()
