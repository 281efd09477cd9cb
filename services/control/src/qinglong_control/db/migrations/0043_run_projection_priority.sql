-- 0043: operators see a Run's priority (0042) wherever they see the Run.
--
-- The view of 0003 with one column more, at its end (CREATE OR REPLACE VIEW may add
-- columns there and change nothing else); its grant stays.

CREATE OR REPLACE VIEW qinglong.run_projection AS
SELECT r.run_id, r.project_id, r.task_id, r.revision_id, tr.revision_number, r.state,
       r.attempt_count, a.attempt_id AS latest_attempt_id, a.state AS latest_attempt_state,
       r.version, r.event_sequence, r.cancel_reason, r.cancel_requested_at_ms, r.deadline_at_ms,
       r.created_at_ms, r.started_at_ms, r.finished_at_ms, r.error_code, r.retry_at_ms,
       tr.retry_max_attempts AS max_attempts, r.priority
  FROM qinglong.runs r
  JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
  LEFT JOIN qinglong.attempts a ON a.run_id = r.run_id AND a.attempt_number = r.attempt_count;
