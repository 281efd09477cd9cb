-- 0027: no role but those a migration names may call a function of the schema.
--
-- PostgreSQL lets PUBLIC execute every new function. 0001 revoked that once, for the
-- functions it made; two trigger functions made later kept it (harmless: a trigger
-- function cannot be called on its own), and a function a later migration adds would
-- have it too — a SECURITY DEFINER one would then run with the owner's rights for any
-- role that can log in. Functions this role makes from now on start closed; each
-- migration grants EXECUTE to the roles that need it, as 0012, 0013 and 0014 do.

REVOKE EXECUTE ON FUNCTION qinglong.enforce_approval_decided_once() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION qinglong.enforce_join_token_single_use() FROM PUBLIC;

-- Global, not IN SCHEMA: a per-schema default can only add to the global one.
ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
