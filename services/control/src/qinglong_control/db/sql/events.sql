-- Statements of db/events.py.

-- name: advance_sequence
UPDATE qinglong.runs SET event_sequence = event_sequence + %(count)s
 WHERE run_id = %(run_id)s AND event_sequence = %(after)s

-- name: append_event
INSERT INTO qinglong.run_events
       (event_id, run_id, sequence, event_type, attempt_id, actor_kind, actor_id,
        occurred_at_ms, payload, dedupe_key)
VALUES (%(event_id)s, %(run_id)s, %(sequence)s, %(event_type)s, %(attempt_id)s,
        %(actor_kind)s, %(actor_id)s, %(occurred_at_ms)s, %(payload)s, %(dedupe_key)s)
