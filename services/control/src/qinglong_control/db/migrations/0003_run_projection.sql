-- 0003: one definition of a Run as operators see it.
--
-- GetRun and ListRuns read the same columns; the view is that one definition, so a
-- column added to the projection is added once. It runs with the owner's rights over
-- tables the runtime role already reads.

CREATE VIEW qinglong.run_projection AS
SELECT r.run_id, r.project_id, r.task_id, r.revision_id, tr.revision_number, r.state,
       r.attempt_count, a.attempt_id AS latest_attempt_id, a.state AS latest_attempt_state,
       r.version, r.event_sequence, r.cancel_reason, r.cancel_requested_at_ms, r.deadline_at_ms,
       r.created_at_ms, r.started_at_ms, r.finished_at_ms, r.error_code, r.retry_at_ms,
       tr.retry_max_attempts AS max_attempts
  FROM qinglong.runs r
  JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
  LEFT JOIN qinglong.attempts a ON a.run_id = r.run_id AND a.attempt_number = r.attempt_count;

GRANT SELECT ON qinglong.run_projection TO qinglong_runtime;
