-- 0044: at most how many Runs of a task may hold a slot at once (a revision's
-- max_concurrent_runs).
--
-- A deploy, a migration, a job that writes one shared resource must not run twice at
-- once, and nothing outside the control plane can hold that: only it knows which Runs are
-- queued, running, or lost with an executor that may still be stopping. A revision's plan
-- may now carry the limit, and the task's newest revision's limit is the task's: a Run of
-- the task (whatever revision it pins) waits `created` until the task has a free slot
-- (db/concurrency_slots.py). The contract declares the range (execution.proto); this
-- CHECK only keeps the column meaningful, so the numbers live in one place.
--
-- One table per migration, as in 0033-0035.

ALTER TABLE qinglong.task_revisions
    ADD COLUMN max_concurrent_runs integer,
    ADD CONSTRAINT task_revisions_max_concurrent_runs_positive
        CHECK (max_concurrent_runs > 0) NOT VALID;
-- NOT VALID: every existing row is NULL (no limit, what it meant), so nothing needs
-- reading, and a column without a default rewrites no row.
