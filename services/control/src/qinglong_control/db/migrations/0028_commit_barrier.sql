-- 0028: a row a command locks so that its COMMIT waits for the synchronous standby even
-- when it wrote nothing.
--
-- PostgreSQL makes a COMMIT wait for the synchronous standby only if the transaction
-- wrote WAL. A command that writes nothing — a retry answered from the earlier
-- transaction's rows (a replayed create), a change already made (a revoke of a revoked
-- binding) — therefore committed at once. But the earlier transaction may be visible on
-- the primary without being on the standby: a COMMIT whose wait for the standby was
-- cancelled (control's storage budget cancels a command that outlasts it, and its caller
-- is answered UNAVAILABLE) is kept on the primary with only a warning. The retry then
-- confirmed a write that a promotion loses: the caller, told it was done, never tried
-- again. A FOR KEY SHARE lock of this row writes WAL, so such a COMMIT waits like any
-- write's, until the standby has everything before it — the earlier write included.
-- (Taking a transaction id alone, pg_current_xact_id(), writes no WAL and waits for
-- nothing.) Locking it is a row lock, so the roles need UPDATE on one column.

CREATE TABLE qinglong.commit_barrier (
    barrier smallint PRIMARY KEY CHECK (barrier = 1),
    purpose text NOT NULL
);

INSERT INTO qinglong.commit_barrier (barrier, purpose)
VALUES (1, 'locked FOR KEY SHARE by a command that wrote nothing, so its COMMIT waits for the synchronous standby');

GRANT SELECT, UPDATE (purpose) ON qinglong.commit_barrier TO qinglong_runtime, qinglong_admin;
