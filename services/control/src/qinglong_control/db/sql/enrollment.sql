-- Statements of db/enrollment.py, run as the admin role: a join token is consumed in the
-- same transaction that reads the Worker it enrolls.

-- name: consume_join_token
-- Single use and short-lived: the UPDATE succeeds only for an unused, unexpired token of
-- an active Worker, and at most once (a concurrent second use finds used_at_ms set).
-- A token IssueJoinToken superseded, and its request records, are marked used already.
UPDATE qinglong.worker_join_tokens AS t
   SET used_at_ms = qinglong.db_now_ms()
  FROM qinglong.worker_identities AS w
 WHERE t.token_digest = %s
   AND t.used_at_ms IS NULL
   AND t.expires_at_ms > qinglong.db_now_ms()
   AND w.worker_id = t.worker_id
   AND w.status = 'active'
RETURNING t.worker_id, w.certificate_uri, qinglong.db_now_ms() AS now_ms

-- name: active_worker_identity
-- A Worker renewing its certificate: still enrolled and active (ingress checked it at
-- authentication; this re-reads it in control's own transaction).
SELECT worker_id, certificate_uri, qinglong.db_now_ms() AS now_ms
  FROM qinglong.worker_identities
 WHERE worker_id = %s AND status = 'active'
