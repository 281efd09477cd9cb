-- 0014: which migrations a database has, readable by the services.
--
-- A control built for a newer schema than its database has would fail, call by call,
-- wherever it uses what a missing migration creates (in a rolling upgrade that started
-- before its migration Job finished, say). Control reads this at start-up and refuses to
-- serve a database that lacks a migration it ships. The history table belongs to the
-- migration role; this function shows control (the runtime role) its highest version and
-- nothing else.

CREATE FUNCTION qinglong.schema_version() RETURNS integer
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
    AS $$ SELECT coalesce(max(version), 0) FROM public.qinglong_schema_migrations $$;

REVOKE EXECUTE ON FUNCTION qinglong.schema_version() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION qinglong.schema_version() TO qinglong_runtime;
