-- 0026: the admin role may update only the columns its statements change.
--
-- It held UPDATE on whole identity tables (0006): its credentials, or a bug in an admin
-- statement, could rewrite what no administration changes — a Worker's certificate name,
-- a principal's kind or name, a token's digest, who is a cluster admin. Column grants keep
-- its writes to the decisions it makes: disabling, archiving, revoking, ending a token,
-- rebinding a role, scoping a Worker, spending a join token. (Row locks FOR NO KEY UPDATE
-- need UPDATE on some column of their table, which each locked table keeps.)

REVOKE UPDATE ON qinglong.projects, qinglong.principals, qinglong.operator_credentials,
                 qinglong.role_bindings, qinglong.worker_identities,
                 qinglong.worker_join_tokens, qinglong.cluster_admins
    FROM qinglong_admin;

GRANT UPDATE (status, version) ON qinglong.projects TO qinglong_admin;
GRANT UPDATE (status) ON qinglong.principals TO qinglong_admin;
GRANT UPDATE (status, expires_at_ms) ON qinglong.operator_credentials TO qinglong_admin;
GRANT UPDATE (role, status, version, updated_at_ms) ON qinglong.role_bindings
    TO qinglong_admin;
GRANT UPDATE (status, project_ids) ON qinglong.worker_identities TO qinglong_admin;
GRANT UPDATE (used_at_ms) ON qinglong.worker_join_tokens TO qinglong_admin;
