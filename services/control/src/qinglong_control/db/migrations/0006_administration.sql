-- 0006: administration (docs/decisions/0002-administration.md, R-ADM-1..3).
--
-- * A fourth role, qinglong_admin, writes the identity tables and nothing else: the
--   runtime role keeps its grants (a runtime bug cannot grant itself a role), the
--   ingress role still only reads identity. The role must exist before this runs, like
--   the other three (created by the cluster administrator / bootstrap).
-- * qinglong.cluster_admins: who may call AdminService. Not a project role.
-- * AIP-155 request ids on every create, so a retried create answers with what the
--   first one made instead of making a second one.
-- * Operator tokens keep a short recognisable prefix and the token they replace (a
--   rotation); Worker join tokens are stored as digests only, single use.

GRANT USAGE ON SCHEMA qinglong TO qinglong_admin;
GRANT EXECUTE ON FUNCTION qinglong.db_now_ms() TO qinglong_admin;

------------------------------------------------------------------------------------------
-- Cluster admins.
------------------------------------------------------------------------------------------

-- A principal is a cluster admin while a row names it (and it is active: a disabled
-- principal authenticates nowhere). No role holds DELETE: a grant is ended by disabling
-- the principal, and the row stays for the record.
CREATE TABLE qinglong.cluster_admins (
    principal_id   uuid PRIMARY KEY REFERENCES qinglong.principals (principal_id),
    granted_at_ms  qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms()
);

------------------------------------------------------------------------------------------
-- Idempotent creates. NULL on rows made before this migration or by enrollment tooling.
------------------------------------------------------------------------------------------

ALTER TABLE qinglong.projects
    ADD COLUMN create_request_id text UNIQUE
        CHECK (create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$');

ALTER TABLE qinglong.principals
    ADD COLUMN create_request_id text UNIQUE
        CHECK (create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$');

ALTER TABLE qinglong.worker_identities
    ADD COLUMN create_request_id text UNIQUE
        CHECK (create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$');

-- IssueToken's request id is scoped to the principal, RotateToken's to the token it
-- replaces (admin_service.proto). A token is replaced at most once: a second successor
-- would keep two secrets alive for one rotation.
ALTER TABLE qinglong.operator_credentials
    ADD COLUMN issue_request_id text
        CHECK (issue_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    -- "qlo1_" and the next 6 characters: enough to tell tokens apart, far too short to use.
    ADD COLUMN token_prefix text
        CHECK (token_prefix ~ '^qlo1_[A-Za-z0-9_-]{6}$'),
    ADD COLUMN replaces_credential_id uuid UNIQUE
        REFERENCES qinglong.operator_credentials (credential_id),
    ADD CONSTRAINT operator_credentials_prefix_of_token
        CHECK (token_prefix IS NULL OR kind = 'bearer_token'),
    ADD CONSTRAINT operator_credentials_rotation_has_request
        CHECK (replaces_credential_id IS NULL OR issue_request_id IS NOT NULL);

CREATE UNIQUE INDEX operator_credentials_issue_request
    ON qinglong.operator_credentials (principal_id, issue_request_id)
    WHERE issue_request_id IS NOT NULL AND replaces_credential_id IS NULL;

------------------------------------------------------------------------------------------
-- Worker join tokens (R-ADM-2): one-time, short-lived, digest only.
------------------------------------------------------------------------------------------

CREATE TABLE qinglong.worker_join_tokens (
    token_digest   qinglong.sha256_hex PRIMARY KEY,
    worker_id      qinglong.slug NOT NULL REFERENCES qinglong.worker_identities (worker_id),
    created_at_ms  qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms(),
    expires_at_ms  qinglong.epoch_ms NOT NULL,
    used_at_ms     qinglong.epoch_ms,
    CONSTRAINT worker_join_tokens_expire_after_creation CHECK (expires_at_ms > created_at_ms),
    CONSTRAINT worker_join_tokens_used_after_creation
        CHECK (used_at_ms IS NULL OR used_at_ms >= created_at_ms)
);

CREATE INDEX worker_join_tokens_by_worker
    ON qinglong.worker_join_tokens (worker_id, created_at_ms);

-- Single use, whoever writes: a join token may be marked used once, and nothing else
-- about it ever changes.
CREATE FUNCTION qinglong.enforce_join_token_single_use() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.used_at_ms IS NOT NULL
       OR (NEW.token_digest, NEW.worker_id, NEW.created_at_ms, NEW.expires_at_ms)
          IS DISTINCT FROM
          (OLD.token_digest, OLD.worker_id, OLD.created_at_ms, OLD.expires_at_ms) THEN
        RAISE EXCEPTION 'join token of worker % is used or fixed', OLD.worker_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'worker_join_tokens_single_use';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER worker_join_tokens_enforce_single_use BEFORE UPDATE ON qinglong.worker_join_tokens
    FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_join_token_single_use();

------------------------------------------------------------------------------------------
-- The fleet view (ListWorkers) counts each Worker's live Attempts.
------------------------------------------------------------------------------------------

CREATE INDEX attempts_live_by_worker ON qinglong.attempts (worker_id)
    WHERE state IN ('claimed', 'starting', 'running');

------------------------------------------------------------------------------------------
-- Grants. No DELETE anywhere; nothing new for the runtime role.
------------------------------------------------------------------------------------------

GRANT SELECT, INSERT, UPDATE ON qinglong.projects, qinglong.principals,
                                qinglong.operator_credentials, qinglong.role_bindings,
                                qinglong.worker_identities, qinglong.worker_join_tokens,
                                qinglong.cluster_admins
    TO qinglong_admin;
-- What the fleet and audit views read.
GRANT SELECT ON qinglong.worker_sessions, qinglong.attempts, qinglong.security_audit
    TO qinglong_admin;

-- Ingress admits an AdminService call only for a cluster admin; it reads, never writes.
GRANT SELECT ON qinglong.cluster_admins TO qinglong_ingress;
