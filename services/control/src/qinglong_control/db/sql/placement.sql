-- Statements of db/placement.py.

-- name: lock_session_shared
SELECT session_id, worker_id, generation, status, expires_at_ms
  FROM qinglong.worker_sessions WHERE session_id = %s FOR SHARE

-- name: lock_session_pull
-- Pulls of one session take turns, so concurrent pulls cannot each see the same free room
-- and together place more offers than the session may run. (ACKs do not take it.)
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.pull:' || %s, 0))

-- name: session_room
SELECT s.max_concurrency - (SELECT count(*) FROM qinglong.attempts a
                              WHERE a.session_id = s.session_id
                                AND a.state IN ('claimed', 'starting', 'running'))
  FROM qinglong.worker_sessions s WHERE s.session_id = %s

-- name: lock_candidates
-- Queued Runs of an executor type this session runs, of a project its Worker serves, with
-- no intent to cancel and no live offer elsewhere: the highest priority first, the oldest
-- first among equals (migrations 0042, 0043). SKIP LOCKED lets many
-- sessions pull at once without waiting or ever taking the same Run. The session's room
-- is computed in the same statement, so the whole read side is one round trip: new
-- placements never exceed what the answer carries (max_offers minus offers already open)
-- nor what the session may run (max_concurrency minus live Attempts and open offers). A
-- session that is not the caller's live, online, unexpired incarnation has no room at
-- all; the caller is then refused in Python. Nor has a session of a cordoned Worker
-- (0041): it places nothing, however much room its capacity leaves.
--
-- Branches of which only some run (the others' one-time filter is false). The queue is
-- read in two parts (migrations 0036, 0037): the Runs without a selector, which any Worker
-- may take, and — only for a session that declared labels — those with one, so a Worker
-- without labels never reads past Runs waiting for a label nobody has. A Worker of every
-- project reads the whole queue's two parts in order (priority, then age); a Worker of
-- some projects reads each of its projects' two parts and takes the first of those in the
-- same order — reading the whole queue
-- instead, it would scan every other project's backlog at each pull (80 ms with 85,000
-- Runs queued elsewhere). Every part places a Run on the same conditions; they are written
-- out in each, and must stay the same (test_worker_projects.py and
-- test_sessions_and_claim.py hold them to it). Each scan locks up to the room, and the
-- first of them in that order are taken: a Worker of K projects holds up to K x room Runs until COMMIT
-- (one pull's two round trips), twice that with labels. Another pull skips those
-- and goes on scanning; only on a nearly empty queue does it come back short, and pulls
-- again at its next tick. Locking after the pick instead would make the pulls of Workers
-- with the same projects all pick the same first Runs, and all but one come back empty.
WITH session AS MATERIALIZED (
    SELECT s.session_id, s.executor_types, s.passes_run_parameters, s.labels,
           -- The projects its Worker serves (NULL: every project).
           w.project_ids,
           CASE WHEN w.cordoned THEN 0 ELSE
           greatest(0, least(
               %(max_offers)s - open.offers,
               s.max_concurrency - open.offers
                 - (SELECT count(*) FROM qinglong.attempts a
                     WHERE a.session_id = s.session_id
                       AND a.state IN ('claimed', 'starting', 'running')))) END AS room
      FROM qinglong.worker_sessions s
      -- Its Worker's identity, read once for its projects and its cordon.
      LEFT JOIN qinglong.worker_identities w ON w.worker_id = s.worker_id
     CROSS JOIN LATERAL (
         SELECT count(*) AS offers FROM qinglong.offers o
          WHERE o.session_id = s.session_id AND o.state = 'open'
            AND o.expires_at_ms > qinglong.db_now_ms()) open
     WHERE s.session_id = %(session_id)s AND s.worker_id = %(worker_id)s
       AND s.generation = %(generation)s AND s.status = 'online'
       AND s.expires_at_ms > qinglong.db_now_ms()
)
SELECT picked.run_id FROM (
    -- A Worker of every project: the Runs any Worker may take, by priority and age, from
    -- their own index (runs_queued_for_any_worker_by_priority, migrations 0036, 0043)...
    SELECT for_any.run_id, for_any.priority, for_any.created_at_ms FROM (
        SELECT r.run_id, r.priority, r.created_at_ms
          FROM qinglong.runs r, session
         -- A scalar subquery, read once before the scan (an InitPlan): it decides whether
         -- this branch reads anything at all.
         WHERE (SELECT project_ids IS NULL FROM session)
           AND r.state = 'queued'
           AND r.worker_selector = '{}'::jsonb
           AND r.cancel_requested_at_ms IS NULL
           -- A disabled project's Runs are stopped by the reconciler; none starts meanwhile.
           AND EXISTS (SELECT 1 FROM qinglong.projects p
                        WHERE p.project_id = r.project_id AND p.status = 'active')
           AND r.executor_type = ANY(session.executor_types)
           -- A Worker that does not pass parameters on runs only Runs without any.
           AND (session.passes_run_parameters OR r.parameters = '{}'::jsonb)
           AND NOT EXISTS (SELECT 1 FROM qinglong.offers o
                            WHERE o.run_id = r.run_id AND o.state = 'open'
                              AND o.expires_at_ms > qinglong.db_now_ms())
         ORDER BY r.priority DESC, r.created_at_ms, r.run_id
         LIMIT coalesce((SELECT room FROM session), 0)
           FOR UPDATE OF r SKIP LOCKED) for_any
    UNION ALL
    -- ...and, only for a session that declared labels, the Runs with a selector
    -- (runs_queued_with_selector_by_priority), past those its labels do not satisfy. A
    -- Worker without labels never reads a Run it may not take, however many wait for a
    -- label nobody has.
    SELECT selective.run_id, selective.priority, selective.created_at_ms FROM (
        SELECT r.run_id, r.priority, r.created_at_ms
          FROM qinglong.runs r, session
         WHERE (SELECT project_ids IS NULL AND labels <> '{}'::jsonb FROM session)
           AND r.state = 'queued'
           AND r.worker_selector <> '{}'::jsonb
           AND r.cancel_requested_at_ms IS NULL
           -- A disabled project's Runs are stopped by the reconciler; none starts meanwhile.
           AND EXISTS (SELECT 1 FROM qinglong.projects p
                        WHERE p.project_id = r.project_id AND p.status = 'active')
           AND r.executor_type = ANY(session.executor_types)
           -- A Worker that does not pass parameters on runs only Runs without any.
           AND (session.passes_run_parameters OR r.parameters = '{}'::jsonb)
           -- The session's labels include the Run's selector (any labels include '{}').
           AND session.labels @> r.worker_selector
           AND NOT EXISTS (SELECT 1 FROM qinglong.offers o
                            WHERE o.run_id = r.run_id AND o.state = 'open'
                              AND o.expires_at_ms > qinglong.db_now_ms())
         ORDER BY r.priority DESC, r.created_at_ms, r.run_id
         LIMIT coalesce((SELECT room FROM session), 0)
           FOR UPDATE OF r SKIP LOCKED) selective
    UNION ALL
    -- A Worker of some projects: each served project's queue, in the same two parts
    -- (runs_queued_for_any_worker_by_project_priority and
    -- runs_queued_with_selector_by_project_priority: 0037, 0043).
    SELECT by_project.run_id, by_project.priority, by_project.created_at_ms
      FROM session, unnest(session.project_ids) AS served (project_id)
     CROSS JOIN LATERAL (
        -- (FOR UPDATE is allowed in a subquery, not in a part of a UNION itself.)
        SELECT * FROM (
         SELECT r.run_id, r.priority, r.created_at_ms
           FROM qinglong.runs r
          WHERE r.project_id = served.project_id
            AND r.state = 'queued'
            AND r.worker_selector = '{}'::jsonb
            AND r.cancel_requested_at_ms IS NULL
            AND EXISTS (SELECT 1 FROM qinglong.projects p
                         WHERE p.project_id = r.project_id AND p.status = 'active')
            AND r.executor_type = ANY(session.executor_types)
            -- A Worker that does not pass parameters on runs only Runs without any.
            AND (session.passes_run_parameters OR r.parameters = '{}'::jsonb)
            AND NOT EXISTS (SELECT 1 FROM qinglong.offers o
                             WHERE o.run_id = r.run_id AND o.state = 'open'
                               AND o.expires_at_ms > qinglong.db_now_ms())
          ORDER BY r.priority DESC, r.created_at_ms, r.run_id
          LIMIT session.room
            FOR UPDATE OF r SKIP LOCKED) for_any
        UNION ALL
        SELECT * FROM (
         SELECT r.run_id, r.priority, r.created_at_ms
           FROM qinglong.runs r
          WHERE session.labels <> '{}'::jsonb
            AND r.project_id = served.project_id
            AND r.state = 'queued'
            AND r.worker_selector <> '{}'::jsonb
            AND r.cancel_requested_at_ms IS NULL
            AND EXISTS (SELECT 1 FROM qinglong.projects p
                         WHERE p.project_id = r.project_id AND p.status = 'active')
            AND r.executor_type = ANY(session.executor_types)
            -- A Worker that does not pass parameters on runs only Runs without any.
            AND (session.passes_run_parameters OR r.parameters = '{}'::jsonb)
            -- The session's labels include the Run's selector (any labels include '{}').
            AND session.labels @> r.worker_selector
            AND NOT EXISTS (SELECT 1 FROM qinglong.offers o
                             WHERE o.run_id = r.run_id AND o.state = 'open'
                               AND o.expires_at_ms > qinglong.db_now_ms())
          ORDER BY r.priority DESC, r.created_at_ms, r.run_id
          LIMIT session.room
            FOR UPDATE OF r SKIP LOCKED) selective) by_project
) picked
 ORDER BY picked.priority DESC, picked.created_at_ms, picked.run_id
 LIMIT coalesce((SELECT room FROM session), 0)

-- name: expire_stale_offers
UPDATE qinglong.offers SET state = 'expired'
 WHERE run_id = ANY(%(run_ids)s) AND state = 'open' AND expires_at_ms <= %(now)s

-- name: insert_offers
INSERT INTO qinglong.offers
       (offer_id, run_id, session_id, worker_id, worker_generation, state,
        created_at_ms, expires_at_ms)
SELECT gen_random_uuid(), run_id, %(session_id)s, %(worker_id)s, %(generation)s, 'open',
       %(now)s, %(expires)s
  FROM unnest(%(run_ids)s::uuid[]) AS run_id
-- A concurrent pull may have committed an offer for the same Run after this statement's
-- candidate snapshot; that Run is simply not ours.
ON CONFLICT (run_id) WHERE state = 'open' DO NOTHING

-- name: open_offers
-- Everything the session holds open, with the pinned plan (stable offer ids on re-pull),
-- of the projects its Worker serves now (an offer made before they changed is not shown
-- again, and cannot be claimed); none while its Worker is cordoned (0041). Offers of
-- earlier pulls first, and those of one pull in placement's order (priority, then age), so
-- that an answer cut short (wire.offers_that_fit) keeps the most urgent.
SELECT o.offer_id, o.run_id, r.project_id, r.task_id, tr.revision_id, tr.revision_number,
       tr.executor_type, tr.command, tr.timeout_ms, r.parameters, o.expires_at_ms
  FROM qinglong.offers o
  JOIN qinglong.runs r ON r.run_id = o.run_id
  JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
  JOIN qinglong.worker_identities w ON w.worker_id = o.worker_id
 WHERE o.session_id = %(session_id)s AND o.state = 'open' AND o.expires_at_ms > %(now)s
   AND (w.project_ids IS NULL OR r.project_id = ANY (w.project_ids))
   AND NOT w.cordoned
 ORDER BY o.created_at_ms, r.priority DESC, r.created_at_ms, r.run_id

-- name: lock_claim_run
-- served: whether the claiming Worker serves the Run's project now (its projects may have
-- changed since the offer was made; NULL when the Worker is unknown). worker_cordoned:
-- whether an administrator cordoned it since (0041). project_active: whether the project
-- is still active (it may have been disabled since; its Runs are stopped by the
-- reconciler, and none may start meanwhile).
SELECT r.run_id, r.project_id, r.state, r.attempt_count, r.event_sequence,
       r.cancel_requested_at_ms,
       (SELECT w.project_ids IS NULL OR r.project_id = ANY (w.project_ids)
          FROM qinglong.worker_identities w WHERE w.worker_id = %(worker_id)s) AS served,
       (SELECT w.cordoned
          FROM qinglong.worker_identities w WHERE w.worker_id = %(worker_id)s)
         AS worker_cordoned,
       (SELECT p.status = 'active'
          FROM qinglong.projects p WHERE p.project_id = r.project_id) AS project_active
  FROM qinglong.runs r WHERE r.run_id = %(run_id)s FOR UPDATE OF r

-- name: lock_offer
SELECT offer_id, run_id, session_id, worker_id, worker_generation, state, expires_at_ms
  FROM qinglong.offers WHERE offer_id = %s FOR UPDATE

-- name: existing_claim
SELECT a.attempt_id, l.lease_generation, l.version AS lease_version, l.status AS lease_status,
       l.token_digest, l.expires_at_ms
  FROM qinglong.attempts a JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id
 WHERE a.offer_id = %s

-- name: plan
SELECT tr.executor_type, tr.command, tr.timeout_ms, tr.revision_id, tr.revision_number,
       r.task_id, r.parameters
  FROM qinglong.runs r JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
 WHERE r.run_id = %s

-- name: claim_offer
UPDATE qinglong.offers SET state = 'claimed', claimed_at_ms = %(now)s
 WHERE offer_id = %(offer_id)s

-- name: run_dispatching
-- The Run's deadline is its newest Attempt's: a new Attempt has none until it starts (an
-- earlier Attempt's, long past, would read as an overdue Run).
UPDATE qinglong.runs
   SET state = 'dispatching', attempt_count = %(attempt_number)s, version = version + 1,
       deadline_at_ms = NULL, updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s

-- name: insert_attempt
INSERT INTO qinglong.attempts
       (attempt_id, run_id, attempt_number, state, executor_type, worker_id, session_id,
        worker_generation, offer_id, lease_generation, lease_version, lease_token_digest,
        claimed_at_ms)
VALUES (%(attempt_id)s, %(run_id)s, %(attempt_number)s, 'claimed', %(executor_type)s,
        %(worker_id)s, %(session_id)s, %(generation)s, %(offer_id)s, %(lease_generation)s, 1,
        %(token_digest)s, %(now)s)

-- name: insert_lease
INSERT INTO qinglong.run_leases
       (attempt_id, run_id, worker_id, session_id, worker_generation, offer_id,
        lease_generation, token_digest, version, status, acquired_at_ms, renewed_at_ms,
        expires_at_ms)
VALUES (%(attempt_id)s, %(run_id)s, %(worker_id)s, %(session_id)s, %(generation)s,
        %(offer_id)s, %(lease_generation)s, %(token_digest)s, 1, 'leased', %(now)s, %(now)s,
        %(lease_expires)s)
