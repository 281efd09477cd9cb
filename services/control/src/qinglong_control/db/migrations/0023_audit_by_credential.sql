-- qinglong: outside-transaction
-- 0023: a token's audit rows by time, for its last use (0022, ListTokens).
--
-- Partial: a Worker's call (the hot path) writes NULL and pays nothing for it. Built
-- CONCURRENTLY (db/migrate.py): a plain CREATE INDEX would stop every audit write — every
-- call ingress admits — while it reads the audit, though it holds no entry yet.

DROP INDEX CONCURRENTLY IF EXISTS qinglong.security_audit_by_credential;
CREATE INDEX CONCURRENTLY security_audit_by_credential
    ON qinglong.security_audit (credential_id, occurred_at_ms)
 WHERE credential_id IS NOT NULL;
