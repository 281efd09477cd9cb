-- 0025: a Worker's certificate URI names that Worker, under some trust domain.
--
-- Control's CA signs the services' certificates too. It computes a joining or renewing
-- Worker's name itself (enrollment_servicer.py), but the table should not be able to
-- hold `spiffe://<td>/service/ingress` for a Worker in the first place, whoever writes
-- it (the admin role may insert and update identities). NOT VALID: rows already there
-- are not re-read (db/migrate.py's rule for new CHECKs); every new or changed row is held.

ALTER TABLE qinglong.worker_identities
    ADD CONSTRAINT worker_identities_uri_names_the_worker
    CHECK (certificate_uri ~ '^spiffe://[^/]+/worker/[a-z0-9][a-z0-9-]{0,62}$'
           AND split_part(certificate_uri, '/', 5) = worker_id)
    NOT VALID;
