-- 0022: which operator token authenticated a call, so ListTokens can say when each was
-- last used (R-ADM-1).
--
-- Ingress cannot write identity tables, so a token's last use is not kept on its row: it
-- is read from the security audit, which ingress writes for every call. A call
-- authenticated by a bearer token records the token's id (operator_credentials
-- .credential_id); every other call (a Worker's or an operator's certificate, an
-- anonymous or unauthenticated caller) records NULL. No foreign key: an audit insert must
-- never lock or read a credential row, and the audit outlives nothing it names.
-- A token's last use is gone with its newest row when retention removes it (0013).
--
-- NOT VALID: the CHECK holds for every row written from now on without reading the
-- existing ones (all NULL) under a lock that would stop every call's audit.
--
-- Its index is built by 0023, concurrently (audit writes go on meanwhile).

ALTER TABLE qinglong.security_audit
    ADD COLUMN credential_id uuid,
    ADD CONSTRAINT security_audit_credential_is_an_operators
        CHECK (credential_id IS NULL OR principal_kind IN ('user', 'agent')) NOT VALID;

-- Ingress's INSERT is column-level (0015: occurred_at_ms is the database's).
GRANT INSERT (credential_id) ON qinglong.security_audit TO qinglong_ingress;
