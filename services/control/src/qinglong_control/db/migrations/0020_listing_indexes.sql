-- qinglong: outside-transaction
-- 0020: filtered listings read their own rows, not the whole history.
--
-- ListRuns filtered by task or by state (`qinglong run list --task/--state`) had only
-- runs_by_project (project_id, created_at_ms, run_id) to read: the filter was applied row
-- by row, newest first, until a page was found — every Run of the project when none
-- matched (`--state running` on a quiet project with a long history), until the
-- statement bound answered UNAVAILABLE. Runs are never deleted, so that only grew.
-- ListAuditRecords filtered by principal read the audit the same way.
--
-- Each index keeps the listing's order after its filter column, so a page is an index
-- range read backwards. The state index is written on each state change of a Run (a few
-- per Run; those updates already write the partial indexes whose predicates name the
-- state), the audit index on each audited call.
--
-- Built CONCURRENTLY, outside a transaction (db/migrate.py): a plain CREATE INDEX would
-- stop every write to runs — every command — and to the audit — every call ingress
-- admits — for as long as it reads the table. Each index is dropped first, so a
-- migrator that stopped half-way, leaving an invalid index, is simply run again.

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_by_project_task;
CREATE INDEX CONCURRENTLY runs_by_project_task
    ON qinglong.runs (project_id, task_id, created_at_ms, run_id);

DROP INDEX CONCURRENTLY IF EXISTS qinglong.runs_by_project_state;
CREATE INDEX CONCURRENTLY runs_by_project_state
    ON qinglong.runs (project_id, state, created_at_ms, run_id);

DROP INDEX CONCURRENTLY IF EXISTS qinglong.security_audit_by_principal;
CREATE INDEX CONCURRENTLY security_audit_by_principal
    ON qinglong.security_audit (principal_id, occurred_at_ms, audit_id);
