-- 0045: each Run keeps the max_concurrent_runs of the revision it pins (0044).
--
-- Copied when the Run is triggered, as its queue_timeout_ms is (0039): admission compares
-- each waiting Run's own limit without reading its revision, and a later revision changes
-- no Run already waiting. One table, as in 0044.

ALTER TABLE qinglong.runs
    ADD COLUMN max_concurrent_runs integer,
    ADD CONSTRAINT runs_max_concurrent_runs_positive
        CHECK (max_concurrent_runs > 0) NOT VALID;
-- As in 0044: no row is read or rewritten; Runs triggered before have no limit.
