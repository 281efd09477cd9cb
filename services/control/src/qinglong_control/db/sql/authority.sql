-- Statements of db/authority.py.

-- name: advisory_lock
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.attempt:' || %s, 0))

-- name: lock_session
SELECT session_id, worker_id, generation, status, expires_at_ms
  FROM qinglong.worker_sessions
 WHERE session_id = %s
   FOR SHARE

-- name: lock_run
SELECT r.run_id, r.project_id, r.revision_id, r.state, r.owner, r.version, r.event_sequence,
       r.cancel_reason, r.cancel_requested_at_ms, tr.timeout_ms, r.deadline_at_ms, r.error_code,
       tr.retry_max_attempts, tr.retry_initial_backoff_ms, tr.retry_max_backoff_ms,
       tr.retry_multiplier_percent, tr.retry_on,
       (SELECT count(*) FROM qinglong.attempts sa
         WHERE sa.run_id = r.run_id AND sa.starting_at_ms IS NOT NULL) AS started_attempts
  FROM qinglong.runs r
  JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
 WHERE r.run_id = %s
   FOR UPDATE OF r

-- name: lock_attempt
SELECT attempt_id, run_id, state, executor_type, worker_id, session_id, worker_generation,
       offer_id, lease_generation, lease_version, lease_token_digest, attempt_number,
       starting_at_ms,
       started_at_ms, deadline_at_ms, executor_handle, log_artifact_id, callback_sequence,
       callback_token_digest, error_code, exit_code, finished_at_ms
  FROM qinglong.attempts
 WHERE attempt_id = %s
   FOR UPDATE

-- name: lock_lease
SELECT attempt_id, run_id, worker_id, session_id, worker_generation, offer_id,
       lease_generation, token_digest, version, status, expires_at_ms
  FROM qinglong.run_leases
 WHERE attempt_id = %s
   FOR UPDATE
