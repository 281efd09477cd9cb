-- 0017: a project's Runs still going, by project.
--
-- Each reconcile cycle stops the Runs of disabled (archived) projects
-- (cancellation.runs_of_disabled_projects). Without this index it read every Run such a
-- project ever had, at every cycle on every replica, and archived projects are kept for
-- ever; with it, it reads only the Runs still going and not yet told to stop — none,
-- once a disabled project's Runs are stopped. The predicate is the query's, word for word.

CREATE INDEX runs_live_unstopped_by_project ON qinglong.runs (project_id, created_at_ms, run_id)
 WHERE cancel_requested_at_ms IS NULL
   AND state NOT IN ('succeeded', 'failed', 'cancelled', 'timed_out');
