-- 0005: an audit row may record that ingress answered a call INTERNAL.
--
-- Ingress audits every call it answers itself, by the gRPC code of its answer
-- (qinglong_ingress.audit.AuditOutcome, the one definition in code; a test compares it
-- with this CHECK). A storage failure that is neither transient nor a mapped constraint
-- (a revoked grant, a broken statement) is answered INTERNAL by the storage rule both
-- services share, and such a refusal is audited like any other.

ALTER TABLE qinglong.security_audit DROP CONSTRAINT security_audit_outcome_check;
ALTER TABLE qinglong.security_audit ADD CONSTRAINT security_audit_outcome_check CHECK (
    outcome IN ('admitted', 'require_approval', 'unauthenticated', 'permission_denied',
                'invalid_argument', 'unavailable', 'internal'));
