-- qinglong: outside-transaction
-- 0045: what admission to a task's slots reads (db/concurrency_slots.py), by index.
--
-- runs_waiting_for_slot: a task's Runs waiting `created` for a slot, in the order they are
-- admitted (a higher priority first, the oldest first among equals); its leading task_id
-- also lets the reconcile step find the tasks that have waiting Runs without reading each
-- of their Runs.
--
-- runs_holding_slot_by_task: a task's Runs that hold a slot, counted at each admission:
-- without it the count reads the task's whole history.
--
-- runs_ended_by_task: a task's Runs by the moment they ended. A Run whose last Attempt
-- was lost may end (retries exhausted, a cancel) at once, while its Worker, cut off from
-- the control plane, is still stopping its executor for up to the stop bound; such a Run
-- holds its slot until then. Only the task's Runs that ended within the last stop bound
-- are read, whatever the task's history or the fleet's other expiries.
--
-- runs_waiting_for_slot_by_age: the same Runs as runs_waiting_for_slot, oldest first, for
-- the queue gauges (db/queue.py), which sample each part of the queue in order of age and
-- at most 100,000 deep.
--
-- Built CONCURRENTLY, outside a transaction (as in 0043); each index is dropped first, so
-- a migrator that stopped half-way is simply run again.

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_waiting_for_slot;
CREATE INDEX CONCURRENTLY runs_waiting_for_slot
    ON qinglong.runs (task_id, priority DESC, created_at_ms, run_id)
    WHERE state = 'created';

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_holding_slot_by_task;
CREATE INDEX CONCURRENTLY runs_holding_slot_by_task
    ON qinglong.runs (task_id)
    WHERE state IN ('queued', 'dispatching', 'running', 'retry_wait', 'lost');

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_ended_by_task;
CREATE INDEX CONCURRENTLY runs_ended_by_task
    ON qinglong.runs (task_id, finished_at_ms)
    WHERE finished_at_ms IS NOT NULL;

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_waiting_for_slot_by_age;
CREATE INDEX CONCURRENTLY runs_waiting_for_slot_by_age
    ON qinglong.runs (created_at_ms, run_id)
    WHERE state = 'created';
