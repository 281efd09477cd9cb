-- 0038: how long a revision's Runs may wait queued for a Worker (its queue_timeout_ms).
--
-- A Run whose selector no Worker matches, or whose project's Workers are all gone, waited
-- queued for ever. A revision's plan may now bound that wait; the reconcile cadence ends a
-- Run that waited longer `timed_out` with error code QUEUE_TIMED_OUT (db/queue_timeouts.py).
-- The contract declares the range (execution.proto); this CHECK only keeps the column
-- meaningful, so the numbers live in one place.
--
-- One table per migration, as in 0033-0035.

ALTER TABLE qinglong.task_revisions
    ADD COLUMN queue_timeout_ms bigint,
    ADD CONSTRAINT task_revisions_queue_timeout_ms_positive
        CHECK (queue_timeout_ms > 0) NOT VALID;
-- NOT VALID: every existing row is NULL (no bound, what it meant), so nothing needs
-- reading, and a column without a default rewrites no row.
