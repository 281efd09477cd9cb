-- Statements of db/output.py (Run output, R-OPS-1; migration 0010).

-- name: lock_stream
-- Serialises the appends of one Attempt (a re-sent chunk racing its original). Its own
-- key, not the Attempt's command lock: shipping output never waits for lease control.
SELECT pg_advisory_xact_lock(hashtextextended('qinglong.output:' || %s, 0))

-- name: owner
-- The Attempt's authority. Its identity columns never change once claimed (the
-- attempts_authority_fixed trigger), so they are read without a row lock.
SELECT a.attempt_id, a.run_id, r.project_id, a.worker_id, a.session_id, a.worker_generation,
       a.offer_id, a.lease_generation, a.lease_token_digest
  FROM qinglong.attempts a JOIN qinglong.runs r ON r.run_id = a.run_id
 WHERE a.attempt_id = %s

-- name: stream
SELECT end_offset, first_offset FROM qinglong.attempt_output WHERE attempt_id = %s FOR UPDATE

-- name: overlapping
-- The kept chunks that share bytes with [from, until). A chunk is at most one chunk's
-- size, so one that ends after `from` starts after `earliest_start` (the primary key's
-- range, not a walk over every chunk before it).
SELECT start_offset, data FROM qinglong.attempt_output_chunks
 WHERE attempt_id = %(attempt_id)s
   AND start_offset > %(earliest_start)s AND start_offset < %(until)s
   AND end_offset > %(from)s
 ORDER BY start_offset

-- name: append
-- The new tail as one chunk at the old end; the chunks wholly before `keep_from` go (the
-- size bound); the stream row records the new end and the first byte still kept. The
-- CTEs see one snapshot, so the new chunk is never among the trimmed.
WITH stored AS (
    INSERT INTO qinglong.attempt_output_chunks (attempt_id, start_offset, end_offset, data)
    VALUES (%(attempt_id)s, %(write_offset)s, %(end_offset)s, %(data)s)
), trimmed AS (
    DELETE FROM qinglong.attempt_output_chunks
     WHERE attempt_id = %(attempt_id)s
       AND start_offset < %(keep_from)s AND end_offset <= %(keep_from)s
    RETURNING end_offset
)
INSERT INTO qinglong.attempt_output AS o
       (attempt_id, end_offset, first_offset, created_at_ms, updated_at_ms)
VALUES (%(attempt_id)s, %(end_offset)s,
        coalesce((SELECT max(end_offset) FROM trimmed), 0), %(now)s, %(now)s)
ON CONFLICT (attempt_id) DO UPDATE
   SET end_offset = excluded.end_offset,
       first_offset = greatest(o.first_offset, excluded.first_offset),
       updated_at_ms = excluded.updated_at_ms

-- name: read_page
-- The Run (in its project), the Attempt asked for (by number, else the latest), where its
-- stream stands, and the kept chunks that hold the page: from `from` (or the first kept
-- byte, if retention removed it; see `overlapping` for `earliest_start`) up to
-- `max_bytes` further, so a page never reads more of the stream than it returns. One
-- statement, so one snapshot: the bytes, the end and `complete` agree with one another.
-- One row per chunk (the Attempt's columns repeated), or one row with no chunk. No row:
-- no such Run here; a NULL attempt_id: no such Attempt.
WITH located AS (
    SELECT r.state AS run_state, a.attempt_id, a.attempt_number, a.log_artifact_id,
           a.finished_at_ms IS NOT NULL AS complete, a.output_bytes,
           coalesce(o.end_offset, 0) AS end_offset, coalesce(o.first_offset, 0) AS first_offset
      FROM qinglong.runs r
      LEFT JOIN qinglong.attempts a
             ON a.run_id = r.run_id
            AND a.attempt_number = coalesce(%(attempt_number)s::bigint, r.attempt_count)
      LEFT JOIN qinglong.attempt_output o ON o.attempt_id = a.attempt_id
     WHERE r.project_id = %(project_id)s AND r.run_id = %(run_id)s
)
SELECT l.run_state, l.attempt_id, l.attempt_number, l.log_artifact_id, l.complete,
       l.output_bytes, l.end_offset, l.first_offset, c.start_offset, c.data
  FROM located l
  LEFT JOIN LATERAL (
        SELECT start_offset, data FROM qinglong.attempt_output_chunks
         WHERE attempt_id = l.attempt_id
           AND start_offset > %(earliest_start)s AND end_offset > %(from)s
           AND start_offset < greatest(%(from)s, l.first_offset) + %(max_bytes)s
         ORDER BY start_offset
         LIMIT %(limit)s
       ) c ON true
 ORDER BY c.start_offset

-- name: expire
-- One bounded step of the age sweep: at most `limit` chunks, the oldest chunks of the
-- streams not written to for `max_age_ms` of DB time (oldest stream first), so a step
-- never outgrows statement_timeout however large a stream is, and the next step goes on
-- from where this one stopped. Each stream touched keeps `first_offset` at the end of its
-- last removed chunk (chunks are contiguous: once all are gone, that is its end); the
-- stream row stays (its end still recognises a re-sent chunk). A stream that is to
-- expire but holds no chunk is closed at its end. SKIP LOCKED: control replicas share
-- the work, and a stream with an append in flight is left to the next step.
WITH streams AS MATERIALIZED (
    SELECT attempt_id, updated_at_ms FROM qinglong.attempt_output
     WHERE first_offset < end_offset
       AND updated_at_ms < (SELECT qinglong.db_now_ms()) - %(max_age_ms)s
     ORDER BY updated_at_ms, attempt_id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), doomed AS MATERIALIZED (
    SELECT c.attempt_id, c.start_offset
      FROM streams s
      CROSS JOIN LATERAL (
          SELECT k.attempt_id, k.start_offset FROM qinglong.attempt_output_chunks k
           WHERE k.attempt_id = s.attempt_id
           ORDER BY k.start_offset
           LIMIT %(limit)s
      ) c
     ORDER BY s.updated_at_ms, s.attempt_id, c.start_offset
     LIMIT %(limit)s
), removed AS (
    DELETE FROM qinglong.attempt_output_chunks c USING doomed d
     WHERE c.attempt_id = d.attempt_id AND c.start_offset = d.start_offset
    RETURNING c.attempt_id, c.end_offset
), kept_from AS (
    SELECT attempt_id, max(end_offset) AS first_offset FROM removed GROUP BY attempt_id
), advanced AS (
    UPDATE qinglong.attempt_output o
       SET first_offset = coalesce(k.first_offset, o.end_offset)
      FROM streams s LEFT JOIN kept_from k USING (attempt_id)
     WHERE o.attempt_id = s.attempt_id
       AND (k.first_offset IS NOT NULL OR NOT EXISTS (
               SELECT 1 FROM qinglong.attempt_output_chunks x WHERE x.attempt_id = s.attempt_id))
    RETURNING o.attempt_id, o.first_offset = o.end_offset AS emptied
)
SELECT (SELECT count(*) FROM removed) AS chunks,
       (SELECT count(*) FROM advanced WHERE emptied) AS streams
