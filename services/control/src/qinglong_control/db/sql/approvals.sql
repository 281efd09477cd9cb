-- Statements of db/approvals.py.

-- name: hold
-- A retry of a held call (same caller, same method and bytes) finds the first request.
INSERT INTO qinglong.approval_requests (
    approval_id, project_id, method, request_type, request, request_digest, run_id,
    requested_by, requested_by_kind, audit_id, requested_at_ms, expires_at_ms)
VALUES (%(approval_id)s, %(project_id)s, %(method)s, %(request_type)s, %(request)s,
        %(request_digest)s, %(run_id)s, %(requested_by)s, %(requested_by_kind)s,
        %(audit_id)s, %(now)s, %(now)s + %(ttl_ms)s)
ON CONFLICT (project_id, requested_by, request_digest) DO NOTHING
RETURNING approval_id

-- name: pending_of_caller
-- The caller's requests waiting in the project, counted up to the limit (by migration
-- 0030's partial index of pending requests). One past its expiry waits no more, whether
-- or not the reconciler has recorded that yet (as the approvals' projection reads it).
SELECT count(*) FROM (
    SELECT 1 FROM qinglong.approval_requests
     WHERE project_id = %(project_id)s AND requested_by = %(requested_by)s
       AND state = 'pending' AND expires_at_ms > (SELECT qinglong.db_now_ms())
     LIMIT %(limit)s) AS pending

-- name: held_before
SELECT approval_id FROM qinglong.approval_requests
 WHERE project_id = %(project_id)s AND requested_by = %(requested_by)s
   AND request_digest = %(request_digest)s

-- name: lock
SELECT approval_id, state, method, request, run_id, requested_by, decided_by, expires_at_ms
  FROM qinglong.approval_requests
 WHERE project_id = %(project_id)s AND approval_id = %(approval_id)s
   FOR UPDATE

-- name: record_decision
UPDATE qinglong.approval_requests
   SET state = %(state)s, decided_by = %(decided_by)s, decided_at_ms = %(now)s,
       note = %(note)s, result = %(result)s
 WHERE approval_id = %(approval_id)s

-- name: get
SELECT * FROM qinglong.approval_projection
 WHERE project_id = %(project_id)s AND approval_id = %(approval_id)s

-- name: list
-- Newest first, keyset-paginated by (requested_at_ms, approval_id).
SELECT * FROM qinglong.approval_projection
 WHERE project_id = %(project_id)s
   AND (cardinality(%(states)s::text[]) = 0 OR state = ANY(%(states)s))
   AND (%(before_requested)s::bigint IS NULL
        OR (requested_at_ms, approval_id) < (%(before_requested)s, %(before_approval)s::uuid))
 ORDER BY requested_at_ms DESC, approval_id DESC
 LIMIT %(limit)s

-- name: expire_next
-- The reconciler's share: the oldest pending request past its expiry; one a decision
-- (or another replica) holds is skipped — the decision records the expiry itself.
SELECT approval_id, project_id, method, run_id
  FROM qinglong.approval_requests
 WHERE state = 'pending' AND expires_at_ms <= (SELECT qinglong.db_now_ms())
 ORDER BY expires_at_ms
 LIMIT 1
   FOR UPDATE SKIP LOCKED
