-- 0042: a Run's priority in the queue (TriggerRunRequest.priority).
--
-- The queue was one order, oldest first: a release build waited behind every nightly job
-- queued before it. A Run may now be triggered with a priority; placement offers higher
-- priorities first, and the oldest first among equals (0043's indexes). The contract holds
-- the range (run_service.proto); smallint holds it, so no CHECK repeats the numbers.
--
-- A constant default: no row is rewritten, and every Run queued before keeps the default
-- priority, 0. One table, as in 0033-0035. Operators read it from runs, beside the view of
-- 0003, which stays as it is: replicas of the earlier version read that view's columns
-- into a fixed set of fields, and one more would fail them during a rolling upgrade.

ALTER TABLE qinglong.runs ADD COLUMN priority smallint NOT NULL DEFAULT 0;
