-- Statements of db/queue.py.

-- name: queue_parts
-- The queue in its two parts (migration 0036's partial indexes), each read in order of age
-- and at most 100,000 Runs deep, so that a sample costs the same with any backlog (and
-- fits the statement bound): how many Runs wait (100,000 means at least that many), and
-- how long the one waiting longest among them has waited since it was last queued
-- (updated_at_ms: a retried or requeued Run waits from then, not from its creation; NULL
-- when none waits). A Run with a cancel intent waits for nothing and is not counted.
-- A third part, waiting_for_slot, holds the Runs waiting `created` for a slot of their
-- task (its concurrency limit), read by age from migration 0045's
-- runs_waiting_for_slot_by_age: they wait for their task's earlier Runs, not for a
-- Worker, and no pull sees them yet.
SELECT 'any_worker' AS part, count(*) AS runs,
       qinglong.db_now_ms() - min(q.updated_at_ms) AS oldest_age_ms
  FROM (SELECT r.updated_at_ms FROM qinglong.runs r
         WHERE r.state = 'queued' AND r.worker_selector = '{}'::jsonb
           AND r.cancel_requested_at_ms IS NULL
         ORDER BY r.created_at_ms, r.run_id
         LIMIT 100000) q
UNION ALL
SELECT 'waiting_for_slot' AS part, count(*) AS runs,
       qinglong.db_now_ms() - min(q.updated_at_ms) AS oldest_age_ms
  FROM (SELECT r.updated_at_ms FROM qinglong.runs r
         WHERE r.state = 'created' AND r.cancel_requested_at_ms IS NULL
         ORDER BY r.created_at_ms, r.run_id
         LIMIT 100000) q
UNION ALL
SELECT 'with_selector' AS part, count(*) AS runs,
       qinglong.db_now_ms() - min(q.updated_at_ms) AS oldest_age_ms
  FROM (SELECT r.updated_at_ms FROM qinglong.runs r
         WHERE r.state = 'queued' AND r.worker_selector <> '{}'::jsonb
           AND r.cancel_requested_at_ms IS NULL
         ORDER BY r.created_at_ms, r.run_id
         LIMIT 100000) q
