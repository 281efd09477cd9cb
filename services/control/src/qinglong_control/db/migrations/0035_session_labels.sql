-- 0035: the labels a Worker declared with its session (OpenSession, every RenewSession).
--
-- Placement offers a session only Runs whose worker_selector (0034) its labels contain.
-- A renewal replaces them (a Worker restarted with other labels resumes its session). One
-- table, as in 0033.

ALTER TABLE qinglong.worker_sessions
    ADD COLUMN labels jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD CONSTRAINT worker_sessions_labels_object
        CHECK (jsonb_typeof(labels) = 'object') NOT VALID;
-- As in 0033: no row is read or rewritten; sessions opened before declared no labels.
