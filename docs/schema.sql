CREATE SCHEMA qinglong;

CREATE DOMAIN qinglong.epoch_ms AS bigint
	CONSTRAINT epoch_ms_check CHECK ((VALUE >= 0));

CREATE DOMAIN qinglong.sha256_hex AS text
	CONSTRAINT sha256_hex_check CHECK ((VALUE ~ '^[0-9a-f]{64}$'::text));

CREATE DOMAIN qinglong.slug AS text
	CONSTRAINT slug_check CHECK ((VALUE ~ '^[a-z0-9][a-z0-9-]{0,62}$'::text));

CREATE FUNCTION qinglong.db_now_ms() RETURNS bigint
    LANGUAGE sql PARALLEL SAFE
    AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;

CREATE FUNCTION qinglong.enforce_approval_decided_once() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF OLD.state <> 'pending'
       OR (NEW.approval_id, NEW.project_id, NEW.method, NEW.request_type, NEW.request,
           NEW.request_digest, NEW.run_id, NEW.requested_by, NEW.requested_by_kind,
           NEW.audit_id, NEW.requested_at_ms, NEW.expires_at_ms)
          IS DISTINCT FROM
          (OLD.approval_id, OLD.project_id, OLD.method, OLD.request_type, OLD.request,
           OLD.request_digest, OLD.run_id, OLD.requested_by, OLD.requested_by_kind,
           OLD.audit_id, OLD.requested_at_ms, OLD.expires_at_ms) THEN
        RAISE EXCEPTION 'approval request % is decided or its request is fixed', OLD.approval_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'approval_requests_final';
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION qinglong.enforce_attempt_transition() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF OLD.state IN ('succeeded', 'failed', 'cancelled', 'timed_out', 'lost') THEN
        RAISE EXCEPTION 'attempt % is terminal (%)', OLD.attempt_id, OLD.state
            USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_terminal_immutable';
    END IF;
    -- Who owns the Attempt under which authority never changes: only its progress does.
    IF (NEW.run_id, NEW.attempt_number, NEW.executor_type, NEW.worker_id, NEW.session_id,
        NEW.worker_generation, NEW.offer_id, NEW.lease_generation, NEW.lease_token_digest,
        NEW.claimed_at_ms)
       IS DISTINCT FROM
       (OLD.run_id, OLD.attempt_number, OLD.executor_type, OLD.worker_id, OLD.session_id,
        OLD.worker_generation, OLD.offer_id, OLD.lease_generation, OLD.lease_token_digest,
        OLD.claimed_at_ms) THEN
        RAISE EXCEPTION 'the authority of attempt % is fixed at claim', OLD.attempt_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_authority_fixed';
    END IF;
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT (
           (OLD.state = 'claimed' AND NEW.state IN ('starting', 'cancelled', 'timed_out', 'lost'))
        OR (OLD.state = 'starting' AND NEW.state IN ('running', 'failed', 'cancelled', 'timed_out', 'lost'))
        OR (OLD.state = 'running' AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'timed_out', 'lost'))
    ) THEN
        RAISE EXCEPTION 'illegal attempt transition % -> %', OLD.state, NEW.state
            USING ERRCODE = 'check_violation', CONSTRAINT = 'attempts_legal_transition';
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION qinglong.enforce_event_sequence() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    current_sequence bigint;
    last_sequence bigint;
BEGIN
    SELECT event_sequence INTO current_sequence FROM qinglong.runs WHERE run_id = NEW.run_id;
    SELECT max(sequence) INTO last_sequence FROM qinglong.run_events WHERE run_id = NEW.run_id;
    IF NEW.sequence <> coalesce(last_sequence, 0) + 1 OR NEW.sequence > current_sequence THEN
        RAISE EXCEPTION 'event sequence % of run % is not the next one', NEW.sequence, NEW.run_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'run_events_gapless';
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION qinglong.enforce_join_token_single_use() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF OLD.used_at_ms IS NOT NULL
       OR (NEW.token_digest, NEW.worker_id, NEW.created_at_ms, NEW.expires_at_ms,
           NEW.issue_request_id)
          IS DISTINCT FROM
          (OLD.token_digest, OLD.worker_id, OLD.created_at_ms, OLD.expires_at_ms,
           OLD.issue_request_id) THEN
        RAISE EXCEPTION 'join token of worker % is used or fixed', OLD.worker_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'worker_join_tokens_single_use';
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION qinglong.enforce_lease_progress() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF OLD.status <> 'leased' THEN
        RAISE EXCEPTION 'lease of attempt % is final (%)', OLD.attempt_id, OLD.status
            USING ERRCODE = 'check_violation', CONSTRAINT = 'run_leases_final';
    END IF;
    IF NEW.version < OLD.version
       OR (NEW.attempt_id, NEW.run_id, NEW.worker_id, NEW.session_id, NEW.worker_generation,
           NEW.offer_id, NEW.lease_generation, NEW.token_digest, NEW.acquired_at_ms)
          IS DISTINCT FROM
          (OLD.attempt_id, OLD.run_id, OLD.worker_id, OLD.session_id, OLD.worker_generation,
           OLD.offer_id, OLD.lease_generation, OLD.token_digest, OLD.acquired_at_ms) THEN
        RAISE EXCEPTION 'lease of attempt % may only advance', OLD.attempt_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'run_leases_forward_only';
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION qinglong.enforce_run_transition() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
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

CREATE FUNCTION qinglong.lock_authority(p_attempt_id uuid, p_session_id uuid, p_run_id uuid) RETURNS TABLE(session__session_id uuid, session__worker_id text, session__generation bigint, session__status text, session__expires_at_ms bigint, run__run_id uuid, run__project_id text, run__revision_id uuid, run__state text, run__owner text, run__version bigint, run__event_sequence bigint, run__cancel_reason text, run__cancel_requested_at_ms bigint, run__timeout_ms bigint, run__deadline_at_ms bigint, run__error_code text, run__retry_max_attempts integer, run__retry_initial_backoff_ms bigint, run__retry_max_backoff_ms bigint, run__retry_multiplier_percent integer, run__retry_on text[], run__started_attempts bigint, attempt__attempt_id uuid, attempt__run_id uuid, attempt__state text, attempt__executor_type text, attempt__worker_id text, attempt__session_id uuid, attempt__worker_generation bigint, attempt__offer_id uuid, attempt__lease_generation integer, attempt__lease_version bigint, attempt__lease_token_digest text, attempt__attempt_number integer, attempt__starting_at_ms bigint, attempt__started_at_ms bigint, attempt__deadline_at_ms bigint, attempt__executor_handle text, attempt__log_artifact_id text, attempt__callback_sequence bigint, attempt__callback_token_digest text, attempt__error_code text, attempt__exit_code integer, attempt__finished_at_ms bigint, lease__attempt_id uuid, lease__run_id uuid, lease__worker_id text, lease__session_id uuid, lease__worker_generation bigint, lease__offer_id uuid, lease__lease_generation integer, lease__token_digest text, lease__version bigint, lease__status text, lease__expires_at_ms bigint, now_ms bigint)
    LANGUAGE plpgsql
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

CREATE FUNCTION qinglong.prune_security_audit(p_max_age_ms bigint, p_limit integer) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    -- The floor; qinglong_control.domain.audit_retention.AUDIT_RETENTION_FLOOR_MS says the
    -- same, and a contract test holds the two together.
    floor_ms CONSTANT bigint := 7 * 24 * 3600 * 1000;
    cutoff bigint;
    removed integer;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION 'the prune limit must be 1..10000'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := qinglong.db_now_ms() - greatest(coalesce(p_max_age_ms, floor_ms), floor_ms);
    DELETE FROM qinglong.security_audit
     WHERE audit_id IN (
           SELECT audit_id FROM qinglong.security_audit
            WHERE occurred_at_ms < cutoff
            ORDER BY occurred_at_ms
            LIMIT p_limit
              FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS removed = ROW_COUNT;
    RETURN removed;
END
$$;

CREATE FUNCTION qinglong.schema_version() RETURNS integer
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$ SELECT coalesce(max(version), 0) FROM public.qinglong_schema_migrations $$;

CREATE FUNCTION qinglong.task_max_concurrent_runs(p_task_id uuid) RETURNS integer
    LANGUAGE sql STABLE
    AS $$
    SELECT tr.max_concurrent_runs FROM qinglong.task_revisions tr
     WHERE tr.task_id = p_task_id
     ORDER BY tr.revision_number DESC
     LIMIT 1
$$;

CREATE FUNCTION qinglong.task_slots_held(p_task_id uuid, p_lost_since_ms bigint) RETURNS bigint
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

CREATE TABLE public.qinglong_schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at_ms bigint NOT NULL,
    CONSTRAINT qinglong_schema_migrations_checksum_check CHECK ((checksum ~ '^[0-9a-f]{64}$'::text))
);

CREATE TABLE qinglong.approval_requests (
    approval_id uuid NOT NULL,
    project_id qinglong.slug NOT NULL,
    method text NOT NULL,
    request_type text NOT NULL,
    request bytea NOT NULL,
    request_digest bytea NOT NULL,
    run_id uuid,
    requested_by uuid NOT NULL,
    requested_by_kind text NOT NULL,
    audit_id uuid NOT NULL,
    requested_at_ms qinglong.epoch_ms NOT NULL,
    expires_at_ms qinglong.epoch_ms NOT NULL,
    state text DEFAULT 'pending'::text NOT NULL,
    decided_by uuid,
    decided_at_ms qinglong.epoch_ms,
    note text,
    result text,
    CONSTRAINT approval_requests_decision_whole CHECK ((((state = 'pending'::text) AND (decided_at_ms IS NULL) AND (decided_by IS NULL) AND (result IS NULL)) OR ((state = 'approved'::text) AND (decided_at_ms IS NOT NULL) AND (decided_by IS NOT NULL) AND (result IS NOT NULL)) OR ((state = 'denied'::text) AND (decided_at_ms IS NOT NULL) AND (decided_by IS NOT NULL) AND (result IS NULL)) OR ((state = 'expired'::text) AND (decided_at_ms IS NOT NULL) AND (decided_by IS NULL) AND (result IS NULL)))),
    CONSTRAINT approval_requests_expiry_after_request CHECK (((expires_at_ms)::bigint > (requested_at_ms)::bigint)),
    CONSTRAINT approval_requests_method_check CHECK (((length(method) >= 1) AND (length(method) <= 200))),
    CONSTRAINT approval_requests_note_check CHECK ((octet_length(note) <= 500)),
    CONSTRAINT approval_requests_request_check CHECK ((octet_length(request) <= 8192)),
    CONSTRAINT approval_requests_request_digest_check CHECK ((octet_length(request_digest) = 32)),
    CONSTRAINT approval_requests_request_type_check CHECK (((length(request_type) >= 1) AND (length(request_type) <= 200))),
    CONSTRAINT approval_requests_requested_by_kind_check CHECK ((requested_by_kind = ANY (ARRAY['user'::text, 'agent'::text]))),
    CONSTRAINT approval_requests_result_check CHECK ((result ~ '^[A-Z][A-Z0-9_]{0,63}$'::text)),
    CONSTRAINT approval_requests_state_check CHECK ((state = ANY (ARRAY['pending'::text, 'approved'::text, 'denied'::text, 'expired'::text])))
);

CREATE TABLE qinglong.principals (
    principal_id uuid NOT NULL,
    kind text NOT NULL,
    name text NOT NULL,
    status text DEFAULT 'active'::text NOT NULL,
    created_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    create_request_id text,
    CONSTRAINT principals_create_request_id_check CHECK ((create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)),
    CONSTRAINT principals_kind_check CHECK ((kind = ANY (ARRAY['user'::text, 'agent'::text, 'worker'::text, 'service'::text]))),
    CONSTRAINT principals_name_check CHECK (((length(name) >= 1) AND (length(name) <= 200))),
    CONSTRAINT principals_status_check CHECK ((status = ANY (ARRAY['active'::text, 'disabled'::text])))
);

CREATE VIEW qinglong.approval_projection AS
 SELECT a.approval_id,
    a.project_id,
        CASE
            WHEN ((a.state = 'pending'::text) AND ((a.expires_at_ms)::bigint <= qinglong.db_now_ms())) THEN 'expired'::text
            ELSE a.state
        END AS state,
    a.method,
    a.request_type,
    a.request,
    a.run_id,
    a.requested_by,
    a.requested_by_kind,
    rp.name AS requested_by_name,
    a.audit_id,
    a.requested_at_ms,
    a.expires_at_ms,
    a.decided_by,
    dp.name AS decided_by_name,
    a.decided_at_ms,
    a.note,
    a.result
   FROM ((qinglong.approval_requests a
     JOIN qinglong.principals rp ON ((rp.principal_id = a.requested_by)))
     LEFT JOIN qinglong.principals dp ON ((dp.principal_id = a.decided_by)));

CREATE TABLE qinglong.attempt_output (
    attempt_id uuid NOT NULL,
    end_offset bigint NOT NULL,
    first_offset bigint NOT NULL,
    created_at_ms qinglong.epoch_ms NOT NULL,
    updated_at_ms qinglong.epoch_ms NOT NULL,
    CONSTRAINT attempt_output_check CHECK ((first_offset <= end_offset)),
    CONSTRAINT attempt_output_end_offset_check CHECK (((end_offset >= 1) AND (end_offset <= '9007199254740991'::bigint))),
    CONSTRAINT attempt_output_first_offset_check CHECK ((first_offset >= 0))
);

CREATE TABLE qinglong.attempt_output_chunks (
    attempt_id uuid NOT NULL,
    start_offset bigint NOT NULL,
    end_offset bigint NOT NULL,
    data bytea NOT NULL,
    CONSTRAINT attempt_output_chunks_check CHECK ((end_offset = (start_offset + octet_length(data)))),
    CONSTRAINT attempt_output_chunks_data_check CHECK (((octet_length(data) >= 1) AND (octet_length(data) <= 65536))),
    CONSTRAINT attempt_output_chunks_start_offset_check CHECK ((start_offset >= 0))
);

CREATE TABLE qinglong.attempts (
    attempt_id uuid NOT NULL,
    run_id uuid NOT NULL,
    attempt_number integer NOT NULL,
    state text NOT NULL,
    executor_type text NOT NULL,
    worker_id qinglong.slug NOT NULL,
    session_id uuid NOT NULL,
    worker_generation bigint NOT NULL,
    offer_id uuid NOT NULL,
    lease_generation integer NOT NULL,
    lease_version bigint NOT NULL,
    lease_token_digest qinglong.sha256_hex NOT NULL,
    claimed_at_ms qinglong.epoch_ms NOT NULL,
    starting_at_ms qinglong.epoch_ms,
    started_at_ms qinglong.epoch_ms,
    deadline_at_ms qinglong.epoch_ms,
    finished_at_ms qinglong.epoch_ms,
    executor_handle text,
    log_artifact_id text,
    callback_sequence bigint,
    callback_token_digest qinglong.sha256_hex,
    exit_code integer,
    error_code text,
    error_summary text,
    output_bytes bigint,
    CONSTRAINT attempts_attempt_number_check CHECK ((attempt_number >= 1)),
    CONSTRAINT attempts_callback_sequence_check CHECK ((callback_sequence >= 0)),
    CONSTRAINT attempts_check CHECK (((state = ANY (ARRAY['succeeded'::text, 'failed'::text, 'cancelled'::text, 'timed_out'::text, 'lost'::text])) = (finished_at_ms IS NOT NULL))),
    CONSTRAINT attempts_check1 CHECK (((state <> ALL (ARRAY['running'::text, 'succeeded'::text])) OR (executor_handle IS NOT NULL))),
    CONSTRAINT attempts_check2 CHECK (((executor_handle IS NULL) = (started_at_ms IS NULL))),
    CONSTRAINT attempts_error_code_check CHECK ((error_code ~ '^[A-Z][A-Z0-9_]{0,62}$'::text)),
    CONSTRAINT attempts_error_summary_check CHECK ((length(error_summary) <= 256)),
    CONSTRAINT attempts_executor_handle_check CHECK (((octet_length(executor_handle) >= 1) AND (octet_length(executor_handle) <= 512))),
    CONSTRAINT attempts_executor_type_check CHECK ((executor_type = 'remote_worker'::text)),
    CONSTRAINT attempts_lease_generation_check CHECK ((lease_generation >= 1)),
    CONSTRAINT attempts_lease_version_check CHECK ((lease_version >= 1)),
    CONSTRAINT attempts_log_artifact_id_check CHECK (((octet_length(log_artifact_id) >= 1) AND (octet_length(log_artifact_id) <= 256))),
    CONSTRAINT attempts_output_bytes_at_end CHECK (((output_bytes IS NULL) OR ((finished_at_ms IS NOT NULL) AND ((output_bytes >= 0) AND (output_bytes <= '9007199254740991'::bigint))))),
    CONSTRAINT attempts_state_check CHECK ((state = ANY (ARRAY['claimed'::text, 'starting'::text, 'running'::text, 'succeeded'::text, 'failed'::text, 'cancelled'::text, 'timed_out'::text, 'lost'::text])))
);

CREATE TABLE qinglong.cluster_admins (
    principal_id uuid NOT NULL,
    granted_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL
);

CREATE TABLE qinglong.commit_barrier (
    barrier smallint NOT NULL,
    purpose text NOT NULL,
    CONSTRAINT commit_barrier_barrier_check CHECK ((barrier = 1))
);

CREATE TABLE qinglong.offers (
    offer_id uuid NOT NULL,
    run_id uuid NOT NULL,
    session_id uuid NOT NULL,
    worker_id qinglong.slug NOT NULL,
    worker_generation bigint NOT NULL,
    state text NOT NULL,
    created_at_ms qinglong.epoch_ms NOT NULL,
    expires_at_ms qinglong.epoch_ms NOT NULL,
    claimed_at_ms qinglong.epoch_ms,
    CONSTRAINT offers_check CHECK (((expires_at_ms)::bigint > (created_at_ms)::bigint)),
    CONSTRAINT offers_check1 CHECK (((state = 'claimed'::text) = (claimed_at_ms IS NOT NULL))),
    CONSTRAINT offers_state_check CHECK ((state = ANY (ARRAY['open'::text, 'claimed'::text, 'expired'::text, 'withdrawn'::text])))
);

CREATE TABLE qinglong.operator_credentials (
    credential_id uuid NOT NULL,
    principal_id uuid NOT NULL,
    kind text NOT NULL,
    token_digest qinglong.sha256_hex,
    certificate_uri text,
    status text DEFAULT 'active'::text NOT NULL,
    created_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    expires_at_ms qinglong.epoch_ms,
    issue_request_id text,
    token_prefix text,
    replaces_credential_id uuid,
    CONSTRAINT operator_credentials_certificate_uri_check CHECK (((length(certificate_uri) >= 1) AND (length(certificate_uri) <= 512))),
    CONSTRAINT operator_credentials_check CHECK (((kind = 'bearer_token'::text) = (token_digest IS NOT NULL))),
    CONSTRAINT operator_credentials_check1 CHECK (((kind = 'client_certificate'::text) = (certificate_uri IS NOT NULL))),
    CONSTRAINT operator_credentials_issue_request_id_check CHECK ((issue_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)),
    CONSTRAINT operator_credentials_kind_check CHECK ((kind = ANY (ARRAY['bearer_token'::text, 'client_certificate'::text]))),
    CONSTRAINT operator_credentials_prefix_of_token CHECK (((token_prefix IS NULL) OR (kind = 'bearer_token'::text))),
    CONSTRAINT operator_credentials_rotation_has_request CHECK (((replaces_credential_id IS NULL) OR (issue_request_id IS NOT NULL))),
    CONSTRAINT operator_credentials_status_check CHECK ((status = ANY (ARRAY['active'::text, 'revoked'::text]))),
    CONSTRAINT operator_credentials_token_prefix_check CHECK ((token_prefix ~ '^qlo1_[A-Za-z0-9_-]{6}$'::text))
);

CREATE TABLE qinglong.projects (
    project_id qinglong.slug NOT NULL,
    display_name text NOT NULL,
    status text DEFAULT 'active'::text NOT NULL,
    version bigint DEFAULT 1 NOT NULL,
    created_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    create_request_id text,
    CONSTRAINT projects_create_request_id_check CHECK ((create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)),
    CONSTRAINT projects_display_name_check CHECK (((length(display_name) >= 1) AND (length(display_name) <= 200))),
    CONSTRAINT projects_status_check CHECK ((status = ANY (ARRAY['active'::text, 'archived'::text]))),
    CONSTRAINT projects_version_check CHECK ((version >= 1))
);

CREATE TABLE qinglong.role_bindings (
    project_id qinglong.slug NOT NULL,
    principal_id uuid NOT NULL,
    role text NOT NULL,
    status text DEFAULT 'active'::text NOT NULL,
    version bigint DEFAULT 1 NOT NULL,
    updated_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    CONSTRAINT role_bindings_role_check CHECK ((role = ANY (ARRAY['owner'::text, 'admin'::text, 'operator'::text, 'viewer'::text]))),
    CONSTRAINT role_bindings_status_check CHECK ((status = ANY (ARRAY['active'::text, 'revoked'::text]))),
    CONSTRAINT role_bindings_version_check CHECK ((version >= 1))
);

CREATE TABLE qinglong.run_events (
    event_id uuid NOT NULL,
    run_id uuid NOT NULL,
    sequence bigint NOT NULL,
    event_type text NOT NULL,
    attempt_id uuid,
    actor_kind text NOT NULL,
    actor_id text NOT NULL,
    occurred_at_ms qinglong.epoch_ms NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    dedupe_key text,
    CONSTRAINT run_events_actor_id_check CHECK (((length(actor_id) >= 1) AND (length(actor_id) <= 200))),
    CONSTRAINT run_events_actor_kind_check CHECK ((actor_kind = ANY (ARRAY['worker'::text, 'user'::text, 'agent'::text, 'reconciler'::text, 'system'::text]))),
    CONSTRAINT run_events_dedupe_key_check CHECK (((length(dedupe_key) >= 1) AND (length(dedupe_key) <= 200))),
    CONSTRAINT run_events_event_type_check CHECK (((event_type ~ '^[a-z_]+\.[a-z_]+$'::text) AND (length(event_type) <= 64))),
    CONSTRAINT run_events_payload_check CHECK (((jsonb_typeof(payload) = 'object'::text) AND (octet_length((payload)::text) <= 4096))),
    CONSTRAINT run_events_sequence_check CHECK ((sequence >= 1))
);

CREATE TABLE qinglong.run_leases (
    attempt_id uuid NOT NULL,
    run_id uuid NOT NULL,
    worker_id qinglong.slug NOT NULL,
    session_id uuid NOT NULL,
    worker_generation bigint NOT NULL,
    offer_id uuid NOT NULL,
    lease_generation integer NOT NULL,
    token_digest qinglong.sha256_hex NOT NULL,
    version bigint NOT NULL,
    status text NOT NULL,
    acquired_at_ms qinglong.epoch_ms NOT NULL,
    renewed_at_ms qinglong.epoch_ms NOT NULL,
    expires_at_ms qinglong.epoch_ms NOT NULL,
    ended_at_ms qinglong.epoch_ms,
    CONSTRAINT run_leases_check CHECK (((status = 'leased'::text) = (ended_at_ms IS NULL))),
    CONSTRAINT run_leases_check1 CHECK (((expires_at_ms)::bigint >= (renewed_at_ms)::bigint)),
    CONSTRAINT run_leases_lease_generation_check CHECK ((lease_generation >= 1)),
    CONSTRAINT run_leases_status_check CHECK ((status = ANY (ARRAY['leased'::text, 'completed'::text, 'expired'::text]))),
    CONSTRAINT run_leases_version_check CHECK ((version >= 1))
);

CREATE TABLE qinglong.runs (
    run_id uuid NOT NULL,
    project_id qinglong.slug NOT NULL,
    task_id uuid NOT NULL,
    revision_id uuid NOT NULL,
    state text NOT NULL,
    owner text DEFAULT 'runtime'::text NOT NULL,
    executor_type text NOT NULL,
    version bigint DEFAULT 1 NOT NULL,
    event_sequence bigint DEFAULT 0 NOT NULL,
    attempt_count integer DEFAULT 0 NOT NULL,
    trigger_request_id text NOT NULL,
    triggered_by text NOT NULL,
    cancel_requested_at_ms qinglong.epoch_ms,
    cancel_reason text,
    cancel_requested_by text,
    deadline_at_ms qinglong.epoch_ms,
    created_at_ms qinglong.epoch_ms NOT NULL,
    updated_at_ms qinglong.epoch_ms NOT NULL,
    started_at_ms qinglong.epoch_ms,
    finished_at_ms qinglong.epoch_ms,
    error_code text,
    error_summary text,
    retry_at_ms qinglong.epoch_ms,
    parameters jsonb DEFAULT '{}'::jsonb NOT NULL,
    worker_selector jsonb DEFAULT '{}'::jsonb NOT NULL,
    queue_timeout_ms bigint,
    priority smallint DEFAULT 0 NOT NULL,
    CONSTRAINT runs_attempt_count_check CHECK ((attempt_count >= 0)),
    CONSTRAINT runs_cancel_reason_check CHECK ((cancel_reason = ANY (ARRAY['user'::text, 'policy'::text, 'shutdown'::text, 'reconcile'::text, 'timeout'::text]))),
    CONSTRAINT runs_cancel_requested_by_check CHECK (((length(cancel_requested_by) >= 1) AND (length(cancel_requested_by) <= 200))),
    CONSTRAINT runs_check CHECK (((cancel_requested_at_ms IS NULL) = (cancel_reason IS NULL))),
    CONSTRAINT runs_check1 CHECK (((state = ANY (ARRAY['succeeded'::text, 'failed'::text, 'cancelled'::text, 'timed_out'::text])) = (finished_at_ms IS NOT NULL))),
    CONSTRAINT runs_error_code_check CHECK ((error_code ~ '^[A-Z][A-Z0-9_]{0,62}$'::text)),
    CONSTRAINT runs_error_summary_check CHECK ((length(error_summary) <= 256)),
    CONSTRAINT runs_event_sequence_check CHECK ((event_sequence >= 0)),
    CONSTRAINT runs_executor_type_check CHECK ((executor_type = 'remote_worker'::text)),
    CONSTRAINT runs_owner_check CHECK ((owner = 'runtime'::text)),
    CONSTRAINT runs_retry_at_only_waiting CHECK (((state = 'retry_wait'::text) = (retry_at_ms IS NOT NULL))),
    CONSTRAINT runs_state_check CHECK ((state = ANY (ARRAY['created'::text, 'queued'::text, 'waiting_approval'::text, 'dispatching'::text, 'running'::text, 'retry_wait'::text, 'lost'::text, 'succeeded'::text, 'failed'::text, 'cancelled'::text, 'timed_out'::text]))),
    CONSTRAINT runs_trigger_request_id_check CHECK ((trigger_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)),
    CONSTRAINT runs_triggered_by_check CHECK (((length(triggered_by) >= 1) AND (length(triggered_by) <= 200))),
    CONSTRAINT runs_version_check CHECK ((version >= 1))
);

CREATE TABLE qinglong.task_revisions (
    revision_id uuid NOT NULL,
    project_id qinglong.slug NOT NULL,
    task_id uuid NOT NULL,
    revision_number integer NOT NULL,
    executor_type text NOT NULL,
    command jsonb NOT NULL,
    timeout_ms bigint,
    create_request_id text NOT NULL,
    created_by text NOT NULL,
    created_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    retry_max_attempts integer DEFAULT 1 NOT NULL,
    retry_initial_backoff_ms bigint DEFAULT 1000 NOT NULL,
    retry_max_backoff_ms bigint DEFAULT 1000 NOT NULL,
    retry_multiplier_percent integer DEFAULT 200 NOT NULL,
    retry_on text[] DEFAULT '{}'::text[] NOT NULL,
    worker_selector jsonb DEFAULT '{}'::jsonb NOT NULL,
    queue_timeout_ms bigint,
    max_concurrent_runs integer,
    CONSTRAINT task_revisions_command_check CHECK (((jsonb_typeof(command) = 'array'::text) AND ((jsonb_array_length(command) >= 1) AND (jsonb_array_length(command) <= 64)))),
    CONSTRAINT task_revisions_create_request_id_check CHECK ((create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)),
    CONSTRAINT task_revisions_created_by_check CHECK (((length(created_by) >= 1) AND (length(created_by) <= 200))),
    CONSTRAINT task_revisions_executor_type_check CHECK ((executor_type = 'remote_worker'::text)),
    CONSTRAINT task_revisions_retry_backoff_ordered CHECK ((retry_max_backoff_ms >= retry_initial_backoff_ms)),
    CONSTRAINT task_revisions_retry_initial_backoff_ms_check CHECK (((retry_initial_backoff_ms >= 1) AND (retry_initial_backoff_ms <= 86400000))),
    CONSTRAINT task_revisions_retry_max_attempts_check CHECK (((retry_max_attempts >= 1) AND (retry_max_attempts <= 100))),
    CONSTRAINT task_revisions_retry_max_backoff_ms_check CHECK (((retry_max_backoff_ms >= 1) AND (retry_max_backoff_ms <= 86400000))),
    CONSTRAINT task_revisions_retry_multiplier_percent_check CHECK (((retry_multiplier_percent >= 100) AND (retry_multiplier_percent <= 1000))),
    CONSTRAINT task_revisions_retry_on_check CHECK ((retry_on <@ ARRAY['failed'::text, 'start_failed'::text])),
    CONSTRAINT task_revisions_revision_number_check CHECK ((revision_number >= 1)),
    CONSTRAINT task_revisions_timeout_ms_check CHECK (((timeout_ms >= 1) AND (timeout_ms <= 604800000)))
);

CREATE VIEW qinglong.run_projection AS
 SELECT r.run_id,
    r.project_id,
    r.task_id,
    r.revision_id,
    tr.revision_number,
    r.state,
    r.attempt_count,
    a.attempt_id AS latest_attempt_id,
    a.state AS latest_attempt_state,
    r.version,
    r.event_sequence,
    r.cancel_reason,
    r.cancel_requested_at_ms,
    r.deadline_at_ms,
    r.created_at_ms,
    r.started_at_ms,
    r.finished_at_ms,
    r.error_code,
    r.retry_at_ms,
    tr.retry_max_attempts AS max_attempts
   FROM ((qinglong.runs r
     JOIN qinglong.task_revisions tr ON ((tr.revision_id = r.revision_id)))
     LEFT JOIN qinglong.attempts a ON (((a.run_id = r.run_id) AND (a.attempt_number = r.attempt_count))));

CREATE TABLE qinglong.security_audit (
    audit_id uuid NOT NULL,
    occurred_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    principal_kind text,
    principal_id text,
    operation text NOT NULL,
    outcome text NOT NULL,
    reason text,
    project_id text,
    run_id uuid,
    worker_id text,
    session_id uuid,
    request_id text,
    peer text,
    credential_id uuid,
    CONSTRAINT security_audit_operation_check CHECK (((length(operation) >= 1) AND (length(operation) <= 200))),
    CONSTRAINT security_audit_outcome_check CHECK ((outcome = ANY (ARRAY['admitted'::text, 'require_approval'::text, 'unauthenticated'::text, 'permission_denied'::text, 'invalid_argument'::text, 'unavailable'::text, 'internal'::text, 'rate_limited'::text]))),
    CONSTRAINT security_audit_peer_check CHECK ((length(peer) <= 256)),
    CONSTRAINT security_audit_principal_id_check CHECK (((length(principal_id) >= 1) AND (length(principal_id) <= 512))),
    CONSTRAINT security_audit_principal_kind_check CHECK ((principal_kind = ANY (ARRAY['worker'::text, 'user'::text, 'agent'::text, 'service'::text, 'anonymous'::text]))),
    CONSTRAINT security_audit_project_id_check CHECK ((length(project_id) <= 64)),
    CONSTRAINT security_audit_reason_check CHECK ((reason ~ '^[A-Z][A-Z0-9_]{0,62}$'::text)),
    CONSTRAINT security_audit_request_id_check CHECK ((length(request_id) <= 64)),
    CONSTRAINT security_audit_worker_id_check CHECK ((length(worker_id) <= 64))
);

CREATE TABLE qinglong.tasks (
    task_id uuid NOT NULL,
    project_id qinglong.slug NOT NULL,
    display_name text NOT NULL,
    labels jsonb DEFAULT '{}'::jsonb NOT NULL,
    create_request_id text NOT NULL,
    created_by text NOT NULL,
    created_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    CONSTRAINT tasks_create_request_id_check CHECK ((create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)),
    CONSTRAINT tasks_created_by_check CHECK (((length(created_by) >= 1) AND (length(created_by) <= 200))),
    CONSTRAINT tasks_display_name_check CHECK (((length(display_name) >= 1) AND (length(display_name) <= 200))),
    CONSTRAINT tasks_labels_check CHECK (((jsonb_typeof(labels) = 'object'::text) AND (octet_length((labels)::text) <= 16384)))
);

CREATE TABLE qinglong.worker_identities (
    worker_id qinglong.slug NOT NULL,
    principal_id uuid NOT NULL,
    certificate_uri text NOT NULL,
    status text DEFAULT 'active'::text NOT NULL,
    created_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    create_request_id text,
    project_ids qinglong.slug[],
    cordoned boolean DEFAULT false NOT NULL,
    CONSTRAINT worker_identities_certificate_uri_check CHECK (((length(certificate_uri) >= 1) AND (length(certificate_uri) <= 512))),
    CONSTRAINT worker_identities_create_request_id_check CHECK ((create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)),
    CONSTRAINT worker_identities_project_ids_check CHECK (((project_ids IS NULL) OR ((cardinality(project_ids) >= 1) AND (array_position(project_ids, (NULL::text)::qinglong.slug) IS NULL)))),
    CONSTRAINT worker_identities_status_check CHECK ((status = ANY (ARRAY['active'::text, 'disabled'::text])))
);

CREATE TABLE qinglong.worker_join_tokens (
    token_digest qinglong.sha256_hex NOT NULL,
    worker_id qinglong.slug NOT NULL,
    created_at_ms qinglong.epoch_ms DEFAULT qinglong.db_now_ms() NOT NULL,
    expires_at_ms qinglong.epoch_ms NOT NULL,
    used_at_ms qinglong.epoch_ms,
    issue_request_id text,
    used_key_sha256 qinglong.sha256_hex,
    used_by_audit_id uuid,
    CONSTRAINT worker_join_tokens_expire_after_creation CHECK (((expires_at_ms)::bigint > (created_at_ms)::bigint)),
    CONSTRAINT worker_join_tokens_used_after_creation CHECK (((used_at_ms IS NULL) OR ((used_at_ms)::bigint >= (created_at_ms)::bigint)))
);

CREATE TABLE qinglong.worker_sessions (
    session_id uuid NOT NULL,
    worker_id qinglong.slug NOT NULL,
    generation bigint NOT NULL,
    status text NOT NULL,
    executor_types text[] NOT NULL,
    max_concurrency integer NOT NULL,
    agent_version text DEFAULT ''::text NOT NULL,
    open_request_id text NOT NULL,
    opened_at_ms qinglong.epoch_ms NOT NULL,
    renewed_at_ms qinglong.epoch_ms NOT NULL,
    expires_at_ms qinglong.epoch_ms NOT NULL,
    closed_at_ms qinglong.epoch_ms,
    passes_run_parameters boolean DEFAULT false NOT NULL,
    labels jsonb DEFAULT '{}'::jsonb NOT NULL,
    CONSTRAINT worker_sessions_agent_version_check CHECK ((length(agent_version) <= 64)),
    CONSTRAINT worker_sessions_check CHECK ((((expires_at_ms)::bigint >= (renewed_at_ms)::bigint) AND ((renewed_at_ms)::bigint >= (opened_at_ms)::bigint))),
    CONSTRAINT worker_sessions_check1 CHECK (((status = ANY (ARRAY['online'::text, 'draining'::text])) = (closed_at_ms IS NULL))),
    CONSTRAINT worker_sessions_executor_types_check CHECK ((((cardinality(executor_types) >= 1) AND (cardinality(executor_types) <= 8)) AND (executor_types <@ ARRAY['remote_worker'::text]))),
    CONSTRAINT worker_sessions_generation_check CHECK ((generation >= 1)),
    CONSTRAINT worker_sessions_max_concurrency_check CHECK (((max_concurrency >= 1) AND (max_concurrency <= 1024))),
    CONSTRAINT worker_sessions_open_request_id_check CHECK ((open_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)),
    CONSTRAINT worker_sessions_status_check CHECK ((status = ANY (ARRAY['online'::text, 'draining'::text, 'replaced'::text, 'closed'::text, 'expired'::text])))
);

ALTER TABLE ONLY public.qinglong_schema_migrations
    ADD CONSTRAINT qinglong_schema_migrations_pkey PRIMARY KEY (version);

ALTER TABLE ONLY qinglong.approval_requests
    ADD CONSTRAINT approval_requests_held_once UNIQUE (project_id, requested_by, request_digest);

ALTER TABLE ONLY qinglong.approval_requests
    ADD CONSTRAINT approval_requests_pkey PRIMARY KEY (approval_id);

ALTER TABLE ONLY qinglong.attempt_output_chunks
    ADD CONSTRAINT attempt_output_chunks_pkey PRIMARY KEY (attempt_id, start_offset);

ALTER TABLE ONLY qinglong.attempt_output
    ADD CONSTRAINT attempt_output_pkey PRIMARY KEY (attempt_id);

ALTER TABLE ONLY qinglong.attempts
    ADD CONSTRAINT attempts_offer_id_key UNIQUE (offer_id);

ALTER TABLE ONLY qinglong.attempts
    ADD CONSTRAINT attempts_pkey PRIMARY KEY (attempt_id);

ALTER TABLE ONLY qinglong.attempts
    ADD CONSTRAINT attempts_run_id_attempt_number_key UNIQUE (run_id, attempt_number);

ALTER TABLE ONLY qinglong.cluster_admins
    ADD CONSTRAINT cluster_admins_pkey PRIMARY KEY (principal_id);

ALTER TABLE ONLY qinglong.commit_barrier
    ADD CONSTRAINT commit_barrier_pkey PRIMARY KEY (barrier);

ALTER TABLE ONLY qinglong.offers
    ADD CONSTRAINT offers_offer_id_run_id_key UNIQUE (offer_id, run_id);

ALTER TABLE ONLY qinglong.offers
    ADD CONSTRAINT offers_pkey PRIMARY KEY (offer_id);

ALTER TABLE ONLY qinglong.operator_credentials
    ADD CONSTRAINT operator_credentials_certificate_uri_key UNIQUE (certificate_uri);

ALTER TABLE ONLY qinglong.operator_credentials
    ADD CONSTRAINT operator_credentials_pkey PRIMARY KEY (credential_id);

ALTER TABLE ONLY qinglong.operator_credentials
    ADD CONSTRAINT operator_credentials_replaces_credential_id_key UNIQUE (replaces_credential_id);

ALTER TABLE ONLY qinglong.operator_credentials
    ADD CONSTRAINT operator_credentials_token_digest_key UNIQUE (token_digest);

ALTER TABLE ONLY qinglong.principals
    ADD CONSTRAINT principals_create_request_id_key UNIQUE (create_request_id);

ALTER TABLE ONLY qinglong.principals
    ADD CONSTRAINT principals_kind_name_key UNIQUE (kind, name);

ALTER TABLE ONLY qinglong.principals
    ADD CONSTRAINT principals_pkey PRIMARY KEY (principal_id);

ALTER TABLE ONLY qinglong.projects
    ADD CONSTRAINT projects_create_request_id_key UNIQUE (create_request_id);

ALTER TABLE ONLY qinglong.projects
    ADD CONSTRAINT projects_pkey PRIMARY KEY (project_id);

ALTER TABLE ONLY qinglong.role_bindings
    ADD CONSTRAINT role_bindings_pkey PRIMARY KEY (project_id, principal_id);

ALTER TABLE ONLY qinglong.run_events
    ADD CONSTRAINT run_events_dedupe_key_key UNIQUE (dedupe_key);

ALTER TABLE ONLY qinglong.run_events
    ADD CONSTRAINT run_events_pkey PRIMARY KEY (event_id);

ALTER TABLE ONLY qinglong.run_events
    ADD CONSTRAINT run_events_run_id_sequence_key UNIQUE (run_id, sequence);

ALTER TABLE ONLY qinglong.run_leases
    ADD CONSTRAINT run_leases_offer_id_key UNIQUE (offer_id);

ALTER TABLE ONLY qinglong.run_leases
    ADD CONSTRAINT run_leases_pkey PRIMARY KEY (attempt_id);

ALTER TABLE qinglong.runs
    ADD CONSTRAINT runs_parameters_object CHECK ((jsonb_typeof(parameters) = 'object'::text)) NOT VALID;

ALTER TABLE ONLY qinglong.runs
    ADD CONSTRAINT runs_pkey PRIMARY KEY (run_id);

ALTER TABLE ONLY qinglong.runs
    ADD CONSTRAINT runs_project_id_run_id_key UNIQUE (project_id, run_id);

ALTER TABLE ONLY qinglong.runs
    ADD CONSTRAINT runs_project_id_trigger_request_id_key UNIQUE (project_id, trigger_request_id);

ALTER TABLE qinglong.runs
    ADD CONSTRAINT runs_queue_timeout_ms_positive CHECK ((queue_timeout_ms > 0)) NOT VALID;

ALTER TABLE qinglong.runs
    ADD CONSTRAINT runs_worker_selector_object CHECK ((jsonb_typeof(worker_selector) = 'object'::text)) NOT VALID;

ALTER TABLE qinglong.security_audit
    ADD CONSTRAINT security_audit_credential_is_an_operators CHECK (((credential_id IS NULL) OR (principal_kind = ANY (ARRAY['user'::text, 'agent'::text])))) NOT VALID;

ALTER TABLE ONLY qinglong.security_audit
    ADD CONSTRAINT security_audit_pkey PRIMARY KEY (audit_id);

ALTER TABLE qinglong.task_revisions
    ADD CONSTRAINT task_revisions_max_concurrent_runs_positive CHECK ((max_concurrent_runs > 0)) NOT VALID;

ALTER TABLE ONLY qinglong.task_revisions
    ADD CONSTRAINT task_revisions_pkey PRIMARY KEY (revision_id);

ALTER TABLE ONLY qinglong.task_revisions
    ADD CONSTRAINT task_revisions_project_id_task_id_revision_id_key UNIQUE (project_id, task_id, revision_id);

ALTER TABLE qinglong.task_revisions
    ADD CONSTRAINT task_revisions_queue_timeout_ms_positive CHECK ((queue_timeout_ms > 0)) NOT VALID;

ALTER TABLE ONLY qinglong.task_revisions
    ADD CONSTRAINT task_revisions_task_id_create_request_id_key UNIQUE (task_id, create_request_id);

ALTER TABLE ONLY qinglong.task_revisions
    ADD CONSTRAINT task_revisions_task_id_revision_number_key UNIQUE (task_id, revision_number);

ALTER TABLE qinglong.task_revisions
    ADD CONSTRAINT task_revisions_worker_selector_object CHECK ((jsonb_typeof(worker_selector) = 'object'::text)) NOT VALID;

ALTER TABLE ONLY qinglong.tasks
    ADD CONSTRAINT tasks_pkey PRIMARY KEY (task_id);

ALTER TABLE ONLY qinglong.tasks
    ADD CONSTRAINT tasks_project_id_create_request_id_key UNIQUE (project_id, create_request_id);

ALTER TABLE ONLY qinglong.tasks
    ADD CONSTRAINT tasks_project_id_task_id_key UNIQUE (project_id, task_id);

ALTER TABLE ONLY qinglong.worker_identities
    ADD CONSTRAINT worker_identities_certificate_uri_key UNIQUE (certificate_uri);

ALTER TABLE ONLY qinglong.worker_identities
    ADD CONSTRAINT worker_identities_create_request_id_key UNIQUE (create_request_id);

ALTER TABLE ONLY qinglong.worker_identities
    ADD CONSTRAINT worker_identities_pkey PRIMARY KEY (worker_id);

ALTER TABLE ONLY qinglong.worker_identities
    ADD CONSTRAINT worker_identities_principal_id_key UNIQUE (principal_id);

ALTER TABLE qinglong.worker_identities
    ADD CONSTRAINT worker_identities_uri_names_the_worker CHECK (((certificate_uri ~ '^spiffe://[^/]+/worker/[a-z0-9][a-z0-9-]{0,62}$'::text) AND (split_part(certificate_uri, '/'::text, 5) = (worker_id)::text))) NOT VALID;

ALTER TABLE qinglong.worker_join_tokens
    ADD CONSTRAINT worker_join_tokens_issue_request_id_shape CHECK ((issue_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'::text)) NOT VALID;

ALTER TABLE qinglong.worker_join_tokens
    ADD CONSTRAINT worker_join_tokens_key_only_when_used CHECK (((used_key_sha256 IS NULL) OR (used_at_ms IS NOT NULL))) NOT VALID;

ALTER TABLE ONLY qinglong.worker_join_tokens
    ADD CONSTRAINT worker_join_tokens_pkey PRIMARY KEY (token_digest);

ALTER TABLE qinglong.worker_sessions
    ADD CONSTRAINT worker_sessions_labels_object CHECK ((jsonb_typeof(labels) = 'object'::text)) NOT VALID;

ALTER TABLE ONLY qinglong.worker_sessions
    ADD CONSTRAINT worker_sessions_pkey PRIMARY KEY (session_id);

ALTER TABLE ONLY qinglong.worker_sessions
    ADD CONSTRAINT worker_sessions_session_id_worker_id_generation_key UNIQUE (session_id, worker_id, generation);

ALTER TABLE ONLY qinglong.worker_sessions
    ADD CONSTRAINT worker_sessions_worker_id_generation_key UNIQUE (worker_id, generation);

ALTER TABLE ONLY qinglong.worker_sessions
    ADD CONSTRAINT worker_sessions_worker_id_open_request_id_key UNIQUE (worker_id, open_request_id);

CREATE INDEX approval_requests_by_project ON qinglong.approval_requests USING btree (project_id, requested_at_ms, approval_id);

CREATE INDEX approval_requests_pending_by_caller ON qinglong.approval_requests USING btree (project_id, requested_by) WHERE (state = 'pending'::text);

CREATE INDEX approval_requests_pending_expiry ON qinglong.approval_requests USING btree (expires_at_ms) WHERE (state = 'pending'::text);

CREATE INDEX attempt_output_retained ON qinglong.attempt_output USING btree (updated_at_ms) WHERE (first_offset < end_offset);

CREATE INDEX attempts_live_by_session ON qinglong.attempts USING btree (session_id) WHERE (state = ANY (ARRAY['claimed'::text, 'starting'::text, 'running'::text]));

CREATE INDEX attempts_live_by_worker ON qinglong.attempts USING btree (worker_id) WHERE (state = ANY (ARRAY['claimed'::text, 'starting'::text, 'running'::text]));

CREATE UNIQUE INDEX attempts_one_live_per_run ON qinglong.attempts USING btree (run_id) WHERE (state = ANY (ARRAY['claimed'::text, 'starting'::text, 'running'::text]));

CREATE UNIQUE INDEX offers_one_open_per_run ON qinglong.offers USING btree (run_id) WHERE (state = 'open'::text);

CREATE INDEX offers_open_by_session ON qinglong.offers USING btree (session_id) WHERE (state = 'open'::text);

CREATE UNIQUE INDEX operator_credentials_issue_request ON qinglong.operator_credentials USING btree (principal_id, issue_request_id) WHERE ((issue_request_id IS NOT NULL) AND (replaces_credential_id IS NULL));

CREATE INDEX run_leases_leased_by_expiry ON qinglong.run_leases USING btree (expires_at_ms) WHERE (status = 'leased'::text);

CREATE UNIQUE INDEX run_leases_one_leased_per_run ON qinglong.run_leases USING btree (run_id) WHERE (status = 'leased'::text);

CREATE INDEX runs_by_project ON qinglong.runs USING btree (project_id, created_at_ms DESC, run_id);

CREATE INDEX runs_by_project_state ON qinglong.runs USING btree (project_id, state, created_at_ms, run_id);

CREATE INDEX runs_by_project_task ON qinglong.runs USING btree (project_id, task_id, created_at_ms, run_id);

CREATE INDEX runs_cancel_pending ON qinglong.runs USING btree (cancel_requested_at_ms, run_id) WHERE ((cancel_requested_at_ms IS NOT NULL) AND (state = ANY (ARRAY['created'::text, 'queued'::text, 'waiting_approval'::text, 'retry_wait'::text, 'lost'::text])));

CREATE INDEX runs_ended_by_task ON qinglong.runs USING btree (task_id, finished_at_ms) WHERE (finished_at_ms IS NOT NULL);

CREATE INDEX runs_holding_slot_by_task ON qinglong.runs USING btree (task_id) WHERE (state = ANY (ARRAY['queued'::text, 'dispatching'::text, 'running'::text, 'retry_wait'::text, 'lost'::text]));

CREATE INDEX runs_live_unstopped_by_project ON qinglong.runs USING btree (project_id, created_at_ms, run_id) WHERE ((cancel_requested_at_ms IS NULL) AND (state <> ALL (ARRAY['succeeded'::text, 'failed'::text, 'cancelled'::text, 'timed_out'::text])));

CREATE INDEX runs_lost_unretried ON qinglong.runs USING btree (updated_at_ms, run_id) WHERE ((state = 'lost'::text) AND (cancel_requested_at_ms IS NULL));

CREATE INDEX runs_queued_by_age ON qinglong.runs USING btree (created_at_ms, run_id) WHERE (state = 'queued'::text);

CREATE INDEX runs_queued_by_queue_deadline ON qinglong.runs USING btree ((((updated_at_ms)::bigint + queue_timeout_ms)), run_id) WHERE ((state = 'queued'::text) AND (queue_timeout_ms IS NOT NULL) AND (cancel_requested_at_ms IS NULL));

CREATE INDEX runs_queued_for_any_worker ON qinglong.runs USING btree (created_at_ms, run_id) WHERE ((state = 'queued'::text) AND (worker_selector = '{}'::jsonb));

CREATE INDEX runs_queued_for_any_worker_by_priority ON qinglong.runs USING btree (priority DESC, created_at_ms, run_id) WHERE ((state = 'queued'::text) AND (worker_selector = '{}'::jsonb));

CREATE INDEX runs_queued_for_any_worker_by_project ON qinglong.runs USING btree (project_id, created_at_ms, run_id) WHERE ((state = 'queued'::text) AND (worker_selector = '{}'::jsonb));

CREATE INDEX runs_queued_for_any_worker_by_project_priority ON qinglong.runs USING btree (project_id, priority DESC, created_at_ms, run_id) WHERE ((state = 'queued'::text) AND (worker_selector = '{}'::jsonb));

CREATE INDEX runs_queued_with_selector ON qinglong.runs USING btree (created_at_ms, run_id) WHERE ((state = 'queued'::text) AND (worker_selector <> '{}'::jsonb));

CREATE INDEX runs_queued_with_selector_by_priority ON qinglong.runs USING btree (priority DESC, created_at_ms, run_id) WHERE ((state = 'queued'::text) AND (worker_selector <> '{}'::jsonb));

CREATE INDEX runs_queued_with_selector_by_project ON qinglong.runs USING btree (project_id, created_at_ms, run_id) WHERE ((state = 'queued'::text) AND (worker_selector <> '{}'::jsonb));

CREATE INDEX runs_queued_with_selector_by_project_priority ON qinglong.runs USING btree (project_id, priority DESC, created_at_ms, run_id) WHERE ((state = 'queued'::text) AND (worker_selector <> '{}'::jsonb));

CREATE INDEX runs_retry_due ON qinglong.runs USING btree (retry_at_ms, run_id) WHERE ((state = 'retry_wait'::text) AND (cancel_requested_at_ms IS NULL));

CREATE INDEX runs_waiting_for_slot ON qinglong.runs USING btree (task_id, priority DESC, created_at_ms, run_id) WHERE (state = 'created'::text);

CREATE INDEX runs_waiting_for_slot_by_age ON qinglong.runs USING btree (created_at_ms, run_id) WHERE (state = 'created'::text);

CREATE INDEX security_audit_by_credential ON qinglong.security_audit USING btree (credential_id, occurred_at_ms) WHERE (credential_id IS NOT NULL);

CREATE INDEX security_audit_by_principal ON qinglong.security_audit USING btree (principal_id, occurred_at_ms, audit_id);

CREATE INDEX security_audit_by_time ON qinglong.security_audit USING btree (occurred_at_ms);

CREATE INDEX tasks_by_project ON qinglong.tasks USING btree (project_id, created_at_ms, task_id);

CREATE INDEX worker_join_tokens_by_audit ON qinglong.worker_join_tokens USING btree (used_by_audit_id) WHERE (used_by_audit_id IS NOT NULL);

CREATE UNIQUE INDEX worker_join_tokens_by_issue_request ON qinglong.worker_join_tokens USING btree (worker_id, issue_request_id) WHERE (issue_request_id IS NOT NULL);

CREATE INDEX worker_join_tokens_by_worker ON qinglong.worker_join_tokens USING btree (worker_id, created_at_ms);

CREATE UNIQUE INDEX worker_sessions_one_live_per_worker ON qinglong.worker_sessions USING btree (worker_id) WHERE (status = ANY (ARRAY['online'::text, 'draining'::text]));

CREATE TRIGGER approval_requests_decided_once BEFORE UPDATE ON qinglong.approval_requests FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_approval_decided_once();

CREATE TRIGGER attempts_enforce_transition BEFORE UPDATE ON qinglong.attempts FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_attempt_transition();

CREATE TRIGGER run_events_enforce_sequence BEFORE INSERT ON qinglong.run_events FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_event_sequence();

CREATE TRIGGER run_leases_enforce_progress BEFORE UPDATE ON qinglong.run_leases FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_lease_progress();

CREATE TRIGGER runs_enforce_transition BEFORE UPDATE ON qinglong.runs FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_run_transition();

CREATE TRIGGER worker_join_tokens_enforce_single_use BEFORE UPDATE ON qinglong.worker_join_tokens FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_join_token_single_use();

ALTER TABLE ONLY qinglong.approval_requests
    ADD CONSTRAINT approval_requests_decided_by_fkey FOREIGN KEY (decided_by) REFERENCES qinglong.principals(principal_id);

ALTER TABLE ONLY qinglong.approval_requests
    ADD CONSTRAINT approval_requests_project_id_fkey FOREIGN KEY (project_id) REFERENCES qinglong.projects(project_id);

ALTER TABLE ONLY qinglong.approval_requests
    ADD CONSTRAINT approval_requests_requested_by_fkey FOREIGN KEY (requested_by) REFERENCES qinglong.principals(principal_id);

ALTER TABLE ONLY qinglong.approval_requests
    ADD CONSTRAINT approval_requests_run_id_fkey FOREIGN KEY (run_id) REFERENCES qinglong.runs(run_id);

ALTER TABLE ONLY qinglong.attempt_output
    ADD CONSTRAINT attempt_output_attempt_id_fkey FOREIGN KEY (attempt_id) REFERENCES qinglong.attempts(attempt_id);

ALTER TABLE ONLY qinglong.attempt_output_chunks
    ADD CONSTRAINT attempt_output_chunks_attempt_id_fkey FOREIGN KEY (attempt_id) REFERENCES qinglong.attempt_output(attempt_id);

ALTER TABLE ONLY qinglong.attempts
    ADD CONSTRAINT attempts_offer_id_run_id_fkey FOREIGN KEY (offer_id, run_id) REFERENCES qinglong.offers(offer_id, run_id);

ALTER TABLE ONLY qinglong.attempts
    ADD CONSTRAINT attempts_run_id_fkey FOREIGN KEY (run_id) REFERENCES qinglong.runs(run_id);

ALTER TABLE ONLY qinglong.attempts
    ADD CONSTRAINT attempts_session_id_worker_id_worker_generation_fkey FOREIGN KEY (session_id, worker_id, worker_generation) REFERENCES qinglong.worker_sessions(session_id, worker_id, generation);

ALTER TABLE ONLY qinglong.cluster_admins
    ADD CONSTRAINT cluster_admins_principal_id_fkey FOREIGN KEY (principal_id) REFERENCES qinglong.principals(principal_id);

ALTER TABLE ONLY qinglong.offers
    ADD CONSTRAINT offers_run_id_fkey FOREIGN KEY (run_id) REFERENCES qinglong.runs(run_id);

ALTER TABLE ONLY qinglong.offers
    ADD CONSTRAINT offers_session_id_worker_id_worker_generation_fkey FOREIGN KEY (session_id, worker_id, worker_generation) REFERENCES qinglong.worker_sessions(session_id, worker_id, generation);

ALTER TABLE ONLY qinglong.operator_credentials
    ADD CONSTRAINT operator_credentials_principal_id_fkey FOREIGN KEY (principal_id) REFERENCES qinglong.principals(principal_id);

ALTER TABLE ONLY qinglong.operator_credentials
    ADD CONSTRAINT operator_credentials_replaces_credential_id_fkey FOREIGN KEY (replaces_credential_id) REFERENCES qinglong.operator_credentials(credential_id);

ALTER TABLE ONLY qinglong.role_bindings
    ADD CONSTRAINT role_bindings_principal_id_fkey FOREIGN KEY (principal_id) REFERENCES qinglong.principals(principal_id);

ALTER TABLE ONLY qinglong.role_bindings
    ADD CONSTRAINT role_bindings_project_id_fkey FOREIGN KEY (project_id) REFERENCES qinglong.projects(project_id);

ALTER TABLE ONLY qinglong.run_events
    ADD CONSTRAINT run_events_attempt_id_fkey FOREIGN KEY (attempt_id) REFERENCES qinglong.attempts(attempt_id);

ALTER TABLE ONLY qinglong.run_events
    ADD CONSTRAINT run_events_run_id_fkey FOREIGN KEY (run_id) REFERENCES qinglong.runs(run_id);

ALTER TABLE ONLY qinglong.run_leases
    ADD CONSTRAINT run_leases_attempt_id_fkey FOREIGN KEY (attempt_id) REFERENCES qinglong.attempts(attempt_id);

ALTER TABLE ONLY qinglong.run_leases
    ADD CONSTRAINT run_leases_offer_id_fkey FOREIGN KEY (offer_id) REFERENCES qinglong.attempts(offer_id);

ALTER TABLE ONLY qinglong.run_leases
    ADD CONSTRAINT run_leases_run_id_fkey FOREIGN KEY (run_id) REFERENCES qinglong.runs(run_id);

ALTER TABLE ONLY qinglong.run_leases
    ADD CONSTRAINT run_leases_session_id_worker_id_worker_generation_fkey FOREIGN KEY (session_id, worker_id, worker_generation) REFERENCES qinglong.worker_sessions(session_id, worker_id, generation);

ALTER TABLE ONLY qinglong.runs
    ADD CONSTRAINT runs_project_id_task_id_revision_id_fkey FOREIGN KEY (project_id, task_id, revision_id) REFERENCES qinglong.task_revisions(project_id, task_id, revision_id);

ALTER TABLE ONLY qinglong.task_revisions
    ADD CONSTRAINT task_revisions_project_id_task_id_fkey FOREIGN KEY (project_id, task_id) REFERENCES qinglong.tasks(project_id, task_id);

ALTER TABLE ONLY qinglong.tasks
    ADD CONSTRAINT tasks_project_id_fkey FOREIGN KEY (project_id) REFERENCES qinglong.projects(project_id);

ALTER TABLE ONLY qinglong.worker_identities
    ADD CONSTRAINT worker_identities_principal_id_fkey FOREIGN KEY (principal_id) REFERENCES qinglong.principals(principal_id);

ALTER TABLE ONLY qinglong.worker_join_tokens
    ADD CONSTRAINT worker_join_tokens_worker_id_fkey FOREIGN KEY (worker_id) REFERENCES qinglong.worker_identities(worker_id);

ALTER TABLE ONLY qinglong.worker_sessions
    ADD CONSTRAINT worker_sessions_worker_id_fkey FOREIGN KEY (worker_id) REFERENCES qinglong.worker_identities(worker_id);

GRANT USAGE ON SCHEMA qinglong TO qinglong_runtime;
GRANT USAGE ON SCHEMA qinglong TO qinglong_ingress;
GRANT USAGE ON SCHEMA qinglong TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_lock(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_lock(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_lock_shared(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock_shared(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock_shared(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock_shared(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_lock_shared(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock_shared(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock_shared(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_lock_shared(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_unlock(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_unlock(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_unlock_all() FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_all() TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_all() TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_all() TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_unlock_shared(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_shared(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_shared(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_shared(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_unlock_shared(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_shared(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_shared(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_unlock_shared(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock_shared(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock_shared(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock_shared(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock_shared(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock_shared(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock_shared(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock_shared(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_advisory_xact_lock_shared(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_try_advisory_lock(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_try_advisory_lock(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_try_advisory_lock_shared(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock_shared(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock_shared(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock_shared(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_try_advisory_lock_shared(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock_shared(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock_shared(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_lock_shared(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock_shared(bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock_shared(bigint) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock_shared(bigint) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock_shared(bigint) TO qinglong_admin;

REVOKE ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock_shared(integer, integer) FROM PUBLIC;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock_shared(integer, integer) TO qinglong_migration;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock_shared(integer, integer) TO qinglong_runtime;
GRANT ALL ON FUNCTION pg_catalog.pg_try_advisory_xact_lock_shared(integer, integer) TO qinglong_admin;

REVOKE ALL ON FUNCTION qinglong.db_now_ms() FROM PUBLIC;
GRANT ALL ON FUNCTION qinglong.db_now_ms() TO qinglong_runtime;
GRANT ALL ON FUNCTION qinglong.db_now_ms() TO qinglong_ingress;
GRANT ALL ON FUNCTION qinglong.db_now_ms() TO qinglong_admin;

REVOKE ALL ON FUNCTION qinglong.enforce_approval_decided_once() FROM PUBLIC;

REVOKE ALL ON FUNCTION qinglong.enforce_attempt_transition() FROM PUBLIC;

REVOKE ALL ON FUNCTION qinglong.enforce_event_sequence() FROM PUBLIC;

REVOKE ALL ON FUNCTION qinglong.enforce_join_token_single_use() FROM PUBLIC;

REVOKE ALL ON FUNCTION qinglong.enforce_lease_progress() FROM PUBLIC;

REVOKE ALL ON FUNCTION qinglong.enforce_run_transition() FROM PUBLIC;

REVOKE ALL ON FUNCTION qinglong.lock_authority(p_attempt_id uuid, p_session_id uuid, p_run_id uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION qinglong.lock_authority(p_attempt_id uuid, p_session_id uuid, p_run_id uuid) TO qinglong_runtime;

REVOKE ALL ON FUNCTION qinglong.prune_security_audit(p_max_age_ms bigint, p_limit integer) FROM PUBLIC;
GRANT ALL ON FUNCTION qinglong.prune_security_audit(p_max_age_ms bigint, p_limit integer) TO qinglong_runtime;

REVOKE ALL ON FUNCTION qinglong.schema_version() FROM PUBLIC;
GRANT ALL ON FUNCTION qinglong.schema_version() TO qinglong_runtime;
GRANT ALL ON FUNCTION qinglong.schema_version() TO qinglong_ingress;

REVOKE ALL ON FUNCTION qinglong.task_max_concurrent_runs(p_task_id uuid) FROM PUBLIC;
GRANT ALL ON FUNCTION qinglong.task_max_concurrent_runs(p_task_id uuid) TO qinglong_runtime;

REVOKE ALL ON FUNCTION qinglong.task_slots_held(p_task_id uuid, p_lost_since_ms bigint) FROM PUBLIC;
GRANT ALL ON FUNCTION qinglong.task_slots_held(p_task_id uuid, p_lost_since_ms bigint) TO qinglong_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE qinglong.approval_requests TO qinglong_runtime;

GRANT SELECT ON TABLE qinglong.principals TO qinglong_runtime;
GRANT SELECT ON TABLE qinglong.principals TO qinglong_ingress;
GRANT SELECT,INSERT ON TABLE qinglong.principals TO qinglong_admin;

GRANT UPDATE(status) ON TABLE qinglong.principals TO qinglong_admin;

GRANT SELECT ON TABLE qinglong.approval_projection TO qinglong_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE qinglong.attempt_output TO qinglong_runtime;

GRANT SELECT,INSERT,DELETE ON TABLE qinglong.attempt_output_chunks TO qinglong_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE qinglong.attempts TO qinglong_runtime;
GRANT SELECT ON TABLE qinglong.attempts TO qinglong_admin;

GRANT SELECT,INSERT ON TABLE qinglong.cluster_admins TO qinglong_admin;
GRANT SELECT ON TABLE qinglong.cluster_admins TO qinglong_ingress;

GRANT SELECT ON TABLE qinglong.commit_barrier TO qinglong_runtime;
GRANT SELECT ON TABLE qinglong.commit_barrier TO qinglong_admin;

GRANT UPDATE(purpose) ON TABLE qinglong.commit_barrier TO qinglong_runtime;
GRANT UPDATE(purpose) ON TABLE qinglong.commit_barrier TO qinglong_admin;

GRANT SELECT,INSERT,UPDATE ON TABLE qinglong.offers TO qinglong_runtime;

GRANT SELECT ON TABLE qinglong.operator_credentials TO qinglong_ingress;
GRANT SELECT,INSERT ON TABLE qinglong.operator_credentials TO qinglong_admin;

GRANT UPDATE(status) ON TABLE qinglong.operator_credentials TO qinglong_admin;

GRANT UPDATE(expires_at_ms) ON TABLE qinglong.operator_credentials TO qinglong_admin;

GRANT SELECT ON TABLE qinglong.projects TO qinglong_runtime;
GRANT SELECT ON TABLE qinglong.projects TO qinglong_ingress;
GRANT SELECT,INSERT ON TABLE qinglong.projects TO qinglong_admin;

GRANT UPDATE(status) ON TABLE qinglong.projects TO qinglong_admin;

GRANT UPDATE(version) ON TABLE qinglong.projects TO qinglong_admin;

GRANT SELECT ON TABLE qinglong.role_bindings TO qinglong_runtime;
GRANT SELECT ON TABLE qinglong.role_bindings TO qinglong_ingress;
GRANT SELECT,INSERT ON TABLE qinglong.role_bindings TO qinglong_admin;

GRANT UPDATE(role) ON TABLE qinglong.role_bindings TO qinglong_admin;

GRANT UPDATE(status) ON TABLE qinglong.role_bindings TO qinglong_admin;

GRANT UPDATE(version) ON TABLE qinglong.role_bindings TO qinglong_admin;

GRANT UPDATE(updated_at_ms) ON TABLE qinglong.role_bindings TO qinglong_admin;

GRANT SELECT,INSERT ON TABLE qinglong.run_events TO qinglong_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE qinglong.run_leases TO qinglong_runtime;

GRANT SELECT,INSERT,UPDATE ON TABLE qinglong.runs TO qinglong_runtime;

GRANT SELECT,INSERT ON TABLE qinglong.task_revisions TO qinglong_runtime;

GRANT SELECT ON TABLE qinglong.run_projection TO qinglong_runtime;

GRANT SELECT ON TABLE qinglong.security_audit TO qinglong_admin;

GRANT INSERT(audit_id) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(principal_kind) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(principal_id) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(operation) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(outcome) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(reason) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(project_id) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(run_id) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(worker_id) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(session_id) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(request_id) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(peer) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT INSERT(credential_id) ON TABLE qinglong.security_audit TO qinglong_ingress;

GRANT SELECT,INSERT ON TABLE qinglong.tasks TO qinglong_runtime;

GRANT SELECT ON TABLE qinglong.worker_identities TO qinglong_runtime;
GRANT SELECT ON TABLE qinglong.worker_identities TO qinglong_ingress;
GRANT SELECT,INSERT ON TABLE qinglong.worker_identities TO qinglong_admin;

GRANT UPDATE(status) ON TABLE qinglong.worker_identities TO qinglong_admin;

GRANT UPDATE(project_ids) ON TABLE qinglong.worker_identities TO qinglong_admin;

GRANT UPDATE(cordoned) ON TABLE qinglong.worker_identities TO qinglong_admin;

GRANT SELECT,INSERT ON TABLE qinglong.worker_join_tokens TO qinglong_admin;

GRANT UPDATE(used_at_ms) ON TABLE qinglong.worker_join_tokens TO qinglong_admin;

GRANT UPDATE(used_key_sha256) ON TABLE qinglong.worker_join_tokens TO qinglong_admin;

GRANT UPDATE(used_by_audit_id) ON TABLE qinglong.worker_join_tokens TO qinglong_admin;

GRANT SELECT,INSERT,UPDATE ON TABLE qinglong.worker_sessions TO qinglong_runtime;
GRANT SELECT ON TABLE qinglong.worker_sessions TO qinglong_admin;

GRANT SELECT(session_id) ON TABLE qinglong.worker_sessions TO qinglong_ingress;

GRANT SELECT(worker_id) ON TABLE qinglong.worker_sessions TO qinglong_ingress;

GRANT SELECT(generation) ON TABLE qinglong.worker_sessions TO qinglong_ingress;

GRANT SELECT(status) ON TABLE qinglong.worker_sessions TO qinglong_ingress;

ALTER DEFAULT PRIVILEGES FOR ROLE qinglong_migration REVOKE ALL ON FUNCTIONS FROM PUBLIC;
