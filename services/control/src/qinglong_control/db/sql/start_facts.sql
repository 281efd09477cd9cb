-- Statements of db/start_facts.py.

-- name: attempt_starting
UPDATE qinglong.attempts
   SET state = 'starting', starting_at_ms = %(now)s, deadline_at_ms = %(deadline)s
 WHERE attempt_id = %(attempt_id)s

-- name: run_starting
UPDATE qinglong.runs
   SET deadline_at_ms = %(deadline)s, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: attempt_running
UPDATE qinglong.attempts
   SET state = 'running', started_at_ms = %(now)s, executor_handle = %(handle)s,
       log_artifact_id = %(log_artifact_id)s, callback_sequence = %(callback_sequence)s,
       callback_token_digest = %(callback_token_digest)s
 WHERE attempt_id = %(attempt_id)s

-- name: run_running
UPDATE qinglong.runs
   SET state = 'running', started_at_ms = %(now)s, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: attempt_start_failed
-- The callback sequence advances so that a late completion receipt is closed, and the
-- lease-version projection moves with the lease it mirrors (R-FAIL-1). Both are written
-- with the terminal state because a terminal Attempt never changes again.
UPDATE qinglong.attempts
   SET state = %(state)s, finished_at_ms = %(now)s, error_code = %(error_code)s,
       error_summary = %(summary)s, callback_sequence = coalesce(callback_sequence, 0) + 1,
       lease_version = %(lease_version)s
 WHERE attempt_id = %(attempt_id)s

-- name: run_after_attempt
-- Shared with completion: after an Attempt's terminal fact the Run either ends (then
-- `finished` is DB time) or waits for a retry (`retry_at` set, R-RETRY-2).
UPDATE qinglong.runs
   SET state = %(run_state)s, finished_at_ms = %(finished)s, error_code = %(run_error_code)s,
       error_summary = %(summary)s, retry_at_ms = %(retry_at)s, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: complete_lease
-- Shared with completion: the lease ends at the version the terminal command chose.
UPDATE qinglong.run_leases
   SET status = 'completed', version = %(version)s, ended_at_ms = %(now)s
 WHERE attempt_id = %(attempt_id)s

-- name: ending_of_attempt
-- What an Attempt's ending made of its Run — the last `run.<state>` Event the Attempt
-- appended — so that a replay answers as the first call did: the Run may have moved on
-- since (a retry's next Attempt, a cancel while it waited). Read by (run_id, sequence):
-- a Run's own Events only.
SELECT payload->>'to_state' AS run_state, payload->>'error_code' AS run_error_code
  FROM qinglong.run_events
 WHERE run_id = %(run_id)s AND attempt_id = %(attempt_id)s
   AND event_type = 'run.' || (payload->>'to_state')
 ORDER BY sequence DESC
 LIMIT 1
