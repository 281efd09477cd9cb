-- 0009: mutations held for approval (R-OPS-2).
--
-- A call that project policy admits only with an approval (an Agent's run.stop) is kept
-- here exactly as it was sent, with who asked and the audit row of that call. Approving
-- executes it as the approver; denying or letting it expire executes nothing. A request
-- is decided once: the trigger refuses any change to a decided request and any change to
-- what was asked, so the record an approver saw is the one that runs.

CREATE TABLE qinglong.approval_requests (
    approval_id uuid PRIMARY KEY,
    project_id qinglong.slug NOT NULL REFERENCES qinglong.projects (project_id),
    method text NOT NULL CHECK (length(method) BETWEEN 1 AND 200),
    request_type text NOT NULL CHECK (length(request_type) BETWEEN 1 AND 200),
    -- The held public request; ingress bounds a request to 8 KiB before it gets here.
    request bytea NOT NULL CHECK (octet_length(request) <= 8192),
    -- SHA-256 of method and request: an exact retry of the held call finds its request.
    request_digest bytea NOT NULL CHECK (octet_length(request_digest) = 32),
    run_id uuid REFERENCES qinglong.runs (run_id),
    requested_by uuid NOT NULL REFERENCES qinglong.principals (principal_id),
    requested_by_kind text NOT NULL CHECK (requested_by_kind IN ('user', 'agent')),
    audit_id uuid NOT NULL,
    requested_at_ms qinglong.epoch_ms NOT NULL,
    expires_at_ms qinglong.epoch_ms NOT NULL,
    state text NOT NULL DEFAULT 'pending'
        CHECK (state IN ('pending', 'approved', 'denied', 'expired')),
    decided_by uuid REFERENCES qinglong.principals (principal_id),
    decided_at_ms qinglong.epoch_ms,
    note text CHECK (octet_length(note) <= 500),
    result text CHECK (result ~ '^[A-Z][A-Z0-9_]{0,63}$'),
    CONSTRAINT approval_requests_expiry_after_request CHECK (expires_at_ms > requested_at_ms),
    CONSTRAINT approval_requests_decision_whole CHECK (
        (state = 'pending' AND decided_at_ms IS NULL AND decided_by IS NULL AND result IS NULL)
        OR (state = 'approved' AND decided_at_ms IS NOT NULL AND decided_by IS NOT NULL
            AND result IS NOT NULL)
        OR (state = 'denied' AND decided_at_ms IS NOT NULL AND decided_by IS NOT NULL
            AND result IS NULL)
        OR (state = 'expired' AND decided_at_ms IS NOT NULL AND decided_by IS NULL
            AND result IS NULL)
    ),
    CONSTRAINT approval_requests_held_once UNIQUE (project_id, requested_by, request_digest)
);

-- ListApprovals: a project's requests newest first, a page at a time.
CREATE INDEX approval_requests_by_project
    ON qinglong.approval_requests (project_id, requested_at_ms, approval_id);
-- The reconciler's expiry scan reads only what is still pending.
CREATE INDEX approval_requests_pending_expiry
    ON qinglong.approval_requests (expires_at_ms) WHERE state = 'pending';

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

CREATE TRIGGER approval_requests_decided_once BEFORE UPDATE ON qinglong.approval_requests
    FOR EACH ROW EXECUTE FUNCTION qinglong.enforce_approval_decided_once();

-- A request as operators see it, in one definition for GetApproval and ListApprovals: the
-- principals' names, and a pending request past its expiry already reads as expired
-- (the reconciler records that in its next cycle).
CREATE VIEW qinglong.approval_projection AS
SELECT a.approval_id, a.project_id,
       CASE WHEN a.state = 'pending' AND a.expires_at_ms <= qinglong.db_now_ms()
            THEN 'expired' ELSE a.state END AS state,
       a.method, a.request_type, a.request, a.run_id, a.requested_by, a.requested_by_kind,
       rp.name AS requested_by_name, a.audit_id, a.requested_at_ms, a.expires_at_ms,
       a.decided_by, dp.name AS decided_by_name, a.decided_at_ms, a.note, a.result
  FROM qinglong.approval_requests a
  JOIN qinglong.principals rp ON rp.principal_id = a.requested_by
  LEFT JOIN qinglong.principals dp ON dp.principal_id = a.decided_by;

-- Only the runtime holds and decides requests; ingress forwards, the admin role and
-- anyone else have no access. Nothing is ever deleted.
GRANT SELECT, INSERT, UPDATE ON qinglong.approval_requests TO qinglong_runtime;
GRANT SELECT ON qinglong.approval_projection TO qinglong_runtime;
