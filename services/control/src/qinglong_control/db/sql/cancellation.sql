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
   SET cancel_requested_at_ms = %(now)s, cancel_reason = %(reason)s,
       cancel_requested_by = %(actor_id)s, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: runs_of_disabled_projects
-- Runs still going in a project an administrator disabled, with no stop intent yet: one
-- bounded page, oldest first. Every cycle of every replica runs it, and a project is
-- seldom disabled, so the plan is fixed by the statement's shape rather than left to the
-- planner: from the archived projects, each one's oldest Runs by the partial index of
-- migration 0017 (LATERAL ... LIMIT, which the planner cannot turn around), then each of
-- those Runs locked by primary key (a LATERAL subquery with its own FOR UPDATE), its
-- conditions checked again under the lock. While no project is disabled no Run is read
-- at all; a join or `project_id = ANY (...)` let the planner read every live Run of every
-- project instead (25 ms a cycle with 100,000 Runs waiting, bench/bench_scale.py). SKIP
-- LOCKED: a Run a command or another replica's sweep holds is left to a later cycle.
-- The page is chosen before it is locked, so replicas that sweep at once pick the same
-- Runs and one of them gets them all (the others' step finds nothing and ends): with a
-- disabled project, one replica does the sweep — it is rare, and bounded per cycle.
SELECT locked.run_id, locked.state, locked.cancel_reason, locked.event_sequence
  FROM (SELECT live.run_id, live.created_at_ms
          FROM qinglong.projects p
         CROSS JOIN LATERAL (
             SELECT r.run_id, r.created_at_ms FROM qinglong.runs r
              WHERE r.project_id = p.project_id
                AND r.cancel_requested_at_ms IS NULL
                AND r.state NOT IN ('succeeded', 'failed', 'cancelled', 'timed_out')
              ORDER BY r.created_at_ms, r.run_id
              LIMIT %(limit)s) live
         WHERE p.status = 'archived'
         ORDER BY live.created_at_ms, live.run_id
         LIMIT %(limit)s) page
 CROSS JOIN LATERAL (
     SELECT r.run_id, r.state, r.cancel_reason, r.event_sequence FROM qinglong.runs r
      WHERE r.run_id = page.run_id
        AND r.cancel_requested_at_ms IS NULL
        AND r.state NOT IN ('succeeded', 'failed', 'cancelled', 'timed_out')
        FOR UPDATE SKIP LOCKED) locked
 ORDER BY page.created_at_ms, page.run_id
