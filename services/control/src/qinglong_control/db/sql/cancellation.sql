-- Statements of db/cancellation.py.

-- name: lock_project_shared
SELECT pg_advisory_xact_lock_shared(hashtextextended(%s || %s, 0))

-- name: policy_now
-- The caller's own status too: a principal disabled after ingress admitted the call is
-- refused here, not only by ingress's next admission.
SELECT p.status AS project_status, p.version AS project_version,
       rb.status AS binding_status, rb.version AS binding_version, rb.role,
       (SELECT pr.status FROM qinglong.principals pr
         WHERE pr.principal_id = %(principal_id)s) AS principal_status
  FROM qinglong.projects p
  LEFT JOIN qinglong.role_bindings rb
         ON rb.project_id = p.project_id AND rb.principal_id = %(principal_id)s
 WHERE p.project_id = %(project_id)s

-- name: lock_run
SELECT state, cancel_reason, event_sequence
  FROM qinglong.runs
 WHERE project_id = %(project_id)s AND run_id = %(run_id)s
   FOR UPDATE

-- name: write_intent
UPDATE qinglong.runs
   SET cancel_requested_at_ms = %(now)s, cancel_reason = 'user',
       cancel_requested_by = %(actor_id)s, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: runs_of_disabled_projects
-- Runs still going in a project an administrator disabled, with no stop intent yet: one
-- bounded page, oldest first. The archived projects are read first (an InitPlan), so the
-- partial index of migration 0017 is read only for them — nothing at all while no
-- project is disabled, however many Runs the others have going. SKIP LOCKED: control
-- replicas share the work, and a Run a command holds is left to the next cycle.
SELECT r.run_id, r.state, r.cancel_reason, r.event_sequence
  FROM qinglong.runs r
 WHERE r.project_id = ANY (ARRAY(SELECT project_id FROM qinglong.projects
                                  WHERE status = 'archived'))
   AND r.cancel_requested_at_ms IS NULL
   AND r.state NOT IN ('succeeded', 'failed', 'cancelled', 'timed_out')
 ORDER BY r.created_at_ms, r.run_id
 LIMIT %(limit)s
   FOR UPDATE OF r SKIP LOCKED
