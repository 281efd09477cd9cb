-- qinglong: outside-transaction
-- 0040: the queued Runs that have a queue timeout (0039), by when their wait ends.
--
-- A queued Run's updated_at_ms is when it was last queued: nothing writes a queued Run but
-- a cancel intent (such a Run is converged, not timed out) or the move that takes it out
-- of `queued` (the queue gauge, db/sql/queue.sql, reads the wait the same way). Its wait
-- ends at updated_at_ms + queue_timeout_ms. Each reconcile cycle reads the Runs whose wait
-- has ended, oldest end first; with this index it reads only those, however long the
-- queue, and nothing at all while no Run has a queue timeout.
--
-- Built CONCURRENTLY, outside a transaction (as in 0020); dropped first, so a migrator
-- that stopped half-way is simply run again.

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_queued_by_queue_deadline;
CREATE INDEX CONCURRENTLY runs_queued_by_queue_deadline
    ON qinglong.runs ((updated_at_ms + queue_timeout_ms), run_id)
    WHERE state = 'queued' AND queue_timeout_ms IS NOT NULL
      AND cancel_requested_at_ms IS NULL;
