-- Statements of db/queue_timeouts.py.

-- name: lock_overdue
-- Queued Runs whose wait is over, the earliest end first, from migration 0040's index (a
-- queued Run's updated_at_ms is when it was last queued). The clock is read once, as a
-- sub-select, so that it bounds the index scan (db_now_ms() is VOLATILE). SKIP LOCKED: a
-- Run a claim or another replica holds is decided there; a claim that wins takes it out
-- of `queued`, and the lock re-checks these conditions on the row it gets.
SELECT run_id, state, cancel_reason, event_sequence, updated_at_ms AS queued_at_ms,
       queue_timeout_ms
  FROM qinglong.runs
 WHERE state = 'queued' AND queue_timeout_ms IS NOT NULL
   AND cancel_requested_at_ms IS NULL AND owner = 'runtime'
   AND updated_at_ms + queue_timeout_ms <= (SELECT qinglong.db_now_ms())
 ORDER BY updated_at_ms + queue_timeout_ms, run_id
 LIMIT %(limit)s
   FOR UPDATE SKIP LOCKED

-- name: withdraw_offers
-- A Run that timed out is offered no more: its open offer goes back, so no Worker's inbox
-- keeps one it could only be refused on.
UPDATE qinglong.offers SET state = 'withdrawn'
 WHERE run_id = ANY(%(run_ids)s) AND state = 'open'
