-- Statements of directory.py, run as the worker-ingress role (reads identity, writes audit).

-- name: worker_by_uri
SELECT worker_id FROM qinglong.worker_identities
 WHERE certificate_uri = %s AND status = 'active'

-- name: operator_by_uri
SELECT p.principal_id, p.kind, p.name
  FROM qinglong.operator_credentials c JOIN qinglong.principals p USING (principal_id)
 WHERE c.certificate_uri = %s AND c.status = 'active' AND p.status = 'active'
   AND p.kind IN ('user', 'agent')
   AND (c.expires_at_ms IS NULL OR c.expires_at_ms > qinglong.db_now_ms())

-- name: operator_by_credential_digest
SELECT p.principal_id, p.kind, p.name
  FROM qinglong.operator_credentials c JOIN qinglong.principals p USING (principal_id)
 WHERE c.token_digest = %s AND c.status = 'active' AND p.status = 'active'
   AND p.kind IN ('user', 'agent')
   AND (c.expires_at_ms IS NULL OR c.expires_at_ms > qinglong.db_now_ms())

-- name: is_cluster_admin
SELECT EXISTS (SELECT 1 FROM qinglong.cluster_admins WHERE principal_id = %s)

-- name: session_owner
SELECT worker_id FROM qinglong.worker_sessions WHERE session_id = %s

-- name: role_binding
SELECT pr.version AS project_version, rb.role, rb.version AS binding_version
  FROM qinglong.projects pr
  JOIN qinglong.role_bindings rb ON rb.project_id = pr.project_id
 WHERE pr.project_id = %s AND rb.principal_id = %s
   AND pr.status = 'active' AND rb.status = 'active'

-- name: write_audit
INSERT INTO qinglong.security_audit
       (audit_id, principal_kind, principal_id, operation, outcome, reason, project_id,
        run_id, worker_id, session_id, request_id, peer)
VALUES (%(audit_id)s, %(principal_kind)s, %(principal_id)s, %(operation)s, %(outcome)s,
        %(reason)s, %(project_id)s, %(run_id)s, %(worker_id)s, %(session_id)s,
        %(request_id)s, %(peer)s)
