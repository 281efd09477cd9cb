-- Statements of db/concurrency_slots.py.

-- name: lock_task_slots
-- Admissions to one task's slots take turns (a trigger's, a reconcile step's on each
-- replica): each counts the slots held after the one before it committed, so together
-- they never queue more Runs than the limit. Nothing else takes it; a transaction takes
-- it after its other locks and before any Run's row lock, so no cycle can form.
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.task-slots:' || %(task_id)s, 0))

-- name: slots_held
-- After lock_task_slots, so this statement's snapshot holds every admission before it.
SELECT qinglong.task_slots_held(%(task_id)s,
                                (SELECT qinglong.db_now_ms()) - %(lost_executor_stop_ms)s)

-- name: lock_waiting
-- The task's Runs waiting for a slot, in the order they are admitted (0046's
-- runs_waiting_for_slot). SKIP LOCKED: a Run a cancel holds is convergence's, and the
-- next is admitted in its place. A Run with a cancel intent is convergence's too.
SELECT run_id, max_concurrent_runs, event_sequence
  FROM qinglong.runs
 WHERE task_id = %(task_id)s AND state = 'created' AND cancel_requested_at_ms IS NULL
   AND owner = 'runtime'
 ORDER BY priority DESC, created_at_ms, run_id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED

-- name: admit
-- Queued from now: a queue timeout counts from here, as from any other time it is queued.
UPDATE qinglong.runs
   SET state = 'queued', version = version + 1, updated_at_ms = %(now)s
 WHERE run_id = ANY(%(run_ids)s)

-- name: waiting_tasks
-- The tasks with Runs waiting for a slot after %(after)s, by task id (a skip scan of 0046's
-- runs_waiting_for_slot: one index probe per task, however many Runs wait), each with the
-- slots it holds and the limit of its next Run. Read without locks: a hint of which tasks
-- may admit one, which lock_task_slots and slots_held then decide.
WITH RECURSIVE waiting (task_id) AS (
    (SELECT r.task_id FROM qinglong.runs r
      WHERE r.state = 'created' AND r.task_id > %(after)s
      ORDER BY r.task_id LIMIT 1)
    UNION ALL
    SELECT (SELECT r.task_id FROM qinglong.runs r
             WHERE r.state = 'created' AND r.task_id > waiting.task_id
             ORDER BY r.task_id LIMIT 1)
      FROM waiting WHERE waiting.task_id IS NOT NULL
)
SELECT w.task_id,
       qinglong.task_slots_held(w.task_id,
                                (SELECT qinglong.db_now_ms()) - %(lost_executor_stop_ms)s)
         AS slots_held,
       head.run_id, head.max_concurrent_runs, head.event_sequence
  FROM (SELECT task_id FROM waiting WHERE task_id IS NOT NULL LIMIT %(limit)s) w
  LEFT JOIN LATERAL (
      SELECT r.run_id, r.max_concurrent_runs, r.event_sequence FROM qinglong.runs r
       WHERE r.task_id = w.task_id AND r.state = 'created'
         AND r.cancel_requested_at_ms IS NULL AND r.owner = 'runtime'
       ORDER BY r.priority DESC, r.created_at_ms, r.run_id
       LIMIT 1) head ON true
 ORDER BY w.task_id
