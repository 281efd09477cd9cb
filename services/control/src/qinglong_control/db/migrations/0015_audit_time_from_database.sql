-- 0015: an audit row's time is the database's.
--
-- Retention (0013) goes by a row's time. Ingress writes every column of an audit row but
-- `occurred_at_ms`, which takes DB time from its default: a row dated in the future would
-- never be removed, and one dated in the past would be removed before its time.

REVOKE INSERT ON qinglong.security_audit FROM qinglong_ingress;
GRANT INSERT (audit_id, principal_kind, principal_id, operation, outcome, reason, project_id,
              run_id, worker_id, session_id, request_id, peer)
    ON qinglong.security_audit TO qinglong_ingress;
