-- qinglong: outside-transaction
-- 0037: a Worker of some projects reads its projects' queues in the same two parts as 0036.
--
-- 0036 spared a Worker of every project the queued Runs that need labels it has not
-- declared; a Worker limited to some projects still read, through runs_by_project_state,
-- every queued Run of its projects, those waiting for a label nobody has included. Its
-- pull now reads each served project's Runs without a selector and, only with labels,
-- those with one, from these indexes.
--
-- Built CONCURRENTLY, outside a transaction (as in 0020); each index is dropped first, so
-- a migrator that stopped half-way is simply run again.

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_for_any_worker_by_project;
CREATE INDEX CONCURRENTLY runs_queued_for_any_worker_by_project
    ON qinglong.runs (project_id, created_at_ms, run_id)
    WHERE state = 'queued' AND worker_selector = '{}'::jsonb;

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_with_selector_by_project;
CREATE INDEX CONCURRENTLY runs_queued_with_selector_by_project
    ON qinglong.runs (project_id, created_at_ms, run_id)
    WHERE state = 'queued' AND worker_selector <> '{}'::jsonb;
