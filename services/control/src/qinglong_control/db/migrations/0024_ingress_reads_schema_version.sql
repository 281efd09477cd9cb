-- 0024: ingress may read which migrations the database has (0014), as control does.
--
-- Ingress writes columns a migration added (0022's security_audit.credential_id): an
-- ingress built for a newer schema than its database has would fail every call's audit
-- row. It reads the version at start-up and refuses such a database. Only the number is
-- shown, as to control.

GRANT EXECUTE ON FUNCTION qinglong.schema_version() TO qinglong_ingress;
