-- qinglong: outside-transaction
-- 0043: the queue's parts (0036, 0037) in the order placement takes them now: a higher
-- priority (0042) first, the oldest first among equals.
--
-- A pull reads each part in that order and stops after the session's room, so its index
-- must hold that order. The indexes of 0036 and 0037 stay: control replicas of the earlier
-- version pull through them until a rolling upgrade has replaced them, and the queue
-- gauge reads the parts by age through them (a later migration may drop what nothing
-- reads any more).
--
-- Built CONCURRENTLY, outside a transaction (as in 0020); each index is dropped first, so
-- a migrator that stopped half-way is simply run again.

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_for_any_worker_by_priority;
CREATE INDEX CONCURRENTLY runs_queued_for_any_worker_by_priority
    ON qinglong.runs (priority DESC, created_at_ms, run_id)
    WHERE state = 'queued' AND worker_selector = '{}'::jsonb;

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_with_selector_by_priority;
CREATE INDEX CONCURRENTLY runs_queued_with_selector_by_priority
    ON qinglong.runs (priority DESC, created_at_ms, run_id)
    WHERE state = 'queued' AND worker_selector <> '{}'::jsonb;

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_for_any_worker_by_project_priority;
CREATE INDEX CONCURRENTLY runs_queued_for_any_worker_by_project_priority
    ON qinglong.runs (project_id, priority DESC, created_at_ms, run_id)
    WHERE state = 'queued' AND worker_selector = '{}'::jsonb;

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_with_selector_by_project_priority;
CREATE INDEX CONCURRENTLY runs_queued_with_selector_by_project_priority
    ON qinglong.runs (project_id, priority DESC, created_at_ms, run_id)
    WHERE state = 'queued' AND worker_selector <> '{}'::jsonb;
