-- Statements of db/enrollment.py, run as the admin role: a join token is consumed in the
-- same transaction that reads the Worker it enrolls.

-- name: consume_join_token
-- Single use and short-lived: the UPDATE succeeds only for an unused, unexpired token of
-- an active Worker, and at most once (a concurrent second use finds used_at_ms set).
-- A token IssueJoinToken superseded, and its request records, are marked used already.
-- It records the key it was spent for (a lost answer's retry: replayed_join) and the
-- audit row of the call that spent it (the audit listing names the Worker enrolled).
UPDATE qinglong.worker_join_tokens AS t
   SET used_at_ms = qinglong.db_now_ms(), used_key_sha256 = %(key_digest)s,
       used_by_audit_id = %(audit_id)s
  FROM qinglong.worker_identities AS w
 WHERE t.token_digest = %(token_digest)s
   AND t.used_at_ms IS NULL
   AND t.expires_at_ms > qinglong.db_now_ms()
   AND w.worker_id = t.worker_id
   AND w.status = 'active'
RETURNING t.worker_id, w.certificate_uri, qinglong.db_now_ms() AS now_ms

-- name: replayed_join
-- The same token again with the key it was spent for, before it expires, its Worker
-- active and no newer token issued to it (a new join token ends every earlier one): the
-- join whose answer was lost. FOR KEY SHARE: the row lock writes WAL, so
-- this answer, like the first, is given only once the spending is on the synchronous
-- standby (migration 0028).
SELECT t.worker_id, w.certificate_uri, qinglong.db_now_ms() AS now_ms
  FROM qinglong.worker_join_tokens AS t
  JOIN qinglong.worker_identities AS w ON w.worker_id = t.worker_id
 WHERE t.token_digest = %(token_digest)s
   AND t.used_key_sha256 = %(key_digest)s
   AND t.expires_at_ms > qinglong.db_now_ms()
   AND w.status = 'active'
   AND NOT EXISTS (SELECT 1 FROM qinglong.worker_join_tokens AS n
                    WHERE n.worker_id = t.worker_id AND n.token_digest <> t.token_digest
                      AND n.created_at_ms >= t.created_at_ms)
   FOR KEY SHARE OF t

-- name: active_worker_identity
-- A Worker renewing its certificate: still enrolled and active (ingress checked it at
-- authentication; this re-reads it in control's own transaction).
SELECT worker_id, certificate_uri, qinglong.db_now_ms() AS now_ms
  FROM qinglong.worker_identities
 WHERE worker_id = %s AND status = 'active'
