-- 0046: a task's concurrency limit and the slots its Runs hold, each written once.
--
-- Admission (db/concurrency_slots.py) reads both twice: to find the tasks whose next
-- waiting Run may be queued, and again under the task's lock before it queues one; the
-- trigger reads the limit to know whether a new Run waits. One definition each, so no two
-- readers can disagree.
--
-- qinglong.task_max_concurrent_runs: the task's limit is its newest revision's
-- max_concurrent_runs (0044), whatever revision a Run pins: a deploy limited to one at a
-- time stays so when someone triggers an older revision; revising the limit changes it for
-- the Runs still waiting. NULL: no limit.
--
-- qinglong.task_slots_held: how many of the task's Runs hold a slot:
--   * a Run queued, dispatching, running, waiting for a retry, or lost (0045's
--     runs_holding_slot_by_task) — each may have, or will have, an executor;
--   * a Run that ended after p_lost_since_ms (0045's runs_ended_by_task) with an Attempt
--     that reached `starting` and whose lease ran out after p_lost_since_ms: its Worker,
--     cut off from the control plane, may still be stopping that executor (the caller
--     passes DB time minus the Workers' stop bound). A Run ends after its lease ran out,
--     so reading only the Runs that ended since loses none of them.
-- Runs of every revision count.

CREATE FUNCTION qinglong.task_max_concurrent_runs(p_task_id uuid)
RETURNS integer
LANGUAGE sql STABLE
AS $$
    SELECT tr.max_concurrent_runs FROM qinglong.task_revisions tr
     WHERE tr.task_id = p_task_id
     ORDER BY tr.revision_number DESC
     LIMIT 1
$$;

CREATE FUNCTION qinglong.task_slots_held(p_task_id uuid, p_lost_since_ms bigint)
RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT (SELECT count(*) FROM qinglong.runs r
             WHERE r.task_id = p_task_id
               AND r.state IN ('queued', 'dispatching', 'running', 'retry_wait', 'lost'))
         + (SELECT count(*) FROM qinglong.runs r
             WHERE r.task_id = p_task_id AND r.finished_at_ms > p_lost_since_ms
               AND EXISTS (SELECT 1 FROM qinglong.attempts a
                             JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id
                            WHERE a.run_id = r.run_id AND a.starting_at_ms IS NOT NULL
                              AND l.status = 'expired'
                              AND l.expires_at_ms > p_lost_since_ms))
$$;

REVOKE EXECUTE ON FUNCTION qinglong.task_max_concurrent_runs(uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION qinglong.task_max_concurrent_runs(uuid) TO qinglong_runtime;
REVOKE EXECUTE ON FUNCTION qinglong.task_slots_held(uuid, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION qinglong.task_slots_held(uuid, bigint) TO qinglong_runtime;
