-- 0047: how many of a task's Runs hold a slot, written once (qinglong.task_slots_held).
--
-- Admission (db/concurrency_slots.py) counts them twice: to find the tasks whose next
-- waiting Run may be queued, and again under the task's lock before it queues one. One
-- function, so the two cannot disagree about what holds a slot:
--
--   * a Run queued, dispatching, running, waiting for a retry, or lost (0046's
--     runs_holding_slot_by_task) — each may have, or will have, an executor;
--   * a Run already ended whose Attempt had started (`starting`) and then lost its lease
--     after p_lost_since_ms: its Worker, cut off from the control plane, may still be
--     stopping that executor (the caller passes DB time minus the Workers' stop bound;
--     0046's run_leases_expired_by_expiry reads only those leases).
--
-- Runs of any revision count: a limit bounds the task, whatever revision a Run pins.

CREATE FUNCTION qinglong.task_slots_held(p_task_id uuid, p_lost_since_ms bigint)
RETURNS bigint
LANGUAGE sql STABLE
AS $$
    SELECT (SELECT count(*) FROM qinglong.runs r
             WHERE r.task_id = p_task_id
               AND r.state IN ('queued', 'dispatching', 'running', 'retry_wait', 'lost'))
         + (SELECT count(DISTINCT r.run_id)
              FROM qinglong.run_leases l
              JOIN qinglong.attempts a ON a.attempt_id = l.attempt_id
              JOIN qinglong.runs r ON r.run_id = l.run_id
             WHERE l.status = 'expired' AND l.expires_at_ms > p_lost_since_ms
               AND a.starting_at_ms IS NOT NULL
               AND r.task_id = p_task_id
               AND r.state IN ('succeeded', 'failed', 'cancelled', 'timed_out'))
$$;

REVOKE EXECUTE ON FUNCTION qinglong.task_slots_held(uuid, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION qinglong.task_slots_held(uuid, bigint) TO qinglong_runtime;
