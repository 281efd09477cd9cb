-- 0034: each Run keeps the worker_selector of the revision it pins (0033).
--
-- Copied when the Run is triggered, as its executor type is: the pull compares a queued
-- Run with the session without joining its revision, and a later revision with another
-- selector changes no Run already queued. One table, as in 0033.

ALTER TABLE qinglong.runs
    ADD COLUMN worker_selector jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD CONSTRAINT runs_worker_selector_object
        CHECK (jsonb_typeof(worker_selector) = 'object') NOT VALID;
-- As in 0033: no row is read or rewritten; Runs triggered before have no selector.
