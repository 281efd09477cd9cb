-- Statements of db/sessions.py.

-- name: lock_worker
-- Serialises every open of one Worker; the runtime role cannot lock identity rows.
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.worker:' || %s, 0))

-- name: known_worker
SELECT status FROM qinglong.worker_identities WHERE worker_id = %s

-- name: session_by_request
SELECT session_id, generation, status, expires_at_ms,
       executor_types, max_concurrency, agent_version, passes_run_parameters, labels
  FROM qinglong.worker_sessions
 WHERE worker_id = %s AND open_request_id = %s

-- name: lock_live_session
SELECT session_id FROM qinglong.worker_sessions
 WHERE worker_id = %s AND status IN ('online', 'draining')
   FOR UPDATE

-- name: last_generation
SELECT coalesce(max(generation), 0) FROM qinglong.worker_sessions WHERE worker_id = %s

-- name: replace_live_session
UPDATE qinglong.worker_sessions
   SET status = 'replaced', closed_at_ms = %(now)s
 WHERE worker_id = %(worker_id)s AND status IN ('online', 'draining')

-- name: lock_worker_pulls
-- Waits for the pulls of the Worker's live sessions under way: each holds its session's
-- pull lock (the key of placement.lock_session_pull) until it commits, so a withdrawal
-- after this also finds the offers they place. In session order, so that two of these
-- never cross.
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.pull:' || session_id::text, 0))
  FROM qinglong.worker_sessions
 WHERE worker_id = %(worker_id)s AND status IN ('online', 'draining')
 ORDER BY session_id

-- name: withdraw_open_offers
-- Offers of a replaced or draining session go back to the pool at once.
UPDATE qinglong.offers SET state = 'withdrawn'
 WHERE worker_id = %(worker_id)s AND state = 'open'

-- name: insert_session
INSERT INTO qinglong.worker_sessions
       (session_id, worker_id, generation, status, executor_types, max_concurrency,
        agent_version, open_request_id, opened_at_ms, renewed_at_ms, expires_at_ms,
        passes_run_parameters, labels)
VALUES (%(session_id)s, %(worker_id)s, %(generation)s, 'online', %(executor_types)s,
        %(max_concurrency)s, %(agent_version)s, %(request_id)s, %(now)s, %(now)s, %(expires)s,
        %(passes_run_parameters)s, %(labels)s)

-- name: lock_session
SELECT session_id, worker_id, generation, status, expires_at_ms
  FROM qinglong.worker_sessions WHERE session_id = %s FOR UPDATE

-- name: renew_session
-- The renewing Worker says again whether it passes Run parameters on, what labels it has
-- and how many Attempts it runs at once: a Worker restarted on another version or with
-- other settings resumes its session, and placement must follow the present one. A NULL
-- capacity (a Worker of an earlier version said none) leaves it as it was.
UPDATE qinglong.worker_sessions
   SET renewed_at_ms = %(now)s, expires_at_ms = %(expires)s,
       passes_run_parameters = %(passes_run_parameters)s, labels = %(labels)s,
       max_concurrency = coalesce(%(max_concurrency)s, max_concurrency)
 WHERE session_id = %(session_id)s

-- name: withdraw_offers_beyond_capacity
-- A renewal that lowers the capacity withdraws the session's newest open offers beyond
-- what it may now run (its live Attempts count against it): they would otherwise hold
-- their Runs from every other Worker until they expire. Those kept are the first a pull
-- answers (placement.open_offers' order). Nothing when the renewal says no capacity (a
-- Worker of an earlier version).
UPDATE qinglong.offers SET state = 'withdrawn'
 WHERE offer_id IN (
    SELECT o.offer_id FROM qinglong.offers o JOIN qinglong.runs r ON r.run_id = o.run_id
     WHERE o.session_id = %(session_id)s AND o.state = 'open'
       AND %(max_concurrency)s::integer IS NOT NULL
     ORDER BY o.created_at_ms, r.priority DESC, r.created_at_ms, r.run_id
    OFFSET greatest(0, %(max_concurrency)s::integer
                       - (SELECT count(*) FROM qinglong.attempts a
                           WHERE a.session_id = %(session_id)s
                             AND a.state IN ('claimed', 'starting', 'running'))))

-- name: withdraw_offers_for_other_labels
-- The session's open offers of Runs whose selector its new labels no longer satisfy go
-- back to the pool (a restarted Worker could still claim an offer its inbox kept). Offers
-- the new labels still satisfy stay.
UPDATE qinglong.offers o SET state = 'withdrawn'
  FROM qinglong.runs r
 WHERE o.session_id = %(session_id)s AND o.state = 'open' AND r.run_id = o.run_id
   AND NOT %(labels)s::jsonb @> r.worker_selector

-- name: drain_session
UPDATE qinglong.worker_sessions
   SET status = 'draining', renewed_at_ms = %(now)s, expires_at_ms = %(expires)s
 WHERE session_id = %(session_id)s
