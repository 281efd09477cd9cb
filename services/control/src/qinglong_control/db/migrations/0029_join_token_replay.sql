-- 0029: a join whose answer was lost can be tried again with the same token and key;
-- a spent token names the call that spent it.
--
-- A join token is spent in the transaction that checks it, before the certificate is
-- signed and answered; an answer lost on the way (a timeout, a dropped connection) left
-- the machine with a spent token and no certificate, and only an administrator's new
-- token helped (a Kubernetes Worker's join container crash-looped until then). The token
-- now records the public key it was spent for: the same token with the same key, while
-- the token has not expired and its Worker is active, is answered again (a certificate
-- for that key, which only the machine holding the key can use). Any other key is
-- refused as before. A token superseded by a new one was marked used with no key and
-- stays unusable. The single-use trigger already fixes the row once it is used, this
-- column with it.

--
-- Ingress audits a join before control checks its token (only control can), so its
-- audit row says "admitted" whether the token enrolled a Worker or not, and names no
-- Worker (the call is anonymous). The token now keeps the audit id of the call that
-- spent it: the audit listing names the Worker a JoinWorker call enrolled, and a
-- JoinWorker row that names none was refused by control (or failed).

ALTER TABLE qinglong.worker_join_tokens
    ADD COLUMN used_key_sha256 qinglong.sha256_hex,
    ADD COLUMN used_by_audit_id uuid,
    ADD CONSTRAINT worker_join_tokens_key_only_when_used
        CHECK (used_key_sha256 IS NULL OR used_at_ms IS NOT NULL) NOT VALID;
-- NOT VALID: every existing row has no key, so nothing needs reading (new rows are checked).

-- The audit listing looks each JoinWorker row's token up by it.
CREATE INDEX worker_join_tokens_by_audit ON qinglong.worker_join_tokens (used_by_audit_id)
    WHERE used_by_audit_id IS NOT NULL;

GRANT UPDATE (used_key_sha256, used_by_audit_id) ON qinglong.worker_join_tokens
    TO qinglong_admin;
