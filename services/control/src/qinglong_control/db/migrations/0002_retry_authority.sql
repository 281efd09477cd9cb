-- 0002: the retry authority (SPEC R-RETRY-1, R-RETRY-2).
--
-- A task revision pins a retry policy (defaults: one Attempt). A Run waits in
-- `retry_wait` until `retry_at_ms` (DB time), then the reconcile cadence queues it again.
-- New legal Run transitions:
--   dispatching -> queued        a `claimed` Attempt's lease expired (it never started)
--   dispatching|running -> retry_wait   a start failure / failure the policy retries
--   lost|retry_wait -> failed    the policy is exhausted (ATTEMPTS_EXHAUSTED)
-- Landed migrations are never edited; every later change is a new numbered file.

ALTER TABLE qinglong.task_revisions
    ADD COLUMN retry_max_attempts integer NOT NULL DEFAULT 1
        CHECK (retry_max_attempts BETWEEN 1 AND 100),
    ADD COLUMN retry_initial_backoff_ms bigint NOT NULL DEFAULT 1000
        CHECK (retry_initial_backoff_ms BETWEEN 1 AND 86400000),
    ADD COLUMN retry_max_backoff_ms bigint NOT NULL DEFAULT 1000
        CHECK (retry_max_backoff_ms BETWEEN 1 AND 86400000),
    ADD COLUMN retry_multiplier_percent integer NOT NULL DEFAULT 200
        CHECK (retry_multiplier_percent BETWEEN 100 AND 1000),
    ADD COLUMN retry_on text[] NOT NULL DEFAULT '{}'
        CHECK (retry_on <@ ARRAY['failed', 'start_failed']::text[]),
    ADD CONSTRAINT task_revisions_retry_backoff_ordered
        CHECK (retry_max_backoff_ms >= retry_initial_backoff_ms);

ALTER TABLE qinglong.runs
    ADD COLUMN retry_at_ms qinglong.epoch_ms,
    ADD CONSTRAINT runs_retry_at_only_waiting
        CHECK ((state = 'retry_wait') = (retry_at_ms IS NOT NULL));

-- The retry step of the reconcile cadence scans these two small sets.
CREATE INDEX runs_lost_unretried ON qinglong.runs (updated_at_ms, run_id)
    WHERE state = 'lost' AND cancel_requested_at_ms IS NULL;
CREATE INDEX runs_retry_due ON qinglong.runs (retry_at_ms, run_id)
    WHERE state = 'retry_wait' AND cancel_requested_at_ms IS NULL;

CREATE OR REPLACE FUNCTION qinglong.enforce_run_transition() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state IN ('succeeded', 'failed', 'cancelled', 'timed_out') THEN
        RAISE EXCEPTION 'run % is terminal (%)', OLD.run_id, OLD.state
            USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_terminal_immutable';
    END IF;
    -- A durable cancel intent is a fact: once written it is neither withdrawn nor changed.
    IF OLD.cancel_requested_at_ms IS NOT NULL
       AND (NEW.cancel_requested_at_ms, NEW.cancel_reason, NEW.cancel_requested_by)
           IS DISTINCT FROM
           (OLD.cancel_requested_at_ms, OLD.cancel_reason, OLD.cancel_requested_by) THEN
        RAISE EXCEPTION 'cancel intent of run % is final', OLD.run_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_cancel_intent_final';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT (
           (OLD.state = 'created' AND NEW.state IN ('queued', 'cancelled', 'timed_out'))
        OR (OLD.state = 'queued' AND NEW.state IN ('dispatching', 'cancelled', 'timed_out'))
        OR (OLD.state = 'waiting_approval' AND NEW.state IN ('queued', 'cancelled', 'timed_out'))
        OR (OLD.state = 'dispatching' AND NEW.state IN (
                'queued', 'running', 'retry_wait', 'failed', 'cancelled', 'timed_out', 'lost'))
        OR (OLD.state = 'running' AND NEW.state IN (
                'retry_wait', 'succeeded', 'failed', 'cancelled', 'timed_out', 'lost'))
        OR (OLD.state = 'retry_wait' AND NEW.state IN ('queued', 'failed', 'cancelled', 'timed_out'))
        OR (OLD.state = 'lost' AND NEW.state IN (
                'retry_wait', 'queued', 'failed', 'cancelled', 'timed_out'))
    ) THEN
        RAISE EXCEPTION 'illegal run transition % -> %', OLD.state, NEW.state
            USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_legal_transition';
    END IF;
    RETURN NEW;
END
$$;
