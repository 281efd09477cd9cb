-- Statements of db/lease_control.py.

-- name: renew_lease
-- Renewal is the only non-terminal advancer of the lease version (R-ACK-7, R-LC-4).
UPDATE qinglong.run_leases
   SET version = %(version)s, renewed_at_ms = %(now)s, expires_at_ms = %(expires)s
 WHERE attempt_id = %(attempt_id)s

-- name: project_lease_version
UPDATE qinglong.attempts SET lease_version = %(version)s WHERE attempt_id = %(attempt_id)s

-- name: timeout_intent
-- R-LC-6: the deadline passed with no intent; the timeout becomes a durable intent.
UPDATE qinglong.runs
   SET cancel_requested_at_ms = %(now)s, cancel_reason = 'timeout',
       cancel_requested_by = 'deadline', version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: attempt_completed
UPDATE qinglong.attempts
   SET state = %(attempt_state)s, finished_at_ms = %(now)s, exit_code = %(exit_code)s,
       error_code = %(error_code)s, error_summary = %(summary)s,
       lease_version = %(version)s, output_bytes = %(output_bytes)s
 WHERE attempt_id = %(attempt_id)s

-- name: shutdown_intent
-- A draining Worker's own stop becomes the Run's durable intent (reason `shutdown`),
-- in the transaction that records the stop: the intent is never left implied.
UPDATE qinglong.runs
   SET cancel_requested_at_ms = %(now)s, cancel_reason = 'shutdown',
       cancel_requested_by = %(worker_id)s
 WHERE run_id = %(run_id)s
