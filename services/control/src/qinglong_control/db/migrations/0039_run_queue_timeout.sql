-- 0039: each Run keeps the queue_timeout_ms of the revision it pins (0038).
--
-- Copied when the Run is triggered, as its worker_selector is (0034): the reconciler finds
-- Runs that waited too long from the Runs alone (0040's index), and a later revision
-- changes no Run already queued. One table, as in 0038.

ALTER TABLE qinglong.runs
    ADD COLUMN queue_timeout_ms bigint,
    ADD CONSTRAINT runs_queue_timeout_ms_positive
        CHECK (queue_timeout_ms > 0) NOT VALID;
-- As in 0038: no row is read or rewritten; Runs triggered before have no bound.
