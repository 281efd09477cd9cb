-- Statements of db/authority.py.

-- name: lock_authority
-- The fixed lock order and DB time, in one statement (the function, migration 0012).
SELECT * FROM qinglong.lock_authority(%s, %s, %s)
