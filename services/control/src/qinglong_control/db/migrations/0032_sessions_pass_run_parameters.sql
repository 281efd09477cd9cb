-- 0032: whether a session's Worker hands Run parameters to its executors.
--
-- A Worker of an earlier version does not know Run parameters (0031): offered a Run that
-- has some, it would run it without them, and a script's ${QINGLONG_PARAM_X:-default}
-- would quietly take the default. A Worker that knows them says so when it opens its
-- session and at every renewal; placement offers a Run with parameters only to a session
-- whose Worker said so last. A session opened before this migration starts as not
-- saying so, and learns it at its next renewal.

ALTER TABLE qinglong.worker_sessions
    ADD COLUMN passes_run_parameters boolean NOT NULL DEFAULT false;
-- A constant default: no row is rewritten.
