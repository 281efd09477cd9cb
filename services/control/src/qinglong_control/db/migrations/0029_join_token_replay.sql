-- 0029: a join whose answer was lost can be tried again with the same token and key.
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

ALTER TABLE qinglong.worker_join_tokens
    ADD COLUMN used_key_sha256 qinglong.sha256_hex,
    ADD CONSTRAINT worker_join_tokens_key_only_when_used
        CHECK (used_key_sha256 IS NULL OR used_at_ms IS NOT NULL) NOT VALID;
-- NOT VALID: every existing row has no key, so nothing needs reading (new rows are checked).

GRANT UPDATE (used_key_sha256) ON qinglong.worker_join_tokens TO qinglong_admin;
