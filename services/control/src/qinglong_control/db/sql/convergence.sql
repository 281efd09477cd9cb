-- Statements of db/convergence.py.

-- name: lock_candidates
SELECT r.run_id, r.state, r.cancel_reason, r.cancel_requested_at_ms, r.event_sequence,
       a.attempt_id, a.state AS attempt_state, l.status AS lease_status,
       l.expires_at_ms AS lease_expires_at_ms
  FROM qinglong.runs r
  LEFT JOIN qinglong.attempts a
         ON a.run_id = r.run_id AND a.attempt_number = r.attempt_count
  LEFT JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id
 WHERE r.owner = 'runtime'
   AND r.cancel_requested_at_ms IS NOT NULL
   AND r.state IN ('created', 'queued', 'waiting_approval', 'retry_wait', 'lost')
 ORDER BY r.cancel_requested_at_ms, r.run_id
 LIMIT %(limit)s
   FOR UPDATE OF r SKIP LOCKED

-- name: lock_attempt
SELECT 1 FROM qinglong.attempts WHERE attempt_id = %s FOR UPDATE

-- name: end_attempt
UPDATE qinglong.attempts
   SET state = %(attempt_state)s, finished_at_ms = %(now)s, error_code = %(error_code)s
 WHERE attempt_id = %(attempt_id)s

-- name: expire_lease
UPDATE qinglong.run_leases SET status = 'expired', ended_at_ms = %(now)s
 WHERE attempt_id = %(attempt_id)s AND status = 'leased'

-- name: end_run
UPDATE qinglong.runs
   SET state = %(run_state)s, finished_at_ms = %(now)s, error_code = %(error_code)s,
       retry_at_ms = NULL,
       version = version + 1, updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: expired_leases
-- The clock read once, as a sub-select: db_now_ms() is VOLATILE, and compared directly it
-- cannot bound the index scan — with 100,000 live leases every one was read and filtered
-- (25 ms per cycle; bench/bench_scale.py). Each lease is re-checked under its lock.
SELECT attempt_id FROM qinglong.run_leases
 WHERE status = 'leased' AND expires_at_ms <= (SELECT qinglong.db_now_ms())
 ORDER BY expires_at_ms, attempt_id
 LIMIT %s

-- name: try_advisory
SELECT pg_try_advisory_xact_lock(hashtextextended('qinglong.attempt:' || %s, 0))

-- name: lock_for_expiry
-- SKIP LOCKED: rows another transaction holds (a replica expiring the same lease, a
-- command on it) are not waited for; the next cycle decides them. Replicas listing the
-- same page so share it instead of queueing behind each other row by row (R-HA-1); it
-- never waits, so it cannot break the lock order either.
SELECT r.run_id, r.state AS run_state, r.event_sequence, r.cancel_reason,
       a.state AS attempt_state, l.status AS lease_status, l.expires_at_ms
  FROM qinglong.run_leases l
  JOIN qinglong.attempts a ON a.attempt_id = l.attempt_id
  JOIN qinglong.runs r ON r.run_id = l.run_id
 WHERE l.attempt_id = %s
   FOR UPDATE OF r, a, l SKIP LOCKED

-- name: attempt_lost
UPDATE qinglong.attempts SET state = 'lost', finished_at_ms = %(now)s,
       error_code = %(error_code)s
 WHERE attempt_id = %(attempt_id)s

-- name: run_after_expiry
-- The Run follows its expired Attempt: `lost` (retry or convergence decide next), or back
-- to `queued` when the Attempt was only `claimed` (R-RETRY-1); the next claim makes a new
-- Attempt. Any other state already moved on and only records the Attempt's Event.
UPDATE qinglong.runs SET state = %(run_state)s, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s
