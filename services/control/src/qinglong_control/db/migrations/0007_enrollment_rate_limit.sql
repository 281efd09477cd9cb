-- 0007: an audit row may record that ingress refused a call for its rate limit.
--
-- The Worker enrollment listener (R-ADM-2) accepts calls without a client certificate,
-- so ingress limits how often a peer may try a join token and audits every refusal with
-- the gRPC code it answered (RESOURCE_EXHAUSTED -> 'rate_limited';
-- qinglong_ingress.audit.AuditOutcome is the one definition in code, compared with this
-- CHECK by a test, and with the AdminService's AuditOutcome enum by another).

ALTER TABLE qinglong.security_audit DROP CONSTRAINT security_audit_outcome_check;
ALTER TABLE qinglong.security_audit ADD CONSTRAINT security_audit_outcome_check CHECK (
    outcome IN ('admitted', 'require_approval', 'unauthenticated', 'permission_denied',
                'invalid_argument', 'unavailable', 'internal', 'rate_limited'));
