-- 0030: a caller's pending approval requests by index.
--
-- Before each new request control counts the caller's requests still waiting in the
-- project (at most PENDING_APPROVALS_PER_CALLER, domain/approvals.py): without this
-- index that count read every request the project ever had.

CREATE INDEX approval_requests_pending_by_caller
    ON qinglong.approval_requests (project_id, requested_by) WHERE state = 'pending';
