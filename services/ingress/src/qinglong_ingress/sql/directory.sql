-- Statements of directory.py, run as the worker-ingress role (reads identity, writes audit).

-- name: operator_by_uri
SELECT p.principal_id, p.kind, p.name, c.credential_id
  FROM qinglong.operator_credentials c JOIN qinglong.principals p USING (principal_id)
 WHERE c.certificate_uri = %s AND c.status = 'active' AND p.status = 'active'
   AND p.kind IN ('user', 'agent')
   AND (c.expires_at_ms IS NULL OR c.expires_at_ms > qinglong.db_now_ms())

-- name: operator_by_credential_digest
-- The token's credential_id goes into the call's audit row: a token's last use (ListTokens)
-- is read from the audit, as ingress writes no identity table.
SELECT p.principal_id, p.kind, p.name, c.credential_id
  FROM qinglong.operator_credentials c JOIN qinglong.principals p USING (principal_id)
 WHERE c.token_digest = %s AND c.status = 'active' AND p.status = 'active'
   AND p.kind IN ('user', 'agent')
   AND (c.expires_at_ms IS NULL OR c.expires_at_ms > qinglong.db_now_ms())

-- name: is_cluster_admin
SELECT EXISTS (SELECT 1 FROM qinglong.cluster_admins WHERE principal_id = %s)

-- name: role_binding
SELECT pr.version AS project_version, rb.role, rb.version AS binding_version
  FROM qinglong.projects pr
  JOIN qinglong.role_bindings rb ON rb.project_id = pr.project_id
 WHERE pr.project_id = %s AND rb.principal_id = %s
   AND pr.status = 'active' AND rb.status = 'active'

-- name: write_audit
-- One row on its own, touching nothing else: the audit of a Worker's call whose
-- write_audits statement failed (the failure may be its identity or session read).
INSERT INTO qinglong.security_audit
       (audit_id, principal_kind, principal_id, operation, outcome, reason, project_id,
        run_id, worker_id, session_id, request_id, peer, credential_id)
VALUES (%(audit_id)s, %(principal_kind)s, %(principal_id)s, %(operation)s, %(outcome)s,
        %(reason)s, %(project_id)s, %(run_id)s, %(worker_id)s, %(session_id)s,
        %(request_id)s, %(peer)s, %(credential_id)s)

-- name: write_audits
-- A batch of calls' audit rows in one autocommit statement: one round trip, one commit
-- (R-PERF-1). The rows arrive as one JSON array (one parameter: cheaper to send than
-- a column array each). A row with a certificate_uri is a Worker's call: the same statement checks
-- that the certificate names an enrolled, active Worker, that the call speaks for that
-- Worker and for a session of its own, and records what it found. The refusal numbers
-- are directory.ClaimRefusal's; %(refused_outcome)s and %(refused_reason)s are indexed
-- by them. A row's credential_id is the bearer token that authenticated the call, if one
-- did (ListTokens reads a token's last use from it). An unenrolled certificate outranks any refusal ingress recorded (as when
-- authentication came first); the binding is judged only for a call ingress admitted.
WITH call AS (
    SELECT *
      FROM jsonb_to_recordset(%(calls)s::jsonb)
           AS c(audit_id uuid, principal_kind text, principal_id text, operation text,
                outcome text, reason text, project_id text, run_id uuid, worker_id text,
                session_id uuid, request_id text, peer text, certificate_uri text,
                credential_id uuid)
), judged AS (
    SELECT c.*, w.worker_id AS enrolled_worker,
           CASE WHEN c.certificate_uri IS NULL THEN NULL
                WHEN w.worker_id IS NULL THEN 1
                WHEN c.outcome <> 'admitted' THEN NULL
                WHEN w.worker_id IS DISTINCT FROM c.worker_id THEN 2
                WHEN c.session_id IS NOT NULL
                     AND s.worker_id IS DISTINCT FROM w.worker_id THEN 3
           END AS refusal
      FROM call c
      LEFT JOIN qinglong.worker_identities w
             ON w.certificate_uri = c.certificate_uri AND w.status = 'active'
      LEFT JOIN qinglong.worker_sessions s ON s.session_id = c.session_id
), written AS (
    INSERT INTO qinglong.security_audit
           (audit_id, principal_kind, principal_id, operation, outcome, reason, project_id,
            run_id, worker_id, session_id, request_id, peer, credential_id)
    SELECT audit_id,
           CASE WHEN certificate_uri IS NULL THEN principal_kind
                WHEN enrolled_worker IS NULL THEN 'anonymous'
                ELSE 'worker' END,
           CASE WHEN certificate_uri IS NULL THEN principal_id ELSE enrolled_worker END,
           operation,
           COALESCE((%(refused_outcome)s::text[])[refusal], outcome),
           COALESCE((%(refused_reason)s::text[])[refusal], reason),
           project_id, run_id, worker_id, session_id, request_id, peer,
           -- A Worker's call is authenticated by its certificate: no token (0022).
           CASE WHEN certificate_uri IS NULL THEN credential_id END
      FROM judged
)
-- A data-modifying WITH runs to completion whether or not it is read (and RETURNING
-- would need a SELECT grant on the audit the ingress role must not have): the rows
-- come back only if every one was written.
SELECT audit_id, refusal, enrolled_worker FROM judged
