-- Statements of db/audit_retention.py.

-- name: prune
-- One bounded step: at most `limit` of the oldest audit rows past the retention age
-- (the function, migration 0013, never removes a row younger than its floor).
SELECT qinglong.prune_security_audit(%(max_age_ms)s, %(limit)s)
