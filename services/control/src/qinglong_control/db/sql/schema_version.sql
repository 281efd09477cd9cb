-- Statements of db/schema_version.py.

-- name: applied
-- The highest migration the database has applied (the function, migration 0014).
SELECT qinglong.schema_version()
