-- 0019: an Agent is never a cluster admin.
--
-- As a cluster admin an Agent could create a user, issue it a token and approve its own
-- held requests through it (SPEC R-CAN-2, R-OPS-2). Control no longer makes one, and
-- ingress refuses an Agent's AdminService call; a grant an earlier version wrote is
-- removed here, so listings and `bootstrap-admin` (which asks whether a cluster admin
-- exists) see what ingress enforces.

DELETE FROM qinglong.cluster_admins c
 USING qinglong.principals p
 WHERE p.principal_id = c.principal_id AND p.kind = 'agent';
