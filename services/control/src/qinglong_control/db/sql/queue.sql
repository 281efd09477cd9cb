-- Statements of db/queue.py.

-- name: queue_parts
-- The queue in its two parts (migration 0036's partial indexes: index-only counts): how
-- many Runs wait in each, and how long the oldest has waited on DB time (NULL: none).
-- A Run with a selector that waits long is most likely waiting for labels no live Worker
-- declares.
SELECT 'any_worker' AS part, count(*) AS runs,
       qinglong.db_now_ms() - min(created_at_ms) AS oldest_age_ms
  FROM qinglong.runs WHERE state = 'queued' AND worker_selector = '{}'::jsonb
UNION ALL
SELECT 'with_selector' AS part, count(*) AS runs,
       qinglong.db_now_ms() - min(created_at_ms) AS oldest_age_ms
  FROM qinglong.runs WHERE state = 'queued' AND worker_selector <> '{}'::jsonb
