-- qinglong: outside-transaction
-- 0048: the Runs waiting for a slot of their task (0046), in order of age.
--
-- The queue gauges (db/queue.py) sample each part of the queue oldest first and at most
-- 100,000 deep, so that a sample costs the same with any backlog; the Runs waiting
-- `created` for a slot are a part of their own (`waiting_for_slot`), and 0046's index
-- holds them by task, not by age.
--
-- Built CONCURRENTLY, outside a transaction (as in 0046); dropped first, so a migrator
-- that stopped half-way is simply run again.

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_waiting_for_slot_by_age;
CREATE INDEX CONCURRENTLY runs_waiting_for_slot_by_age
    ON qinglong.runs (created_at_ms, run_id)
    WHERE state = 'created';
