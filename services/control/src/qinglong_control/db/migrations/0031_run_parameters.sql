-- 0031: a Run carries the parameters it was triggered with.
--
-- TriggerRun takes up to 32 named values (run_service.proto, the one place their bounds
-- are written; ingress and control enforce them before this table sees them). They are
-- part of the Run, not of its revision: the same revision runs with other values. The
-- Worker gets them with the offer and the claim, and its executor receives each as the
-- environment variable QINGLONG_PARAM_<name>. A retried trigger compares them with the
-- Run its request id made (REPLAY_MISMATCH when they differ).

ALTER TABLE qinglong.runs
    ADD COLUMN parameters jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD CONSTRAINT runs_parameters_object CHECK (jsonb_typeof(parameters) = 'object') NOT VALID;
-- NOT VALID: every existing row has the default, an object, so nothing needs reading
-- (new rows are checked), and the column's constant default rewrites no row either.
