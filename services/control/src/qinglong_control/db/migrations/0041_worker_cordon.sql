-- 0041: an administrator may cordon a Worker.
--
-- Maintenance on a Worker's machine meant disabling the Worker (its identity refused,
-- its sessions fenced, its running Attempts lost) or stopping it and losing them the same
-- way. A cordoned Worker is offered no new Run and may claim none, while its running
-- Attempts go on, renew and report; once its fleet row shows no live Attempt it can be
-- stopped, and uncordoned when it is back. The flag belongs to the Worker, not to a
-- session, so a restart keeps it.
--
-- A constant default: no row is rewritten. The admin role may change this column only
-- (as 0026 limits it to the columns its decisions change).

ALTER TABLE qinglong.worker_identities
    ADD COLUMN cordoned boolean NOT NULL DEFAULT false;

GRANT UPDATE (cordoned) ON qinglong.worker_identities TO qinglong_admin;
