-- 0001: the whole runtime schema, its invariants and the grants of the three roles.
--
-- Conventions (SPEC §0, ARCHITECTURE "Time and identity"):
--   * every durable time is epoch milliseconds read from PostgreSQL (qinglong.db_now_ms()),
--     never a client clock;
--   * every secret is stored only as a SHA-256 digest, 64 lowercase hex characters; the
--     CHECKs below make a column physically unable to hold a plaintext token (plaintext
--     tokens are `qlc1_…`/`qlo1_…`, 48 characters, and fail the digest shape);
--   * every status column has a CHECK; illegal transitions and changes to terminal rows are
--     rejected by triggers, so a bug in the service cannot write an impossible history.
--
-- Runs as the migration role, which owns everything created here. The runtime and ingress
-- roles must already exist (created by the cluster administrator / bootstrap).

CREATE SCHEMA qinglong;

REVOKE ALL ON SCHEMA qinglong FROM PUBLIC;

-- DB time in epoch milliseconds. clock_timestamp(), not now(): commands read the clock
-- AFTER taking their locks (SPEC R-ACK-3), and now() is frozen at transaction start.
CREATE FUNCTION qinglong.db_now_ms() RETURNS bigint
    LANGUAGE sql VOLATILE PARALLEL SAFE
    AS $$ SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint $$;

-- Shapes shared by many columns.
CREATE DOMAIN qinglong.slug AS text
    CHECK (VALUE ~ '^[a-z0-9][a-z0-9-]{0,62}$');
CREATE DOMAIN qinglong.sha256_hex AS text
    CHECK (VALUE ~ '^[0-9a-f]{64}$');
CREATE DOMAIN qinglong.epoch_ms AS bigint
    CHECK (VALUE >= 0);

------------------------------------------------------------------------------------------
-- Identity and policy: read by ingress for authentication and admission.
------------------------------------------------------------------------------------------

CREATE TABLE qinglong.projects (
    project_id     qinglong.slug PRIMARY KEY,
    display_name   text NOT NULL CHECK (length(display_name) BETWEEN 1 AND 200),
    status         text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'archived')),
    version        bigint NOT NULL DEFAULT 1 CHECK (version >= 1),
    created_at_ms  qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms()
);

CREATE TABLE qinglong.principals (
    principal_id   uuid PRIMARY KEY,
    kind           text NOT NULL CHECK (kind IN ('user', 'agent', 'worker', 'service')),
    name           text NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    status         text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'disabled')),
    created_at_ms  qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms(),
    UNIQUE (kind, name)
);

-- Operator credentials: a bearer token (stored as its digest only) or a client certificate
-- identity (its SAN URI), each mapped to a user or agent principal.
CREATE TABLE qinglong.operator_credentials (
    credential_id    uuid PRIMARY KEY,
    principal_id     uuid NOT NULL REFERENCES qinglong.principals (principal_id),
    kind             text NOT NULL CHECK (kind IN ('bearer_token', 'client_certificate')),
    token_digest     qinglong.sha256_hex UNIQUE,
    certificate_uri  text UNIQUE CHECK (length(certificate_uri) BETWEEN 1 AND 512),
    status           text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'revoked')),
    created_at_ms    qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms(),
    expires_at_ms    qinglong.epoch_ms,
    CHECK ((kind = 'bearer_token') = (token_digest IS NOT NULL)),
    CHECK ((kind = 'client_certificate') = (certificate_uri IS NOT NULL))
);

-- A Worker's stable identity: its worker_id and the SAN URI of its client certificate.
CREATE TABLE qinglong.worker_identities (
    worker_id        qinglong.slug PRIMARY KEY,
    principal_id     uuid NOT NULL UNIQUE REFERENCES qinglong.principals (principal_id),
    certificate_uri  text NOT NULL UNIQUE CHECK (length(certificate_uri) BETWEEN 1 AND 512),
    status           text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'disabled')),
    created_at_ms    qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms()
);

-- Who may do what in a project. `version` advances on every change so the cancellation
-- transaction can fence on the binding it was admitted under (SPEC R-CAN-3).
CREATE TABLE qinglong.role_bindings (
    project_id     qinglong.slug NOT NULL REFERENCES qinglong.projects (project_id),
    principal_id   uuid NOT NULL REFERENCES qinglong.principals (principal_id),
    role           text NOT NULL CHECK (role IN ('owner', 'admin', 'operator', 'viewer')),
    status         text NOT NULL DEFAULT 'active' CHECK (status IN ('active', 'revoked')),
    version        bigint NOT NULL DEFAULT 1 CHECK (version >= 1),
    updated_at_ms  qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms(),
    PRIMARY KEY (project_id, principal_id)
);

------------------------------------------------------------------------------------------
-- Work definitions.
------------------------------------------------------------------------------------------

CREATE TABLE qinglong.tasks (
    task_id            uuid PRIMARY KEY,
    project_id         qinglong.slug NOT NULL REFERENCES qinglong.projects (project_id),
    display_name       text NOT NULL CHECK (length(display_name) BETWEEN 1 AND 200),
    labels             jsonb NOT NULL DEFAULT '{}'::jsonb CHECK (
                           jsonb_typeof(labels) = 'object' AND octet_length(labels::text) <= 8192),
    -- AIP-155: a retried create returns the task the first call made.
    create_request_id  text NOT NULL CHECK (create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    created_by         text NOT NULL CHECK (length(created_by) BETWEEN 1 AND 200),
    created_at_ms      qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms(),
    UNIQUE (project_id, create_request_id),
    UNIQUE (project_id, task_id)
);

-- Immutable: no role holds UPDATE or DELETE on it, so a Run's pinned revision (and its
-- timeout, the only source of the durable deadline, SPEC R-TO-1) can never change.
CREATE TABLE qinglong.task_revisions (
    revision_id      uuid PRIMARY KEY,
    project_id       qinglong.slug NOT NULL,
    task_id          uuid NOT NULL,
    revision_number  integer NOT NULL CHECK (revision_number >= 1),
    executor_type    text NOT NULL CHECK (executor_type IN ('remote_worker')),
    command          jsonb NOT NULL CHECK (
                         jsonb_typeof(command) = 'array'
                         AND jsonb_array_length(command) BETWEEN 1 AND 64),
    timeout_ms       bigint CHECK (timeout_ms BETWEEN 1 AND 604800000),
    create_request_id  text NOT NULL CHECK (create_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    created_by       text NOT NULL CHECK (length(created_by) BETWEEN 1 AND 200),
    created_at_ms    qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms(),
    UNIQUE (task_id, revision_number),
    UNIQUE (task_id, create_request_id),
    UNIQUE (project_id, task_id, revision_id),
    FOREIGN KEY (project_id, task_id) REFERENCES qinglong.tasks (project_id, task_id)
);

------------------------------------------------------------------------------------------
-- Workers: sessions and offers.
------------------------------------------------------------------------------------------

-- One incarnation of a Worker. Opening a new generation replaces (fences) the old one.
CREATE TABLE qinglong.worker_sessions (
    session_id       uuid PRIMARY KEY,
    worker_id        qinglong.slug NOT NULL REFERENCES qinglong.worker_identities (worker_id),
    generation       bigint NOT NULL CHECK (generation >= 1),
    status           text NOT NULL CHECK (status IN ('online', 'draining', 'replaced', 'closed', 'expired')),
    executor_types   text[] NOT NULL CHECK (
                         cardinality(executor_types) BETWEEN 1 AND 8
                         AND executor_types <@ ARRAY['remote_worker']),
    max_concurrency  integer NOT NULL CHECK (max_concurrency BETWEEN 1 AND 1024),
    agent_version    text NOT NULL DEFAULT '' CHECK (length(agent_version) <= 64),
    -- AIP-155: a retried open returns this session instead of replacing it.
    open_request_id  text NOT NULL CHECK (open_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    opened_at_ms     qinglong.epoch_ms NOT NULL,
    renewed_at_ms    qinglong.epoch_ms NOT NULL,
    expires_at_ms    qinglong.epoch_ms NOT NULL,
    closed_at_ms     qinglong.epoch_ms,
    UNIQUE (worker_id, generation),
    UNIQUE (worker_id, open_request_id),
    UNIQUE (session_id, worker_id, generation),
    CHECK (expires_at_ms >= renewed_at_ms AND renewed_at_ms >= opened_at_ms),
    CHECK ((status IN ('online', 'draining')) = (closed_at_ms IS NULL))
);

-- At most one live session per Worker.
CREATE UNIQUE INDEX worker_sessions_one_live_per_worker
    ON qinglong.worker_sessions (worker_id) WHERE status IN ('online', 'draining');

------------------------------------------------------------------------------------------
-- Runs, offers, attempts, leases, events.
------------------------------------------------------------------------------------------

CREATE TABLE qinglong.runs (
    run_id                   uuid PRIMARY KEY,
    project_id               qinglong.slug NOT NULL,
    task_id                  uuid NOT NULL,
    revision_id              uuid NOT NULL,
    state                    text NOT NULL CHECK (state IN (
                                 'created', 'queued', 'waiting_approval', 'dispatching', 'running',
                                 'retry_wait', 'lost',
                                 'succeeded', 'failed', 'cancelled', 'timed_out')),
    -- Which service owns the Run's lifecycle; only runtime-owned Runs accept Worker ACKs.
    owner                    text NOT NULL DEFAULT 'runtime' CHECK (owner IN ('runtime')),
    executor_type            text NOT NULL CHECK (executor_type IN ('remote_worker')),
    version                  bigint NOT NULL DEFAULT 1 CHECK (version >= 1),
    event_sequence           bigint NOT NULL DEFAULT 0 CHECK (event_sequence >= 0),
    attempt_count            integer NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    trigger_request_id       text NOT NULL CHECK (trigger_request_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    triggered_by             text NOT NULL CHECK (length(triggered_by) BETWEEN 1 AND 200),
    cancel_requested_at_ms   qinglong.epoch_ms,
    cancel_reason            text CHECK (cancel_reason IN ('user', 'policy', 'shutdown', 'reconcile', 'timeout')),
    cancel_requested_by      text CHECK (length(cancel_requested_by) BETWEEN 1 AND 200),
    deadline_at_ms           qinglong.epoch_ms,
    created_at_ms            qinglong.epoch_ms NOT NULL,
    updated_at_ms            qinglong.epoch_ms NOT NULL,
    started_at_ms            qinglong.epoch_ms,
    finished_at_ms           qinglong.epoch_ms,
    error_code               text CHECK (error_code ~ '^[A-Z][A-Z0-9_]{0,62}$'),
    error_summary            text CHECK (length(error_summary) <= 256),
    UNIQUE (project_id, trigger_request_id),
    UNIQUE (project_id, run_id),
    FOREIGN KEY (project_id, task_id, revision_id)
        REFERENCES qinglong.task_revisions (project_id, task_id, revision_id),
    CHECK ((cancel_requested_at_ms IS NULL) = (cancel_reason IS NULL)),
    CHECK ((state IN ('succeeded', 'failed', 'cancelled', 'timed_out')) = (finished_at_ms IS NOT NULL))
);

-- Placement scans queued Runs in arrival order.
CREATE INDEX runs_queued_by_age ON qinglong.runs (created_at_ms, run_id) WHERE state = 'queued';
-- Convergence scans Runs with a durable cancel intent that are not yet terminal.
CREATE INDEX runs_cancel_pending ON qinglong.runs (cancel_requested_at_ms, run_id)
    WHERE cancel_requested_at_ms IS NOT NULL
      AND state IN ('created', 'queued', 'waiting_approval', 'retry_wait', 'lost');
CREATE INDEX runs_by_project ON qinglong.runs (project_id, created_at_ms DESC, run_id);

-- A placement of a queued Run onto one Session.
CREATE TABLE qinglong.offers (
    offer_id           uuid PRIMARY KEY,
    run_id             uuid NOT NULL REFERENCES qinglong.runs (run_id),
    session_id         uuid NOT NULL,
    worker_id          qinglong.slug NOT NULL,
    worker_generation  bigint NOT NULL,
    state              text NOT NULL CHECK (state IN ('open', 'claimed', 'expired', 'withdrawn')),
    created_at_ms      qinglong.epoch_ms NOT NULL,
    expires_at_ms      qinglong.epoch_ms NOT NULL CHECK (expires_at_ms > created_at_ms),
    claimed_at_ms      qinglong.epoch_ms,
    UNIQUE (offer_id, run_id),
    FOREIGN KEY (session_id, worker_id, worker_generation)
        REFERENCES qinglong.worker_sessions (session_id, worker_id, generation),
    CHECK ((state = 'claimed') = (claimed_at_ms IS NOT NULL))
);

-- A Run is offered to at most one Session at a time.
CREATE UNIQUE INDEX offers_one_open_per_run ON qinglong.offers (run_id) WHERE state = 'open';
CREATE INDEX offers_open_by_session ON qinglong.offers (session_id) WHERE state = 'open';

CREATE TABLE qinglong.attempts (
    attempt_id              uuid PRIMARY KEY,
    run_id                  uuid NOT NULL REFERENCES qinglong.runs (run_id),
    attempt_number          integer NOT NULL CHECK (attempt_number >= 1),
    state                   text NOT NULL CHECK (state IN (
                                'claimed', 'starting', 'running',
                                'succeeded', 'failed', 'cancelled', 'timed_out', 'lost')),
    executor_type           text NOT NULL CHECK (executor_type IN ('remote_worker')),
    worker_id               qinglong.slug NOT NULL,
    session_id              uuid NOT NULL,
    worker_generation       bigint NOT NULL,
    offer_id                uuid NOT NULL UNIQUE,
    -- Projection of the Run Lease, re-checked by every fenced command (SPEC R-ACK-2).
    lease_generation        integer NOT NULL CHECK (lease_generation >= 1),
    lease_version           bigint NOT NULL CHECK (lease_version >= 1),
    lease_token_digest      qinglong.sha256_hex NOT NULL,
    claimed_at_ms           qinglong.epoch_ms NOT NULL,
    starting_at_ms          qinglong.epoch_ms,
    started_at_ms           qinglong.epoch_ms,
    deadline_at_ms          qinglong.epoch_ms,
    finished_at_ms          qinglong.epoch_ms,
    executor_handle         text CHECK (octet_length(executor_handle) BETWEEN 1 AND 512),
    log_artifact_id         text CHECK (octet_length(log_artifact_id) BETWEEN 1 AND 256),
    callback_sequence       bigint CHECK (callback_sequence >= 0),
    callback_token_digest   qinglong.sha256_hex,
    exit_code               integer,
    error_code              text CHECK (error_code ~ '^[A-Z][A-Z0-9_]{0,62}$'),
    error_summary           text CHECK (length(error_summary) <= 256),
    UNIQUE (run_id, attempt_number),
    FOREIGN KEY (offer_id, run_id) REFERENCES qinglong.offers (offer_id, run_id),
    FOREIGN KEY (session_id, worker_id, worker_generation)
        REFERENCES qinglong.worker_sessions (session_id, worker_id, generation),
    CHECK ((state IN ('succeeded', 'failed', 'cancelled', 'timed_out', 'lost')) = (finished_at_ms IS NOT NULL)),
    CHECK (state NOT IN ('running', 'succeeded') OR executor_handle IS NOT NULL),
    CHECK ((executor_handle IS NULL) = (started_at_ms IS NULL))
);

-- At most one live Attempt per Run.
CREATE UNIQUE INDEX attempts_one_live_per_run
    ON qinglong.attempts (run_id) WHERE state IN ('claimed', 'starting', 'running');

-- The Run Lease: which Session owns an Attempt. One per Attempt.
CREATE TABLE qinglong.run_leases (
    attempt_id         uuid PRIMARY KEY REFERENCES qinglong.attempts (attempt_id),
    run_id             uuid NOT NULL REFERENCES qinglong.runs (run_id),
    worker_id          qinglong.slug NOT NULL,
    session_id         uuid NOT NULL,
    worker_generation  bigint NOT NULL,
    offer_id           uuid NOT NULL UNIQUE REFERENCES qinglong.attempts (offer_id),
    lease_generation   integer NOT NULL CHECK (lease_generation >= 1),
    token_digest       qinglong.sha256_hex NOT NULL,
    version            bigint NOT NULL CHECK (version >= 1),
    status             text NOT NULL CHECK (status IN ('leased', 'completed', 'expired')),
    acquired_at_ms     qinglong.epoch_ms NOT NULL,
    renewed_at_ms      qinglong.epoch_ms NOT NULL,
    expires_at_ms      qinglong.epoch_ms NOT NULL,
    ended_at_ms        qinglong.epoch_ms,
    FOREIGN KEY (session_id, worker_id, worker_generation)
        REFERENCES qinglong.worker_sessions (session_id, worker_id, generation),
    CHECK ((status = 'leased') = (ended_at_ms IS NULL)),
    CHECK (expires_at_ms >= renewed_at_ms)
);

-- At most one held lease per Run.
CREATE UNIQUE INDEX run_leases_one_leased_per_run ON qinglong.run_leases (run_id) WHERE status = 'leased';
-- The expiry authority scans held leases by expiry.
CREATE INDEX run_leases_leased_by_expiry ON qinglong.run_leases (expires_at_ms) WHERE status = 'leased';

-- Append-only history of a Run, with a gapless per-Run sequence.
CREATE TABLE qinglong.run_events (
    event_id        uuid PRIMARY KEY,
    run_id          uuid NOT NULL REFERENCES qinglong.runs (run_id),
    sequence        bigint NOT NULL CHECK (sequence >= 1),
    event_type      text NOT NULL CHECK (event_type ~ '^[a-z_]+\.[a-z_]+$' AND length(event_type) <= 64),
    attempt_id      uuid REFERENCES qinglong.attempts (attempt_id),
    actor_kind      text NOT NULL CHECK (actor_kind IN ('worker', 'user', 'agent', 'reconciler', 'system')),
    actor_id        text NOT NULL CHECK (length(actor_id) BETWEEN 1 AND 200),
    occurred_at_ms  qinglong.epoch_ms NOT NULL,
    payload         jsonb NOT NULL DEFAULT '{}'::jsonb CHECK (
                        jsonb_typeof(payload) = 'object' AND octet_length(payload::text) <= 4096),
    -- Derived key of an intent (e.g. a cancel mutation or a convergence step) so a retried
    -- intent can never append a second Event.
    dedupe_key      text UNIQUE CHECK (length(dedupe_key) BETWEEN 1 AND 200),
    UNIQUE (run_id, sequence)
);

------------------------------------------------------------------------------------------
-- Security audit: the one table ingress writes.
------------------------------------------------------------------------------------------

CREATE TABLE qinglong.security_audit (
    audit_id        uuid PRIMARY KEY,
    occurred_at_ms  qinglong.epoch_ms NOT NULL DEFAULT qinglong.db_now_ms(),
    principal_kind  text CHECK (principal_kind IN ('worker', 'user', 'agent', 'service', 'anonymous')),
    principal_id    text CHECK (length(principal_id) BETWEEN 1 AND 512),
    operation       text NOT NULL CHECK (length(operation) BETWEEN 1 AND 200),
    outcome         text NOT NULL CHECK (outcome IN (
                        'admitted', 'require_approval', 'unauthenticated', 'permission_denied',
                        'invalid_argument', 'unavailable')),
    reason          text CHECK (reason ~ '^[A-Z][A-Z0-9_]{0,62}$'),
    project_id      text CHECK (length(project_id) <= 64),
    run_id          uuid,
    worker_id       text CHECK (length(worker_id) <= 64),
    session_id      uuid,
    request_id      text CHECK (length(request_id) <= 64),
    peer            text CHECK (length(peer) <= 256)
);

CREATE INDEX security_audit_by_time ON qinglong.security_audit (occurred_at_ms);

------------------------------------------------------------------------------------------
-- Invariants PostgreSQL enforces on every write, whoever writes.
------------------------------------------------------------------------------------------

-- SPEC §1: the only legal Run transitions; a terminal Run never changes again.
CREATE FUNCTION qinglong.enforce_run_transition() RETURNS trigger
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
        OR (OLD.state = 'dispatching' AND NEW.state IN ('running', 'failed', 'cancelled', 'timed_out', 'lost'))
        OR (OLD.state = 'running' AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'timed_out', 'lost'))
        OR (OLD.state = 'retry_wait' AND NEW.state IN ('queued', 'cancelled', 'timed_out'))
        OR (OLD.state = 'lost' AND NEW.state IN ('retry_wait', 'queued', 'cancelled', 'timed_out'))
    ) THEN
        RAISE EXCEPTION 'illegal run transition % -> %', OLD.state, NEW.state
            USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_legal_transition';
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER runs_enforce_transition BEFORE UPDATE ON qinglong.runs
    FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_run_transition();

-- SPEC §1: the only legal Attempt transitions; a terminal Attempt never changes again.
CREATE FUNCTION qinglong.enforce_attempt_transition() RETURNS trigger
    LANGUAGE plpgsql AS $$
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

CREATE TRIGGER attempts_enforce_transition BEFORE UPDATE ON qinglong.attempts
    FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_attempt_transition();

-- Lease versions only move forward, and a completed or expired lease is final.
CREATE FUNCTION qinglong.enforce_lease_progress() RETURNS trigger
    LANGUAGE plpgsql AS $$
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

CREATE TRIGGER run_leases_enforce_progress BEFORE UPDATE ON qinglong.run_leases
    FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_lease_progress();

-- Events are gapless per Run: each new Event takes exactly the Run's event_sequence, which
-- the command advanced under the Run's row lock in the same transaction.
CREATE FUNCTION qinglong.enforce_event_sequence() RETURNS trigger
    LANGUAGE plpgsql AS $$
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

CREATE TRIGGER run_events_enforce_sequence BEFORE INSERT ON qinglong.run_events
    FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_event_sequence();

------------------------------------------------------------------------------------------
-- Grants (SPEC R-ROLE-1). Nothing is granted to PUBLIC.
------------------------------------------------------------------------------------------

GRANT USAGE ON SCHEMA qinglong TO qinglong_runtime, qinglong_ingress;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA qinglong FROM PUBLIC;
GRANT EXECUTE ON FUNCTION qinglong.db_now_ms() TO qinglong_runtime, qinglong_ingress;
-- Trigger functions run with the privileges of the writing role; they need no EXECUTE grant
-- because PostgreSQL checks EXECUTE only at CREATE TRIGGER time.

-- The runtime role: the DML the runtime needs, nothing more. No DELETE anywhere, no UPDATE
-- on history (events), definitions (task revisions) or identity tables.
GRANT SELECT ON qinglong.projects, qinglong.principals, qinglong.role_bindings,
               qinglong.worker_identities
    TO qinglong_runtime;
GRANT SELECT, INSERT ON qinglong.tasks, qinglong.task_revisions, qinglong.run_events
    TO qinglong_runtime;
GRANT SELECT, INSERT, UPDATE ON qinglong.runs, qinglong.attempts, qinglong.run_leases,
                                qinglong.worker_sessions, qinglong.offers
    TO qinglong_runtime;

-- The worker-ingress role: write the audit, read what authentication and admission need.
-- It cannot read or change Runs, Attempts, Leases, Events or Offers.
GRANT INSERT ON qinglong.security_audit TO qinglong_ingress;
GRANT SELECT ON qinglong.projects, qinglong.principals, qinglong.role_bindings,
               qinglong.operator_credentials, qinglong.worker_identities
    TO qinglong_ingress;
-- Binding a request's session to the authenticated worker needs only these columns.
GRANT SELECT (session_id, worker_id, generation, status) ON qinglong.worker_sessions
    TO qinglong_ingress;
