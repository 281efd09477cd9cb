-- 0032: whether a session's Worker hands Run parameters to its executors.
--
-- A Worker of an earlier version does not know Run parameters (0031): offered a Run that
-- has some, it would run it without them, and a script's ${QINGLONG_PARAM_X:-default}
-- would quietly take the default. A Worker that knows them says so when it opens its
-- session; placement offers a Run with parameters only to such a session. Sessions
-- opened before this migration did not say so: they are offered none until their Worker
-- opens a new session (an upgraded Worker does: a Worker opens one whenever it starts).

ALTER TABLE qinglong.worker_sessions
    ADD COLUMN passes_run_parameters boolean NOT NULL DEFAULT false;
-- A constant default: no row is rewritten.
