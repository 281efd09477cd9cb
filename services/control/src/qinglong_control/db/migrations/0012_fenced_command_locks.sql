-- 0012: a fenced Worker command's locks and reads as one statement.
--
-- Every fenced command (the start facts, lease control, completion) began with six
-- statements in one round trip: the Attempt's advisory lock, the Session FOR SHARE, the
-- Run, the Attempt and the Lease FOR UPDATE, then DB time. Each statement cost the client
-- and the server its own protocol work (bench/bench_e2e.py: psycopg's pipeline machinery
-- was the largest single cost in control). This function takes the same locks in the same
-- order (a PL/pgSQL body runs its statements one after another) and answers one row:
-- each part's columns named `<part>__<column>`, all NULL for a row that does not exist,
-- and DB time read after the last lock (SPEC R-ACK-3). The locks are the transaction's,
-- held until the caller's COMMIT or ROLLBACK, exactly as before.

CREATE FUNCTION qinglong.lock_authority(p_attempt_id uuid, p_session_id uuid, p_run_id uuid)
    RETURNS TABLE (
        session__session_id uuid,
        session__worker_id text,
        session__generation bigint,
        session__status text,
        session__expires_at_ms bigint,
        run__run_id uuid,
        run__project_id text,
        run__revision_id uuid,
        run__state text,
        run__owner text,
        run__version bigint,
        run__event_sequence bigint,
        run__cancel_reason text,
        run__cancel_requested_at_ms bigint,
        run__timeout_ms bigint,
        run__deadline_at_ms bigint,
        run__error_code text,
        run__retry_max_attempts integer,
        run__retry_initial_backoff_ms bigint,
        run__retry_max_backoff_ms bigint,
        run__retry_multiplier_percent integer,
        run__retry_on text[],
        run__started_attempts bigint,
        attempt__attempt_id uuid,
        attempt__run_id uuid,
        attempt__state text,
        attempt__executor_type text,
        attempt__worker_id text,
        attempt__session_id uuid,
        attempt__worker_generation bigint,
        attempt__offer_id uuid,
        attempt__lease_generation integer,
        attempt__lease_version bigint,
        attempt__lease_token_digest text,
        attempt__attempt_number integer,
        attempt__starting_at_ms bigint,
        attempt__started_at_ms bigint,
        attempt__deadline_at_ms bigint,
        attempt__executor_handle text,
        attempt__log_artifact_id text,
        attempt__callback_sequence bigint,
        attempt__callback_token_digest text,
        attempt__error_code text,
        attempt__exit_code integer,
        attempt__finished_at_ms bigint,
        lease__attempt_id uuid,
        lease__run_id uuid,
        lease__worker_id text,
        lease__session_id uuid,
        lease__worker_generation bigint,
        lease__offer_id uuid,
        lease__lease_generation integer,
        lease__token_digest text,
        lease__version bigint,
        lease__status text,
        lease__expires_at_ms bigint,
        now_ms bigint
    )
    LANGUAGE plpgsql VOLATILE
    AS $$
BEGIN
    -- 1. The Attempt's advisory lock: serialises every command on one Attempt, even
    --    before its rows are found.
    PERFORM pg_advisory_xact_lock(hashtextextended('qinglong.attempt:' || p_attempt_id::text, 0));

    -- 2. The Session, FOR SHARE: a replacement waits for in-flight commands, and they
    --    for a replacement in flight.
    SELECT s.session_id, s.worker_id, s.generation, s.status, s.expires_at_ms
      INTO session__session_id, session__worker_id, session__generation, session__status,
           session__expires_at_ms
      FROM qinglong.worker_sessions s
     WHERE s.session_id = p_session_id
       FOR SHARE;

    -- 3. The Run, then the Attempt, FOR UPDATE.
    SELECT r.run_id, r.project_id, r.revision_id, r.state, r.owner, r.version,
           r.event_sequence, r.cancel_reason, r.cancel_requested_at_ms, tr.timeout_ms,
           r.deadline_at_ms, r.error_code, tr.retry_max_attempts,
           tr.retry_initial_backoff_ms, tr.retry_max_backoff_ms,
           tr.retry_multiplier_percent, tr.retry_on,
           (SELECT count(*) FROM qinglong.attempts sa
             WHERE sa.run_id = r.run_id AND sa.starting_at_ms IS NOT NULL)
      INTO run__run_id, run__project_id, run__revision_id, run__state, run__owner,
           run__version, run__event_sequence, run__cancel_reason,
           run__cancel_requested_at_ms, run__timeout_ms, run__deadline_at_ms,
           run__error_code, run__retry_max_attempts, run__retry_initial_backoff_ms,
           run__retry_max_backoff_ms, run__retry_multiplier_percent, run__retry_on,
           run__started_attempts
      FROM qinglong.runs r
      JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
     WHERE r.run_id = p_run_id
       FOR UPDATE OF r;

    SELECT a.attempt_id, a.run_id, a.state, a.executor_type, a.worker_id, a.session_id,
           a.worker_generation, a.offer_id, a.lease_generation, a.lease_version,
           a.lease_token_digest, a.attempt_number, a.starting_at_ms, a.started_at_ms,
           a.deadline_at_ms, a.executor_handle, a.log_artifact_id, a.callback_sequence,
           a.callback_token_digest, a.error_code, a.exit_code, a.finished_at_ms
      INTO attempt__attempt_id, attempt__run_id, attempt__state, attempt__executor_type,
           attempt__worker_id, attempt__session_id, attempt__worker_generation,
           attempt__offer_id, attempt__lease_generation, attempt__lease_version,
           attempt__lease_token_digest, attempt__attempt_number, attempt__starting_at_ms,
           attempt__started_at_ms, attempt__deadline_at_ms, attempt__executor_handle,
           attempt__log_artifact_id, attempt__callback_sequence,
           attempt__callback_token_digest, attempt__error_code, attempt__exit_code,
           attempt__finished_at_ms
      FROM qinglong.attempts a
     WHERE a.attempt_id = p_attempt_id
       FOR UPDATE;

    -- 4. The Run Lease, FOR UPDATE.
    SELECT l.attempt_id, l.run_id, l.worker_id, l.session_id, l.worker_generation,
           l.offer_id, l.lease_generation, l.token_digest, l.version, l.status,
           l.expires_at_ms
      INTO lease__attempt_id, lease__run_id, lease__worker_id, lease__session_id,
           lease__worker_generation, lease__offer_id, lease__lease_generation,
           lease__token_digest, lease__version, lease__status, lease__expires_at_ms
      FROM qinglong.run_leases l
     WHERE l.attempt_id = p_attempt_id
       FOR UPDATE;

    -- 5. DB time, only after every lock is held.
    now_ms := qinglong.db_now_ms();
    RETURN NEXT;
END
$$;

REVOKE EXECUTE ON FUNCTION qinglong.lock_authority(uuid, uuid, uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION qinglong.lock_authority(uuid, uuid, uuid) TO qinglong_runtime;
