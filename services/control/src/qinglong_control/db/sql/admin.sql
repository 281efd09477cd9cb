-- Statements of db/admin.py (and the role-binding statements db/identities.py shares),
-- run as the admin role: it writes identity tables and only reads the fleet and audit.

-- name: lock_creates
-- Administration is rare: every create of one kind (project, principal, worker)
-- serialises on one lock, so its replay and taken-name reads see a settled table.
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.admin.create:' || %s, 0))

-- name: lock_project
-- Exclusive: a binding or project change waits for cancellations deciding under the
-- project (they hold it shared, cancellation.lock_project_shared), and they for it.
SELECT pg_advisory_xact_lock(hashtextextended(%s || %s, 0))

-- name: project
SELECT project_id, display_name, status, version, created_at_ms
  FROM qinglong.projects
 WHERE project_id = %s

-- name: project_by_request
SELECT project_id, display_name, status, version, created_at_ms
  FROM qinglong.projects
 WHERE create_request_id = %s

-- name: insert_project
INSERT INTO qinglong.projects (project_id, display_name, create_request_id, created_at_ms)
VALUES (%(project_id)s, %(display_name)s, %(request_id)s, %(now)s)
RETURNING project_id, display_name, status, version, created_at_ms

-- name: list_projects
-- Oldest first, keyset-paginated by (created_at_ms, project_id).
SELECT project_id, display_name, status, version, created_at_ms
  FROM qinglong.projects
 WHERE %(after_created)s::bigint IS NULL
    OR (created_at_ms, project_id) > (%(after_created)s, %(after_id)s::text)
 ORDER BY created_at_ms, project_id
 LIMIT %(limit)s

-- name: archive_project
-- The version advances so that an admission decided before fails ROLE_BINDING_FENCED.
UPDATE qinglong.projects SET status = 'archived', version = version + 1
 WHERE project_id = %s AND status = 'active'

-- name: principal
SELECT p.principal_id, p.kind, p.name, p.status, p.created_at_ms,
       EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                WHERE c.principal_id = p.principal_id) AS cluster_admin
  FROM qinglong.principals p
 WHERE p.principal_id = %s

-- name: principal_of_kinds
-- GetPrincipal: a user, agent or Worker (service principals have no kind on the wire and
-- are not shown, as in list_principals).
SELECT p.principal_id, p.kind, p.name, p.status, p.created_at_ms,
       EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                WHERE c.principal_id = p.principal_id) AS cluster_admin
  FROM qinglong.principals p
 WHERE p.principal_id = %s AND p.kind = ANY(%s::text[])

-- name: principal_by_request
SELECT p.principal_id, p.kind, p.name, p.status, p.created_at_ms,
       EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                WHERE c.principal_id = p.principal_id) AS cluster_admin
  FROM qinglong.principals p
 WHERE p.create_request_id = %s

-- name: principal_by_name
SELECT p.principal_id, p.kind, p.name, p.status, p.created_at_ms,
       EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                WHERE c.principal_id = p.principal_id) AS cluster_admin
  FROM qinglong.principals p
 WHERE p.kind = %s AND p.name = %s

-- name: lock_principal
-- Serialises token issues for, and changes of, one principal.
SELECT principal_id FROM qinglong.principals WHERE principal_id = %s FOR NO KEY UPDATE

-- name: insert_principal
INSERT INTO qinglong.principals (principal_id, kind, name, create_request_id, created_at_ms)
VALUES (%(principal_id)s, %(kind)s, %(name)s, %(request_id)s, %(now)s)

-- name: insert_cluster_admin
INSERT INTO qinglong.cluster_admins (principal_id, granted_at_ms) VALUES (%(principal_id)s, %(now)s)

-- name: active_cluster_admin
SELECT EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                 JOIN qinglong.principals p ON p.principal_id = c.principal_id
                WHERE p.status = 'active' AND p.kind = 'user')

-- name: other_active_cluster_admin
-- Whether an active user cluster admin other than this principal exists. Read under
-- lock_creates('principal'), which every change of who is an active cluster admin takes
-- (creates, bootstrap-admin, DisablePrincipal), so two disables cannot both count on
-- each other.
SELECT EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                 JOIN qinglong.principals p ON p.principal_id = c.principal_id
                WHERE c.principal_id <> %s AND p.status = 'active' AND p.kind = 'user')

-- name: caller_is_cluster_admin
-- The caller ingress admitted, as it is now: still an active user cluster admin.
SELECT EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                 JOIN qinglong.principals p ON p.principal_id = c.principal_id
                WHERE c.principal_id = %s AND p.status = 'active' AND p.kind = 'user')

-- name: list_principals
-- Oldest first, keyset-paginated by (created_at_ms, principal_id); service principals
-- have no kind on the wire and are not listed.
SELECT p.principal_id, p.kind, p.name, p.status, p.created_at_ms,
       EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                WHERE c.principal_id = p.principal_id) AS cluster_admin
  FROM qinglong.principals p
 WHERE p.kind = ANY(%(kinds)s::text[])
   AND (%(after_created)s::bigint IS NULL
        OR (p.created_at_ms, p.principal_id) > (%(after_created)s, %(after_id)s::uuid))
 ORDER BY p.created_at_ms, p.principal_id
 LIMIT %(limit)s

-- name: disable_principal
UPDATE qinglong.principals SET status = 'disabled' WHERE principal_id = %s AND status = 'active'

-- name: token
-- A token's last use is its newest audit row (migration 0022: ingress records the token
-- that authenticated each call; it writes no identity table), read backwards from the
-- partial index security_audit_by_credential; none once retention removed them all.
SELECT c.credential_id AS token_id, c.principal_id, c.token_prefix AS prefix, c.status,
       c.created_at_ms, c.expires_at_ms, u.last_used_at_ms
  FROM qinglong.operator_credentials c
 CROSS JOIN LATERAL (SELECT max(a.occurred_at_ms) AS last_used_at_ms
                       FROM qinglong.security_audit a
                      WHERE a.credential_id = c.credential_id) u
 WHERE c.credential_id = %s AND c.kind = 'bearer_token'

-- name: lock_token
-- Serialises the rotation and revocation of one token (only its row is locked; its last
-- use is read as in `token`).
SELECT c.credential_id AS token_id, c.principal_id, c.token_prefix AS prefix, c.status,
       c.created_at_ms, c.expires_at_ms, u.last_used_at_ms
  FROM qinglong.operator_credentials c
 CROSS JOIN LATERAL (SELECT max(a.occurred_at_ms) AS last_used_at_ms
                       FROM qinglong.security_audit a
                      WHERE a.credential_id = c.credential_id) u
 WHERE c.credential_id = %s AND c.kind = 'bearer_token'
   FOR NO KEY UPDATE OF c

-- name: token_by_issue_request
SELECT c.credential_id AS token_id, c.principal_id, c.token_prefix AS prefix, c.status,
       c.created_at_ms, c.expires_at_ms, u.last_used_at_ms
  FROM qinglong.operator_credentials c
 CROSS JOIN LATERAL (SELECT max(a.occurred_at_ms) AS last_used_at_ms
                       FROM qinglong.security_audit a
                      WHERE a.credential_id = c.credential_id) u
 WHERE c.principal_id = %s AND c.issue_request_id = %s AND c.replaces_credential_id IS NULL

-- name: successor
-- The token that replaced this one, with the request id that made it.
SELECT c.credential_id AS token_id, c.principal_id, c.token_prefix AS prefix, c.status,
       c.created_at_ms, c.expires_at_ms, u.last_used_at_ms, c.issue_request_id
  FROM qinglong.operator_credentials c
 CROSS JOIN LATERAL (SELECT max(a.occurred_at_ms) AS last_used_at_ms
                       FROM qinglong.security_audit a
                      WHERE a.credential_id = c.credential_id) u
 WHERE c.replaces_credential_id = %s

-- name: insert_token
INSERT INTO qinglong.operator_credentials
       (credential_id, principal_id, kind, token_digest, token_prefix, issue_request_id,
        replaces_credential_id, created_at_ms, expires_at_ms)
VALUES (%(token_id)s, %(principal_id)s, 'bearer_token', %(digest)s, %(prefix)s,
        %(request_id)s, %(replaces)s, %(now)s, %(expires)s)
RETURNING credential_id AS token_id, principal_id, token_prefix AS prefix, status,
          created_at_ms, expires_at_ms

-- name: list_tokens
-- Newest first; the digests never leave the database. Each listed token's last use (as in
-- `token`) is one backward read of the partial index: a LATERAL per token, after the
-- limit.
SELECT c.credential_id AS token_id, c.principal_id, c.token_prefix AS prefix, c.status,
       c.created_at_ms, c.expires_at_ms, u.last_used_at_ms
  FROM (SELECT credential_id, principal_id, token_prefix, status, created_at_ms,
               expires_at_ms
          FROM qinglong.operator_credentials
         WHERE principal_id = %s AND kind = 'bearer_token'
         ORDER BY created_at_ms DESC, credential_id DESC
         LIMIT %s) c
 CROSS JOIN LATERAL (SELECT max(a.occurred_at_ms) AS last_used_at_ms
                       FROM qinglong.security_audit a
                      WHERE a.credential_id = c.credential_id) u
 ORDER BY c.created_at_ms DESC, c.credential_id DESC

-- name: revoke_token
UPDATE qinglong.operator_credentials SET status = 'revoked'
 WHERE credential_id = %s AND status = 'active'

-- name: end_token
UPDATE qinglong.operator_credentials SET expires_at_ms = %(expires)s
 WHERE credential_id = %(token_id)s

-- name: binding
SELECT b.project_id, b.principal_id, b.role, b.status, b.version, b.updated_at_ms,
       p.name AS principal_name
  FROM qinglong.role_bindings b
  JOIN qinglong.principals p ON p.principal_id = b.principal_id
 WHERE b.project_id = %s AND b.principal_id = %s

-- name: upsert_binding
-- Grant or change; the version advances unless the binding already says exactly this
-- (SPEC R-CAN-3: a cancellation admitted under the old version is fenced).
INSERT INTO qinglong.role_bindings (project_id, principal_id, role)
VALUES (%(project_id)s, %(principal_id)s, %(role)s)
    ON CONFLICT (project_id, principal_id) DO UPDATE
   SET role = EXCLUDED.role, status = 'active',
       version = qinglong.role_bindings.version + 1,
       updated_at_ms = qinglong.db_now_ms()
 WHERE (qinglong.role_bindings.role, qinglong.role_bindings.status)
       IS DISTINCT FROM (EXCLUDED.role, 'active')

-- name: insert_binding_once
-- A binding that exists stays as it is (revoked stays revoked): provisioning that runs
-- again, such as `qinglong up`, never undoes an administrator's decision.
INSERT INTO qinglong.role_bindings (project_id, principal_id, role)
VALUES (%(project_id)s, %(principal_id)s, %(role)s)
    ON CONFLICT (project_id, principal_id) DO NOTHING

-- name: revoke_binding
UPDATE qinglong.role_bindings
   SET status = 'revoked', version = version + 1, updated_at_ms = qinglong.db_now_ms()
 WHERE project_id = %(project_id)s AND principal_id = %(principal_id)s AND status = 'active'

-- name: list_bindings
SELECT b.project_id, b.principal_id, b.role, b.status, b.version, b.updated_at_ms,
       p.name AS principal_name
  FROM qinglong.role_bindings b
  JOIN qinglong.principals p ON p.principal_id = b.principal_id
 WHERE b.project_id = %s
 ORDER BY b.principal_id
 LIMIT %s

-- name: worker_by_request
SELECT worker_id FROM qinglong.worker_identities WHERE create_request_id = %s

-- name: worker_taken
-- A worker id names both the identity and its principal: either taken is taken.
SELECT EXISTS (SELECT 1 FROM qinglong.worker_identities WHERE worker_id = %(worker_id)s)
    OR EXISTS (SELECT 1 FROM qinglong.principals
                WHERE kind = 'worker' AND name = %(worker_id)s)

-- name: insert_worker
INSERT INTO qinglong.worker_identities
       (worker_id, principal_id, certificate_uri, create_request_id, created_at_ms,
        project_ids)
VALUES (%(worker_id)s, %(principal_id)s, %(certificate_uri)s, %(request_id)s, %(now)s,
        %(project_ids)s)

-- name: inactive_projects
-- Which of the given project ids name no active project (projects are never deleted;
-- a disabled one is archived).
SELECT coalesce(array_agg(wanted ORDER BY wanted), '{}')
  FROM unnest(%s::text[]) AS wanted
 WHERE NOT EXISTS (SELECT 1 FROM qinglong.projects p
                    WHERE p.project_id = wanted AND p.status = 'active')

-- name: worker_exists
SELECT EXISTS (SELECT 1 FROM qinglong.worker_identities WHERE worker_id = %s)

-- name: set_worker_projects
UPDATE qinglong.worker_identities SET project_ids = %(project_ids)s
 WHERE worker_id = %(worker_id)s

-- name: set_worker_cordoned
UPDATE qinglong.worker_identities SET cordoned = %(cordoned)s
 WHERE worker_id = %(worker_id)s
RETURNING worker_id

-- name: insert_join_token
-- CreateWorker's token has no issue_request_id; IssueJoinToken's carries its request id.
INSERT INTO qinglong.worker_join_tokens
       (token_digest, worker_id, created_at_ms, expires_at_ms, issue_request_id)
VALUES (%(digest)s, %(worker_id)s, %(now)s, %(expires)s, %(issue_request_id)s)

-- name: lock_worker
-- Serialises IssueJoinToken for one Worker (one live join token at a time) and orders it
-- after DisableWorker, which updates the same row.
SELECT status FROM qinglong.worker_identities
 WHERE worker_id = %s
   FOR NO KEY UPDATE

-- name: join_request
-- The token an earlier IssueJoinToken with this request id issued (migration 0021).
SELECT expires_at_ms FROM qinglong.worker_join_tokens
 WHERE worker_id = %s AND issue_request_id = %s

-- name: supersede_join_tokens
-- A new join token ends every earlier one still usable: marked used (the only change
-- the single-use trigger allows), so a join racing this either consumed it first or
-- finds it used. Expired tokens are left as they are.
UPDATE qinglong.worker_join_tokens SET used_at_ms = %(now)s
 WHERE worker_id = %(worker_id)s AND used_at_ms IS NULL AND expires_at_ms > %(now)s

-- name: first_join_token_expiry
-- The join token CreateWorker made (the one without an IssueJoinToken request id), for a
-- retried create's answer.
SELECT expires_at_ms FROM qinglong.worker_join_tokens
 WHERE worker_id = %s AND issue_request_id IS NULL
 ORDER BY created_at_ms, token_digest
 LIMIT 1

-- name: disable_worker
-- The identity (ingress refuses the certificate from the next call on) and its principal.
WITH identity AS (
    UPDATE qinglong.worker_identities SET status = 'disabled'
     WHERE worker_id = %(worker_id)s AND status = 'active'
    RETURNING principal_id
)
UPDATE qinglong.principals SET status = 'disabled'
 WHERE principal_id IN (SELECT principal_id FROM identity) AND status = 'active'

-- name: fleet
-- Each Worker with its newest session, its live Attempts and how many sessions its id
-- has opened; remaining_ms is measured on DB time. Keyset-paginated by worker id.
SELECT w.worker_id, w.principal_id, w.status, w.created_at_ms, w.cordoned,
       w.project_ids::text[] AS project_ids,  -- an array of a domain reads as text otherwise
       s.session_id, s.status AS session_status, s.generation, s.renewed_at_ms,
       greatest(s.expires_at_ms - qinglong.db_now_ms(), 0) AS remaining_ms,
       s.agent_version, s.executor_types, s.max_concurrency, s.passes_run_parameters,
       s.labels,
       (SELECT count(*) FROM qinglong.attempts a
         WHERE a.worker_id = w.worker_id
           AND a.state IN ('claimed', 'starting', 'running')) AS live_attempts,
       (SELECT count(*) FROM qinglong.worker_sessions c
         WHERE c.worker_id = w.worker_id) AS session_count
  FROM qinglong.worker_identities w
  LEFT JOIN LATERAL (
        SELECT ws.session_id, ws.status, ws.generation, ws.renewed_at_ms, ws.expires_at_ms,
               ws.agent_version, ws.executor_types, ws.max_concurrency,
               ws.passes_run_parameters, ws.labels
          FROM qinglong.worker_sessions ws
         WHERE ws.worker_id = w.worker_id
         ORDER BY ws.generation DESC
         LIMIT 1) s ON true
 WHERE (%(worker_id)s::text IS NULL OR w.worker_id = %(worker_id)s)
   AND (%(after)s::text IS NULL OR w.worker_id > %(after)s)
 ORDER BY w.worker_id
 LIMIT %(limit)s

-- name: list_audit
-- Newest first, keyset-paginated by (occurred_at_ms, audit_id); every filter optional.
-- A user's or agent's name is read per listed row (after the limit) by primary key; the
-- CASE casts only an id of the uuid form, so no row (a Worker's name as its id, or an id
-- of any other form) can make the listing fail.
-- A JoinWorker call names no Worker (it is anonymous): the one its token enrolled, if
-- it spent one, is read from the token by the call's audit id (migration 0029).
SELECT audit_id, occurred_at_ms, principal_kind, principal_id, operation, outcome, reason,
       project_id, run_id,
       coalesce(worker_id, (SELECT t.worker_id FROM qinglong.worker_join_tokens t
                             WHERE t.used_by_audit_id = a.audit_id)) AS worker_id,
       peer,
       (SELECT p.name FROM qinglong.principals p
         WHERE p.principal_id = CASE
                 WHEN a.principal_kind IN ('user', 'agent') AND a.principal_id
                      ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
                 THEN a.principal_id::uuid END) AS principal_name
  FROM qinglong.security_audit a
 WHERE (%(principal_id)s::text IS NULL OR principal_id = %(principal_id)s)
   AND (%(operation)s::text IS NULL OR operation = %(operation)s)
   AND (%(outcome)s::text IS NULL OR outcome = %(outcome)s)
   AND (%(start_ms)s::bigint IS NULL OR occurred_at_ms >= %(start_ms)s)
   AND (%(end_ms)s::bigint IS NULL OR occurred_at_ms < %(end_ms)s)
   AND (%(before_at)s::bigint IS NULL
        OR (occurred_at_ms, audit_id) < (%(before_at)s, %(before_id)s::uuid))
 ORDER BY occurred_at_ms DESC, audit_id DESC
 LIMIT %(limit)s

-- name: token_holder
-- The principal a token authenticates.
SELECT p.principal_id, p.kind, p.name, p.status, p.created_at_ms,
       EXISTS (SELECT 1 FROM qinglong.cluster_admins c
                WHERE c.principal_id = p.principal_id) AS cluster_admin
  FROM qinglong.principals p
  JOIN qinglong.operator_credentials t ON t.principal_id = p.principal_id
 WHERE t.credential_id = %s
