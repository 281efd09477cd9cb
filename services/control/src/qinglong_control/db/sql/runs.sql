-- Statements of db/runs.py.

-- name: get_run
-- A Run as operators see it (the view of migration 0003), with its priority and its
-- parameters (which list_runs leaves out: a page of Runs stays small). Columns added later
-- are read from runs, not added to the view: a replica of the earlier version reads
-- `v.*` into its own set of fields, and one more would fail it during a rolling upgrade.
SELECT v.*, r.priority, r.parameters
  FROM qinglong.run_projection v JOIN qinglong.runs r ON r.run_id = v.run_id
 WHERE v.project_id = %(project_id)s AND v.run_id = %(run_id)s

-- name: list_runs
-- Newest first, keyset-paginated by (created_at_ms, run_id); the priority as get_run reads
-- it.
SELECT v.*, r.priority
  FROM qinglong.run_projection v JOIN qinglong.runs r ON r.run_id = v.run_id
 WHERE v.project_id = %(project_id)s
   AND (%(task_id)s::uuid IS NULL OR v.task_id = %(task_id)s)
   AND (cardinality(%(states)s::text[]) = 0 OR v.state = ANY(%(states)s))
   AND (%(before_created)s::bigint IS NULL
        OR (v.created_at_ms, v.run_id) < (%(before_created)s, %(before_run)s::uuid))
 ORDER BY v.created_at_ms DESC, v.run_id DESC
 LIMIT %(limit)s

-- name: lock_trigger
-- Serialises retries of one trigger request: the second waits, then finds the first's Run.
SELECT pg_advisory_xact_lock(
    hashtextextended('qinglong.trigger:' || %(project_id)s || ':' || %(request_id)s, 0))

-- name: existing_trigger
-- The Run a request id triggered already, with what it pinned and the parameters and
-- priority it was given: a retry must ask for the same.
SELECT r.run_id, r.task_id, tr.revision_number, r.parameters, r.priority
  FROM qinglong.runs r JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
 WHERE r.project_id = %(project_id)s AND r.trigger_request_id = %(request_id)s

-- name: lock_task_shared
-- A trigger reads the task's concurrency limit (pick_revision) after this, and a revision
-- (definitions.lock_task) holds it exclusively: a trigger that saw no limit commits its
-- queued Run before the revision that adds one does, so every admission held to that
-- limit counts the Run. Triggers of one task do not wait for each other.
SELECT pg_advisory_xact_lock_shared(hashtextextended('qinglong.task:' || %(task_key)s, 0))

-- name: pick_revision
-- No row: no such task (in this project); a row of NULLs: the task has no such revision.
-- With the task's concurrency limit (its newest revision's, whatever revision is pinned).
SELECT tr.revision_id, tr.executor_type,
       qinglong.task_max_concurrent_runs(t.task_id) AS task_limit
  FROM qinglong.tasks t
  LEFT JOIN qinglong.task_revisions tr
         ON tr.task_id = t.task_id
        AND tr.revision_number = coalesce(%(revision_number)s,
            (SELECT max(revision_number) FROM qinglong.task_revisions
              WHERE task_id = %(task_id)s))
 WHERE t.project_id = %(project_id)s AND t.task_id = %(task_id)s

-- name: insert_run
-- A Run is created straight into `queued` with its first Event — or, when its task limits
-- how many of its Runs run at once, `created`, to wait for a slot
-- (db/concurrency_slots.py). The revision is pinned, and the Run keeps its
-- worker_selector (placement compares it without the revision) and queue_timeout_ms (the
-- reconciler's queue timeout reads Runs alone).
INSERT INTO qinglong.runs
       (run_id, project_id, task_id, revision_id, state, executor_type,
        trigger_request_id, triggered_by, created_at_ms, updated_at_ms, parameters,
        worker_selector, queue_timeout_ms, priority)
SELECT %(run_id)s, %(project_id)s, %(task_id)s, tr.revision_id, %(state)s, %(executor_type)s,
       %(request_id)s, %(actor_id)s, %(now)s, %(now)s, %(parameters)s, tr.worker_selector,
       tr.queue_timeout_ms, %(priority)s
  FROM qinglong.task_revisions tr WHERE tr.revision_id = %(revision_id)s

-- name: list_events
-- A user's or agent's actor_id is their principal id, so the name is looked up by the
-- primary key. CASE evaluates the cast only for an id in UUID form: the column is text
-- and also holds worker ids and component names.
SELECT e.event_id, e.run_id, r.project_id, e.sequence, e.event_type, e.attempt_id,
       e.actor_kind, e.actor_id, e.occurred_at_ms, e.payload,
       CASE WHEN e.actor_kind IN ('user', 'agent')
                 AND e.actor_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
            THEN (SELECT p.name FROM qinglong.principals p
                   WHERE p.principal_id = e.actor_id::uuid)
       END AS actor_name
  FROM qinglong.run_events e JOIN qinglong.runs r ON r.run_id = e.run_id
 WHERE r.project_id = %(project_id)s AND e.run_id = %(run_id)s
   AND e.sequence > %(after_sequence)s
 ORDER BY e.sequence
 LIMIT %(limit)s
