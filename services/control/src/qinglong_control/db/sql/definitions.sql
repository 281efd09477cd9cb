-- Statements of db/definitions.py.

-- name: lock_create_task
-- Serialises retries of one create request: the second waits, then finds the first's task.
SELECT pg_advisory_xact_lock(
    hashtextextended('qinglong.create-task:' || %(project_id)s || ':' || %(request_id)s, 0))

-- name: existing_task
SELECT task_id FROM qinglong.tasks
 WHERE project_id = %(project_id)s AND create_request_id = %(request_id)s

-- name: active_project
SELECT 1 FROM qinglong.projects WHERE project_id = %(project_id)s AND status = 'active'

-- name: insert_task
INSERT INTO qinglong.tasks (task_id, project_id, display_name, labels, create_request_id,
                            created_by)
VALUES (%(task_id)s, %(project_id)s, %(display_name)s, %(labels)s, %(request_id)s, %(actor)s)

-- name: get_task
SELECT t.task_id, t.project_id, t.display_name, t.labels,
       coalesce((SELECT max(revision_number) FROM qinglong.task_revisions tr
                  WHERE tr.task_id = t.task_id), 0) AS latest_revision_number,
       t.created_at_ms
  FROM qinglong.tasks t
 WHERE t.project_id = %(project_id)s AND t.task_id = %(task_id)s

-- name: list_tasks
-- Newest first, keyset-paginated by (created_at_ms, task_id).
SELECT t.task_id, t.project_id, t.display_name, t.labels,
       coalesce((SELECT max(revision_number) FROM qinglong.task_revisions tr
                  WHERE tr.task_id = t.task_id), 0) AS latest_revision_number,
       t.created_at_ms
  FROM qinglong.tasks t
 WHERE t.project_id = %(project_id)s
   AND (%(before_created)s::bigint IS NULL
        OR (t.created_at_ms, t.task_id) < (%(before_created)s, %(before_task)s::uuid))
 ORDER BY t.created_at_ms DESC, t.task_id DESC
 LIMIT %(limit)s

-- name: lock_task
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.task:' || %s, 0))

-- name: existing_revision
-- The revision a request id created on this task already, with its plan: a retry must
-- ask for the same one.
SELECT revision_id, task_id, project_id, revision_number, executor_type, command, timeout_ms,
       created_at_ms, retry_max_attempts, retry_initial_backoff_ms, retry_max_backoff_ms,
       retry_multiplier_percent, retry_on, worker_selector, queue_timeout_ms,
       max_concurrent_runs
  FROM qinglong.task_revisions
 WHERE project_id = %(project_id)s AND task_id = %(task_id)s
   AND create_request_id = %(request_id)s

-- name: created_the_task
-- CreateTask's request id names its task and that task's first revision: a
-- CreateTaskRevision under the same id is another request reusing it.
SELECT 1 FROM qinglong.tasks
 WHERE project_id = %(project_id)s AND task_id = %(task_id)s
   AND create_request_id = %(request_id)s

-- name: insert_revision
INSERT INTO qinglong.task_revisions
       (revision_id, project_id, task_id, revision_number, executor_type, command, timeout_ms,
        retry_max_attempts, retry_initial_backoff_ms, retry_max_backoff_ms,
        retry_multiplier_percent, retry_on, create_request_id, created_by, worker_selector,
        queue_timeout_ms, max_concurrent_runs)
SELECT %(revision_id)s, t.project_id, t.task_id,
       coalesce((SELECT max(revision_number) FROM qinglong.task_revisions
                  WHERE task_id = t.task_id), 0) + 1,
       %(executor_type)s, %(command)s, %(timeout_ms)s,
       %(retry_max_attempts)s, %(retry_initial_backoff_ms)s, %(retry_max_backoff_ms)s,
       %(retry_multiplier_percent)s, %(retry_on)s, %(request_id)s, %(actor)s,
       %(worker_selector)s, %(queue_timeout_ms)s, %(max_concurrent_runs)s
  FROM qinglong.tasks t
 WHERE t.project_id = %(project_id)s AND t.task_id = %(task_id)s
RETURNING revision_id

-- name: get_revision
SELECT revision_id, task_id, project_id, revision_number, executor_type, command, timeout_ms,
       created_at_ms, retry_max_attempts, retry_initial_backoff_ms, retry_max_backoff_ms,
       retry_multiplier_percent, retry_on, worker_selector, queue_timeout_ms,
       max_concurrent_runs
  FROM qinglong.task_revisions
 WHERE project_id = %(project_id)s AND task_id = %(task_id)s
   AND (revision_number = %(revision_number)s OR revision_id = %(revision_id)s)
