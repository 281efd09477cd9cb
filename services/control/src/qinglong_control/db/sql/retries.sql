-- Statements of db/retries.py.

-- name: lock_lost
SELECT r.run_id, r.state, r.event_sequence, a.attempt_id, a.attempt_number,
       l.expires_at_ms AS lease_expired_at_ms,
       (SELECT count(*) FROM qinglong.attempts sa
         WHERE sa.run_id = r.run_id AND sa.starting_at_ms IS NOT NULL) AS started_attempts,
       tr.retry_max_attempts, tr.retry_initial_backoff_ms, tr.retry_max_backoff_ms,
       tr.retry_multiplier_percent, tr.retry_on
  FROM qinglong.runs r
  JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
  LEFT JOIN qinglong.attempts a ON a.run_id = r.run_id AND a.attempt_number = r.attempt_count
  LEFT JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id
 WHERE r.state = 'lost' AND r.cancel_requested_at_ms IS NULL AND r.owner = 'runtime'
 ORDER BY r.updated_at_ms, r.run_id
 LIMIT %(limit)s
   FOR UPDATE OF r SKIP LOCKED

-- name: lock_due
-- The clock read once, as a sub-select, so it bounds the runs_retry_due index scan (a
-- VOLATILE call compared directly filters every waiting Run; see expired_leases).
SELECT r.run_id, r.event_sequence, r.attempt_count, r.retry_at_ms
  FROM qinglong.runs r
 WHERE r.state = 'retry_wait' AND r.cancel_requested_at_ms IS NULL AND r.owner = 'runtime'
   AND r.retry_at_ms <= (SELECT qinglong.db_now_ms())
 ORDER BY r.retry_at_ms, r.run_id
 LIMIT %(limit)s
   FOR UPDATE OF r SKIP LOCKED

-- name: run_waits
UPDATE qinglong.runs
   SET state = 'retry_wait', retry_at_ms = %(retry_at)s, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: run_exhausted
UPDATE qinglong.runs
   SET state = 'failed', finished_at_ms = %(now)s, error_code = %(error_code)s,
       retry_at_ms = NULL, version = version + 1, updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: run_requeued
UPDATE qinglong.runs
   SET state = 'queued', retry_at_ms = NULL, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s
