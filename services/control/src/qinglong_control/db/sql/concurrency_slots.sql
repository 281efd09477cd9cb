-- Statements of db/concurrency_slots.py.

-- name: lock_task_slots
-- Admissions to one task's slots take turns (a trigger's, a reconcile step's on each
-- replica): each counts the slots held after the one before it committed, so together
-- they never queue more Runs than the limit. Nothing else takes it. A transaction holds
-- no lock another admission waits for when it takes it (a trigger holds its request's
-- lock and its own new Run, which no other transaction sees), and waits for no row lock
-- after it (SKIP LOCKED below), so no cycle can form.
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.task-slots:' || %(task_id)s, 0))

-- name: slots_held
-- After lock_task_slots, so this statement's snapshot holds every admission before it; the
-- limit is read in the same snapshot (a revision committed since is seen).
SELECT qinglong.task_slots_held(%(task_id)s,
                                (SELECT qinglong.db_now_ms()) - %(lost_executor_stop_ms)s)
         AS slots_held,
       qinglong.task_max_concurrent_runs(%(task_id)s) AS task_limit

-- name: lock_waiting
-- The task's Runs waiting for a slot, in the order they are admitted (0045's
-- runs_waiting_for_slot). A Run with a cancel intent is convergence's. SKIP LOCKED: a Run
-- another transaction holds at this moment (a cancel writing its intent) is passed over
-- this once, and the next admitted in its place.
SELECT run_id, event_sequence
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
-- The tasks with Runs waiting for a slot after %(after)s, by task id (a skip scan of 0045's
-- runs_waiting_for_slot: one index probe per task, however many Runs wait), each with the
-- slots it holds, its limit, and its next waiting Run. Read without locks: a hint of which
-- tasks may admit one, which lock_task_slots and slots_held then decide.
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
       qinglong.task_max_concurrent_runs(w.task_id) AS task_limit,
       head.run_id, head.event_sequence
  FROM (SELECT task_id FROM waiting WHERE task_id IS NOT NULL LIMIT %(limit)s) w
  LEFT JOIN LATERAL (
      SELECT r.run_id, r.event_sequence FROM qinglong.runs r
       WHERE r.task_id = w.task_id AND r.state = 'created'
         AND r.cancel_requested_at_ms IS NULL AND r.owner = 'runtime'
       ORDER BY r.priority DESC, r.created_at_ms, r.run_id
       LIMIT 1) head ON true
 ORDER BY w.task_id
